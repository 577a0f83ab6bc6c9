"""The module that registers fxglm5's GLM-5 with RTP-LLM as ``glm_5`` (taking it over from RTP's own DeepSeekV2
class) and as ``fxglm5_glm5``, and its MTP draft as ``glm_5-mtp``. Two launches import it in the launcher and in
every process RTP spawns:
``python -m fxglm5.rtpllm.serve <RTP's arguments>`` on stock RTP (``fxglm5.rtpllm.serve``; docs/rtp_launch.md), and
``--external_model_packages fxglm5.rtpllm.models`` on RTP with PR #1266 (no environment variable is read).

Without ``rtp_llm`` (unit tests, other engines) the import does nothing and loads nothing heavy. With it, a
failure to register is an error: a plugin that silently did not load would leave RTP serving its own model.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("rtp_llm") is not None:
    from fxglm5.rtpllm import glm5, speculative

    speculative.register(glm5.register())
