"""Test stand-in of ``rtp_llm.models_py.model_desc`` (not RTP-LLM code)."""
