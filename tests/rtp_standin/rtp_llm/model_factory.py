"""Test stand-in of ``rtp_llm/model_factory.py`` (rtp-llm 4b8d39cd5; not RTP-LLM code): what a launch does
with the model classes, in RTP's order.

- ``get_model_cls`` (``:58-63``): ``ensure_model_registered``, then ``_model_factory``.
- ``create_model_config`` (``:306-380``): ``get_model_cls(model_type)`` (``:341``), ``_create_config(ckpt_path)``
  (``:342``), then ``build_model_config``. With PR #1266 it first imports the ``--external_model_packages``
  (6a6024414, before ``:341``). The stand-in's ``build_model_config`` sets only the fields a plugin reads.
- ``create_propose_model_config`` (``:404-482``), called by ``BackendManager.start`` after the target's config
  and **before any model is loaded** (``backend_manager.py:131-135``): None without a speculative type or without
  ``sp_checkpoint_path`` (``:423-427``); a type other than MTP / EAGLE / DSpARK is a ValueError (``:430-442``);
  then ``get_model_cls(sp_model_type)._create_config(sp_checkpoint_path)`` (``:454-457``), the target's
  ``max_seq_len`` (``:459``) and ``build_model_config`` with the target's ``act_type`` (``:449``, ``:468-475``).
  ``SP_TYPE`` is read by ``SpeculativeExecutionConfig::from_string`` (``cpp/config/ConfigModules.cc:256-274``):
  exact lower-case names, anything else silently NONE. No external package is imported here, even with #1266:
  the rank's ``create_model_config`` already did.
- ``from_model_configs`` (``:231-301``): the target built and loaded (``_create_model``, ``:262-267``:
  ``from_config`` calls ``load``), then the draft built and loaded with the **target's** ``parallelism_config``
  (``get_sp_model``, ``:280-285`` -> ``:183-199``) and RTP's weight alias (``:173-218``: the draft class's
  ``speculative_weight_alias_names(target, draft config)``, the draft built with ``weight_alias_owner`` = the loaded
  target and those names, then each name's tensor required to be the target's own), and only then the engine
  (``create_engine``, ``:292-299``), whose warm-up, cache and CUDA graphs come after both loads.

``events`` records each step, in order, for the stand-in's launch tests (no RTP counterpart).
"""

from rtp_llm.model_factory_register import _model_factory, ensure_model_registered
from rtp_llm.standin_engine import Engine, HWKernelConfig, build_model_config, create_model, engine_kwargs
from rtp_llm.utils.import_util import load_external_model_packages

# SpeculativeExecutionConfig::from_string (cpp/config/ConfigModules.cc:256-274): these exact (lower-case) names,
# anything else silently NONE
SPECULATIVE_TYPES = ("none", "vanilla", "mtp", "eagle3", "eagle", "deterministic", "dspark")
DRAFT_TYPES = ("mtp", "eagle", "dspark")  # create_propose_model_config: the learned-draft engine's types


def speculative_type(value):
    """``SP_TYPE`` / ``--sp_type`` as RTP reads it: "" and unknown names (e.g. "MTP") are "none"."""
    return value if value in SPECULATIVE_TYPES else "none"


class ModelFactory:
    events = []  # (step, model type): what this process's launch did, in order

    @staticmethod
    def get_model_cls(model_type):
        ensure_model_registered(model_type)  # the stand-in's raises RTP's KeyError itself
        return _model_factory[model_type]

    @staticmethod
    def _config_kwargs(args):
        kw = engine_kwargs(args)
        return dict(act_type=kw["act_type"], fp8_kv_cache=kw["fp8_kv_cache"],
                    seq_size_per_block=kw["seq_size_per_block"], max_seq_len=kw["max_seq_len"])

    @staticmethod
    def create_model_config(py_env_configs):
        """``(model class, its built config)`` for the launch's model type and checkpoint."""
        args = py_env_configs.args
        if py_env_configs.pr1266:
            load_external_model_packages(args["external_model_packages"])
        model_cls = ModelFactory.get_model_cls(args["model_type"])
        config = build_model_config(model_cls, args["checkpoint_path"], **ModelFactory._config_kwargs(args))
        config.model_type = args["model_type"]
        ModelFactory.events.append(("create_model_config", args["model_type"]))
        return model_cls, config

    @staticmethod
    def create_propose_model_config(py_env_configs, model_config):
        """``(draft class, its built config)``, or None when the launch has no draft model."""
        args = py_env_configs.args
        sp_type = speculative_type(args["sp_type"])
        if sp_type == "none" or not args["sp_checkpoint_path"]:
            return None
        if sp_type not in DRAFT_TYPES:
            raise ValueError(f"Speculative engine only supports MTP, EAGLE and DSpARK, but got {sp_type.upper()}")
        draft_cls = ModelFactory.get_model_cls(args["sp_model_type"])
        kw = dict(ModelFactory._config_kwargs(args), max_seq_len=model_config.max_seq_len)
        config = build_model_config(draft_cls, args["sp_checkpoint_path"], **kw)
        config.model_type = args["sp_model_type"]
        ModelFactory.events.append(("create_propose_model_config", args["sp_model_type"]))
        return draft_cls, config

    @staticmethod
    def from_model_configs(py_env_configs, parallelism_config, model, propose=None):
        """The target loaded, then the draft (if any) loaded, then the engine started around them."""
        args = py_env_configs.args
        kw = engine_kwargs(args, external_model_packages=None)  # create_model_config imported them
        hw = HWKernelConfig(kw["enable_cuda_graph"], _capture_sizes(kw))
        model_cls, config = model
        target = create_model(model_cls, config, parallelism_config, hw, _max_batch(kw))
        ModelFactory.events.append(("load", config.model_type))
        draft = None
        if propose is not None:
            draft_cls, draft_config = propose
            names = weight_alias_names(draft_cls, target, draft_config)
            model = create_model(draft_cls, draft_config, parallelism_config, hw, _max_batch(kw),
                                 weight_alias_owner=target if names else None, weight_alias_names=names)
            check_weight_aliases(target, model, names)
            draft = draft_cls, draft_config, model, names
            ModelFactory.events.append(("load", draft_config.model_type))
        ModelFactory.events.append(("create_engine", config.model_type))
        if draft is None:
            return Engine(args["checkpoint_path"], parallelism_config=parallelism_config, model=target, **kw)
        return _mtp_engine(args, parallelism_config, target, draft, kw)


def weight_alias_names(draft_cls, target, draft_config):
    """``get_sp_model``'s alias names (``model_factory.py:173-181``): the draft class's
    ``speculative_weight_alias_names(target, draft config)``, asked only with a loaded target; a target without
    weights cannot own them (RuntimeError)."""
    names = tuple(draft_cls.speculative_weight_alias_names(target, draft_config)) if target is not None else ()
    if names and target.weight is None:
        raise RuntimeError("speculative shared-weight owner is not loaded")
    return names


def check_weight_aliases(target, draft, names):
    """``get_sp_model``'s identity check (``model_factory.py:200-210``): each aliased global weight of the loaded
    draft must be the owner's tensor itself, on the same storage."""
    for name in names:
        owner, alias = target.weight.get_global_weight(name), draft.weight.get_global_weight(name)
        if alias is not owner or alias.data_ptr() != owner.data_ptr():
            raise RuntimeError(f"speculative global weight alias {name!r} did not preserve storage identity")


def _capture_sizes(kw):
    from rtp_llm.standin_engine import DEFAULT_CAPTURE_SIZES

    sizes = tuple(kw["decode_capture_batch_sizes"] or ())
    return sizes or tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= _max_batch(kw))


def _max_batch(kw):
    sizes = tuple(kw["decode_capture_batch_sizes"] or ())
    return kw["max_generate_batch_size"] or (max(sizes) if sizes else 32)


class _LoadedDraft:
    """The draft the launch has already loaded, handed to ``standin_speculative.MtpEngine``, which builds its
    draft itself: its ``_create_config`` and ``from_config`` give back the built config and the loaded model
    (a stand-in device; RTP's ``create_engine`` takes the loaded ``ProposeModel``). The launch applied RTP's weight
    alias when it loaded the draft; ``speculative_weight_alias_names`` gives MtpEngine those names (for the target
    the draft was loaded against only), and ``from_config`` requires MtpEngine to ask for exactly them, so that
    MtpEngine's identity check runs on the launched draft."""

    def __init__(self, cls, config, model, parallelism_config, target, alias_names):
        self.cls, self.config, self.model, self.parallelism_config = cls, config, model, parallelism_config
        self.target, self.alias_names = target, tuple(alias_names)

    def _create_config(self, ckpt_path):
        assert ckpt_path == self.config.ckpt_path, (ckpt_path, self.config.ckpt_path)
        return self.config

    def speculative_weight_alias_names(self, target_model, draft_model_config):
        assert target_model is self.target and draft_model_config is self.config
        return self.alias_names

    def from_config(self, config, parallelism_config, *args, weight_alias_owner=None, weight_alias_names=()):
        assert config is self.config and parallelism_config is self.parallelism_config
        assert tuple(weight_alias_names) == self.alias_names, (weight_alias_names, self.alias_names)
        assert weight_alias_owner is (self.target if self.alias_names else None)
        return self.model


_LOADED_DRAFT = "__standin_loaded_draft__"  # a private model type, bound only while MtpEngine starts


def _mtp_engine(args, parallelism_config, target, draft, kw):
    from rtp_llm import standin_report
    from rtp_llm.standin_speculative import MtpEngine

    draft_cls, draft_config, draft_model, alias_names = draft
    _model_factory[_LOADED_DRAFT] = _LoadedDraft(draft_cls, draft_config, draft_model, parallelism_config, target,
                                                 alias_names)
    try:
        return MtpEngine(args["checkpoint_path"], sp_model_type=_LOADED_DRAFT,
                         sp_checkpoint_path=args["sp_checkpoint_path"], sp_type=speculative_type(args["sp_type"]),
                         gen_num_per_cycle=args["gen_num_per_cycle"], parallelism_config=parallelism_config,
                         model=target, forced_drafts=standin_report.forced_drafts(), **kw)
    finally:
        del _model_factory[_LOADED_DRAFT]
