"""Test stand-in of ``rtp_llm.model_loader`` (not RTP-LLM code)."""
