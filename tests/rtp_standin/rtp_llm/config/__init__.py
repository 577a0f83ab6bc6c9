"""Test stand-in of ``rtp_llm.config`` (not RTP-LLM code)."""
