"""Test stand-in of ``rtp_llm.models_py`` (not RTP-LLM code)."""
