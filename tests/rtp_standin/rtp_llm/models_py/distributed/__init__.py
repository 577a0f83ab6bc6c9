"""Test stand-in of ``rtp_llm.models_py.distributed`` (not RTP-LLM code)."""
