"""The module RTP-LLM imports (``--external_model_packages fxglm5.rtpllm.models`` on the command line: RTP-LLM
PR #1266's flag; no environment variable is read): registers fxglm5's GLM-5 as ``glm_5`` (taking it over from
RTP's own DeepSeekV2 class) and as ``fxglm5_glm5``. RTP imports it in its launcher and again in every rank process.

Without ``rtp_llm`` (unit tests, other engines) the import does nothing and loads nothing heavy. With it, a
failure to register is an error: a plugin that silently did not load would leave RTP serving its own model.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("rtp_llm") is not None:
    from fxglm5.rtpllm.glm5 import register

    register()
