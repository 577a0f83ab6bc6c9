"""Test stand-in of RTP-LLM's model registry (not RTP-LLM code; written from the external-model contract).

``_model_factory`` maps a registry key (MODEL_TYPE) to the outer model class, ``_hf_architecture_2_ft`` a
config.json architecture to a key, ``_hf_repo_2_ft`` a Hugging Face repo id to a key.
"""

_model_factory = {}
_hf_architecture_2_ft = {}
_hf_repo_2_ft = {}


def register_model(name, cls, support_architectures=None, support_hf_repos=None):
    """Bind ``name`` to ``cls``; raise if ``name`` is bound to another class (same class: no-op)."""
    bound = _model_factory.get(name)
    if bound is not None and bound is not cls:
        raise Exception(
            f"model type {name!r} is already registered to {bound.__module__}.{bound.__qualname__}; "
            f"cannot register {cls.__module__}.{cls.__qualname__}"
        )
    _model_factory[name] = cls
    for arch in support_architectures or ():
        _hf_architecture_2_ft[arch] = name
    for repo in support_hf_repos or ():
        _hf_repo_2_ft[repo] = name
