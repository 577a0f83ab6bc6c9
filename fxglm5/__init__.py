"""fxglm5: serve GLM-5-FP8 through a compiler: torch.export + FX passes + Triton kernels."""

from fxglm5.errors import CheckpointError, ConfigError, Fxglm5Error, InputError, PassError
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM

__all__ = ["Glm5Config", "Glm5ForCausalLM", "Fxglm5Error", "ConfigError", "CheckpointError", "InputError", "PassError"]
__version__ = "0.1.0"
