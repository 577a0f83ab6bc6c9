"""Test stand-in of ``rtp_llm.models`` (not RTP-LLM code)."""
