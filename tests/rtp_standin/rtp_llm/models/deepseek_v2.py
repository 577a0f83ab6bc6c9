"""Test stand-in of RTP-LLM's own DeepSeek-V2/V3/GLM-5 model module (not RTP-LLM code).

Importing it binds ``deepseek2`` and ``glm_5`` to ``DeepSeekV2`` (RTP does so at ``models/deepseek_v2.py:831``),
which a plugin taking ``glm_5`` over must do after. The class cannot load here: a launch that resolves ``glm_5``
to it is RTP serving its own model instead of the plugin's.
"""

from rtp_llm.model_factory_register import register_model
from rtp_llm.models.base_model import BaseModel


class DeepSeekV2(BaseModel):
    """RTP's built-in model (``load`` is the base class's: no RTP weight loader in the stand-in)."""

    def support_cuda_graph(self):
        return True


register_model("deepseek2", DeepSeekV2, ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
register_model("glm_5", DeepSeekV2, ["GlmMoeDsaForCausalLM"])
