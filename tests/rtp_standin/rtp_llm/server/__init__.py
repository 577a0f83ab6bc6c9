"""Test stand-in of ``rtp_llm.server`` (not RTP-LLM code): only its argument parsing (``server_args``)."""
