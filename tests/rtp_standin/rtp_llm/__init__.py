"""Test stand-in of the RTP-LLM package (not RTP-LLM code), rebuilt from RTP-LLM's source: see ../README.md."""
