"""Test stand-in of ``rtp_llm/config/server_config_setup.py`` (rtp-llm 4b8d39cd5; not RTP-LLM code).

- ``set_parallelism_config`` (``:246-310``): the rank fields derived from ``world_rank`` and the sizes, and RTP's
  EP rule (``ep_size`` 0, i.e. ``EP_SIZE`` unset, becomes tp * dp; 1 is pure TP and needs dp == 1; anything else
  must equal tp * dp).
- ``setup_and_configure_server`` (``:557-566``) / ``setup_default_args`` (``:384-404``), in the server's parent
  process: the parallelism config, then the model type inferred from config.json's ``architectures`` when
  ``MODEL_TYPE`` is unset (``_infer_model_type``, ``:364-381``). RTP patched with PR #1266 imports the
  ``--external_model_packages`` first, before the inference.
"""

import json
import os


def set_parallelism_config(parallelism_config, world_rank=None):
    pc = parallelism_config
    if pc.world_size > 1 and pc.local_world_size == 1:
        pc.local_world_size = pc.world_size  # one host, no CUDA: every rank is local
    if pc.ep_size == 1:
        assert pc.dp_size == 1, f"Pure TP mode (ep_size=1) requires dp_size == 1, got dp_size={pc.dp_size}"
    elif pc.ep_size == 0:
        pc.ep_size = pc.tp_size * pc.dp_size
    else:
        assert pc.ep_size == pc.tp_size * pc.dp_size, (
            f"ep_size must be equal to 1 or tp_size * dp_size, got ep_size={pc.ep_size}, tp_size={pc.tp_size}, "
            f"dp_size={pc.dp_size}")
    pc.ffn_tp_size = pc.tp_size // pc.ffn_sp_size
    pc.enable_sp = pc.ffn_sp_size > 1
    if world_rank is not None:
        pc.world_rank = world_rank
    pc.local_rank = pc.world_rank % pc.local_world_size
    pc.tp_rank = pc.world_rank % pc.tp_size
    pc.dp_rank = pc.world_rank // pc.tp_size
    pc.ep_rank = pc.world_rank % pc.ep_size
    pc.ffn_tp_rank = pc.tp_rank % pc.ffn_tp_size


def _infer_model_type(ckpt_path):
    """``_infer_model_type``: config.json's ``architectures[0]`` through ``_hf_architecture_2_ft``, else None."""
    from rtp_llm.model_factory_register import _hf_architecture_2_ft

    path = os.path.join(ckpt_path or "", "config.json")
    if not ckpt_path or not os.path.isfile(path):
        return None
    with open(path) as f:
        archs = json.load(f).get("architectures") or []
    return _hf_architecture_2_ft.get(archs[0]) if archs else None


def setup_default_args(py_env_configs):
    set_parallelism_config(py_env_configs.parallelism_config)
    args = py_env_configs.args
    if py_env_configs.pr1266:  # PR #1266 (6a6024414): before the type is inferred
        from rtp_llm.utils.import_util import load_external_model_packages

        load_external_model_packages(args["external_model_packages"])
    if not args["model_type"]:
        args["model_type"] = _infer_model_type(args["checkpoint_path"])
    if not args["model_type"]:
        raise ValueError(f"model_type is not set and could not be inferred from checkpoint path: "
                         f"{args['checkpoint_path']}. Please provide --model_type or MODEL_TYPE environment variable.")


def setup_and_configure_server(py_env_configs):
    setup_default_args(py_env_configs)
