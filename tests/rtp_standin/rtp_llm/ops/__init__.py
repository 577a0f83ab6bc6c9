"""Test stand-in of ``rtp_llm.ops`` (not RTP-LLM code)."""
