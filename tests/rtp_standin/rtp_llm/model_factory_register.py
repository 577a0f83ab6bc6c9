"""Test stand-in of RTP-LLM's model registry (``rtp_llm/model_factory_register.py`` at 4b8d39cd5; not
RTP-LLM code).

``_model_factory`` maps a model type (MODEL_TYPE) to the outer model class, ``_hf_architecture_2_ft`` a
config.json architecture to a type. Built-in models are registered lazily (the architecture mapping now, the
class when first needed): ``ensure_model_registered`` imports a type's module only when ``_model_factory``
lacks it, so a plugin that has bound ``glm_5`` itself wins. Re-binding a name or an architecture to something
else raises, as in RTP.
"""

import importlib
from collections import Counter

_model_factory = {}
_register_calls = Counter()  # stand-in only: register_model calls per name, for the launch tests
_hf_architecture_2_ft = {}
_hf_repo_2_ft = {}
_lazy_modules = {}


def _bind(table, name, value):
    if name in table and table[name] != value:
        raise Exception(f"try register model {name} with type {table[name]} and {value}, confict!")
    table[name] = value


def register_model(name, model_type, support_architectures=None, support_hf_repos=None):
    _register_calls[name] += 1
    _bind(_model_factory, name, model_type)
    for arch in support_architectures or ():
        _bind(_hf_architecture_2_ft, arch, name)
    for repo in support_hf_repos or ():
        _bind(_hf_repo_2_ft, repo, name)


def register_lazy_model(name, module_path, support_architectures=None):
    _lazy_modules[name] = module_path
    for arch in support_architectures or ():
        _bind(_hf_architecture_2_ft, arch, name)


def ensure_model_registered(name):
    """The class of model type ``name``, importing its built-in module if nothing registered it yet."""
    if name not in _model_factory and name in _lazy_modules:
        importlib.import_module(_lazy_modules[name])
    if name not in _model_factory:
        raise KeyError(f"model type [{name}] is not registered")
    return _model_factory[name]


register_lazy_model("deepseek2", "rtp_llm.models.deepseek_v2", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
register_lazy_model("glm_5", "rtp_llm.models.deepseek_v2", ["GlmMoeDsaForCausalLM"])
