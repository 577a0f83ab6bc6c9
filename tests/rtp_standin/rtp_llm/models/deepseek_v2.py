"""Test stand-in of RTP-LLM's own DeepSeek-V2/V3/GLM-5 model module (not RTP-LLM code).

Importing it binds ``deepseek2`` and ``glm_5`` to ``DeepSeekV2`` (RTP does so at ``models/deepseek_v2.py:831``),
which a plugin taking ``glm_5`` over must do after. The class cannot load here: a launch that resolves ``glm_5``
to it is RTP serving its own model instead of the plugin's.
"""

from rtp_llm.model_factory_register import register_model
from rtp_llm.models.base_model import BaseModel


class DeepSeekV2(BaseModel):
    """RTP's built-in model. The stand-in can neither build its config nor load it (``load`` is the base class's:
    no RTP weight loader). Real RTP does both, and serves it, without a word: a launch that reaches
    ``_create_config`` here is RTP serving its own model, and the error says so."""

    @classmethod
    def _create_config(cls, ckpt_path):
        raise NotImplementedError(
            f"RTP-LLM resolved this launch's model type to its own {cls.__module__}.{cls.__qualname__}, which real "
            f"RTP would load and serve without a word (the stand-in cannot build it): no plugin took the type over "
            f"in this process (on stock RTP-LLM: python -m fxglm5.rtpllm.serve; with PR #1266: "
            f"--external_model_packages)")

    def support_cuda_graph(self):
        return True


register_model("deepseek2", DeepSeekV2, ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
register_model("glm_5", DeepSeekV2, ["GlmMoeDsaForCausalLM"])
