"""Test stand-in of ``rtp_llm.server.server_args`` (not RTP-LLM code)."""
