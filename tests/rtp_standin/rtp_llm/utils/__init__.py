"""Test stand-in of ``rtp_llm.utils`` (not RTP-LLM code)."""
