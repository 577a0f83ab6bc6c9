"""Test stand-in of the RTP-LLM package (not RTP-LLM code), written from the external-model contract."""
