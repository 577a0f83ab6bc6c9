"""Front door: fxglm5 as an RTP-LLM external-model plugin (``fxglm5.rtpllm.models``).

Importing this package does nothing; importing ``fxglm5.rtpllm.models`` registers the model with RTP-LLM when
``rtp_llm`` is importable. What the plugin relies on in RTP-LLM is /work/shared/reference/rtp_llm_audit.md.
"""
