"""Test stand-in of RTP-LLM's own DeepSeek-V2/V3/GLM-5 model module (not RTP-LLM code).

Only the registration side effect matters: importing this binds ``deepseek2`` and ``glm_5`` to
``DeepSeekV2``, which a plugin taking over ``glm_5`` then rebinds. The class itself cannot run.
"""

from rtp_llm.model_factory_register import register_model
from rtp_llm.models.base_model import BaseModel


class DeepSeekV2(BaseModel):
    """RTP's built-in model (placeholder here: every model method raises NotImplementedError)."""


register_model("deepseek2", DeepSeekV2, ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
register_model("glm_5", DeepSeekV2, ["GlmMoeDsaForCausalLM"])
