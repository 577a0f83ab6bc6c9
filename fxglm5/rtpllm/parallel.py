"""RTP-LLM's ``parallelism_config`` as fxglm5's :class:`~fxglm5.parallel.Mapping`, RTP's TP process group as
fxglm5's ``"tp"`` group, and one rank's slices of the checkpoint (rtp-llm 4b8d39cd5).

- What RTP hands a model (``cpp/config/ConfigModules.h`` ``ParallelismConfig``, filled by
  ``config/server_config_setup.py:set_parallelism_config``): ``tp_size``, ``tp_rank`` (= world_rank % tp),
  ``ep_size`` (``EP_SIZE`` unset becomes tp * dp; 1 is pure TP), ``dp_size``, ``pp_size`` (never set by RTP's
  arguments: 1), ``world_size``, ``ffn_sp_size``, and ``get_attn_tp_size()`` (1 under prefill context parallel).
  The plugin serves every rank the same tokens (RTP's ``tpSyncModelInputs`` broadcasts each step from TP rank 0):
  ``dp_size == 1``, ``pp_size == 1``, ``ffn_sp_size == 1``, no context parallel, ``ep_size`` 1 or ``tp_size``.
  :func:`rtp_mapping` refuses anything else by field name. It reads only the config, so every rank raises the
  same error before any collective: a bad launch cannot leave the other ranks waiting in one.
- RTP's ``BackendManager`` initializes torch.distributed (``collective_torch.init_distributed_environment``) before
  it builds the model; the plugin never does. :func:`join_rtp_tp_group` takes RTP's TP group
  (``collective_torch._get_group(Group.TP)``: WORLD when world == tp) and registers it as ``"tp"``, which the
  shard stage's collectives resolve when they run.
- :func:`load_rtp_rank` reads this rank's slices as the Runner does at tp > 1 (``runtime.shard_loader``'s
  ``sharded_model`` and ``load_rank``: plan-hash agreement, then the slices), and the lm_head's vocabulary rows
  ``[V/tp * r, V/tp * (r + 1))``: RTP's post-layers multiply the hidden states by the published ``lm_head`` and
  all-gather the logits along the vocabulary in rank order (``PyWrappedModel::tpSyncEmbeddingOrLogits``).
"""

from __future__ import annotations

import importlib
import torch

from fxglm5.errors import ConfigError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import Mapping, Slice, register_group

COLLECTIVE = "rtp_llm.models_py.distributed.collective_torch"


def _field(par, name: str, default: int) -> int:
    value = getattr(par, name, default)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"parallelism_config.{name}={value!r}: not an integer")
    return value


def rtp_mapping(par, cfg: Glm5Config) -> Mapping:
    """This rank's Mapping from RTP's ``parallelism_config`` (tp 1: one rank). ConfigError naming the field RTP's
    launch set to what the plugin cannot serve; InputError naming the model's field that does not split."""
    tp, rank = _field(par, "tp_size", 1), _field(par, "tp_rank", 0)
    ep, dp, pp = _field(par, "ep_size", 1), _field(par, "dp_size", 1), _field(par, "pp_size", 1)
    if tp < 1:
        raise ConfigError(f"parallelism_config.tp_size={tp}: must be >= 1")
    if dp != 1:
        raise ConfigError(f"parallelism_config.dp_size={dp}: the fxglm5 plugin gives every rank the same tokens "
                          "(tensor / expert parallel); data-parallel attention is not supported (DP_SIZE=1)")
    if pp != 1:
        raise ConfigError(f"parallelism_config.pp_size={pp}: pipeline parallel is not supported")
    if ep not in (1, tp):
        raise ConfigError(f"parallelism_config.ep_size={ep}: must be 1 (EP_SIZE=1: every expert split along its "
                          f"intermediate dim) or tp_size={tp} (EP_SIZE unset: whole experts per rank)")
    sp = _field(par, "ffn_sp_size", 1)
    if sp != 1:
        raise ConfigError(f"parallelism_config.ffn_sp_size={sp}: sequence-parallel FFNs hand RTP's post-layers a "
                          "shard of the tokens; the plugin returns every token's hidden state (FFN_SP_SIZE=1)")
    attn_tp = par.get_attn_tp_size() if hasattr(par, "get_attn_tp_size") else tp
    if attn_tp != tp:
        raise ConfigError(f"parallelism_config.get_attn_tp_size()={attn_tp} with tp_size={tp}: prefill context "
                          "parallel is not supported")
    world = _field(par, "world_size", tp)
    if world != tp:
        raise ConfigError(f"parallelism_config.world_size={world}: the plugin's ranks are one TP group "
                          f"(world_size = tp_size = {tp})")
    if not 0 <= rank < tp:
        raise ConfigError(f"parallelism_config.tp_rank={rank}: not in [0, tp_size={tp})")
    mapping = Mapping(tp=tp, rank=rank, ep=ep)
    mapping.check(cfg)
    return mapping


def join_rtp_tp_group(mapping: Mapping) -> None:
    """Register RTP's TP process group as ``"tp"``; ConfigError if RTP has not created it or it is not this rank's."""
    import torch.distributed as dist

    where = f"parallelism_config.tp_size={mapping.tp}"
    try:
        collective = importlib.import_module(COLLECTIVE)
    except ImportError as err:
        raise ConfigError(f"{where}: rtp_llm has no {COLLECTIVE} ({err}), whose process groups the plugin uses") from err
    if not collective.distributed_environment_initialized():
        raise ConfigError(f"{where}: RTP's process groups are not initialized (its BackendManager calls "
                          "collective_torch.init_distributed_environment when world_size > 1); the plugin never "
                          "initializes torch.distributed itself")
    group = collective._get_group(collective.Group.TP)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (mapping.tp, mapping.rank):
        raise ConfigError(f"{where}, tp_rank={mapping.rank}: RTP's TP process group has {size} ranks and this "
                          f"process is its rank {rank}")
    register_group(mapping.group, group)


def load_rtp_rank(ckpt_path, mapping: Mapping, dtype: torch.dtype, device, act_quant: bool = False):
    """This rank's compiled hidden-state program (W8A8 FP8 GEMMs with ``act_quant``), filled with its slices, and
    its lm_head vocabulary shard: ``(program, pass_results, meta model, lm_head [V/tp, H])``."""
    from fxglm5.compiler import MAX_STEP_TOKENS, compile_model
    from fxglm5.runtime.shard_loader import load_rank, sharded_model

    model, reader, mapping = sharded_model(str(ckpt_path), mapping.tp, mapping.ep, dtype)
    cfg = model.config
    if cfg.vocab_size % mapping.tp:  # fxglm5's own runtime pads the shard; RTP gathers equal shards of V / tp
        raise InputError(f"vocab_size = {cfg.vocab_size} is not divisible by tp={mapping.tp}: RTP-LLM all-gathers the "
                         "logits as equal vocabulary shards")
    compiled = compile_model(model, max_tokens=max(cfg.max_position_embeddings, MAX_STEP_TOKENS), device=device,
                             head="hidden", mapping=mapping, act_quant=act_quant, inputs_validated=True)
    failure = lm_head = None
    try:
        load_rank(compiled.graph, mapping, reader, model, device)
        start, stop = mapping.part(cfg.vocab_size)
        like = torch.empty((stop - start, cfg.hidden_size), dtype=model.dtype, device="meta")
        with reader:
            lm_head = reader.param("lm_head.weight", like, torch.device(device), Slice(0, start, stop))
    except Exception as err:  # noqa: BLE001 - raised again below, on this rank and (named) on every other
        failure = err
    loaded_everywhere(failure, mapping)
    return compiled.program, compiled.results, model, lm_head


def loaded_everywhere(failure: Exception | None, mapping: Mapping) -> None:
    """Each rank reads other slices, so one may fail to load (a bad tensor of an expert only it owns) while the
    others would go on into the first forward's collective and wait for it forever: the ranks exchange their
    outcome (one all-gather), the failed rank raises its error and every other a CheckpointError naming it."""
    import torch.distributed as dist

    from fxglm5.errors import CheckpointError
    from fxglm5.parallel import resolve_group

    reports: list = [None] * mapping.tp
    report = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(reports, report, group=resolve_group(mapping.group))
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} could not load its slices ({failed[0][1]}); every rank stops")


def graph_weight(graph, name: str, what: str = "compiled graph") -> torch.Tensor:
    """The compiled graph's attribute ``name``, a weight published to RTP (the embedding, a norm, the MTP head)."""
    owner = graph
    for part in name.split("."):
        owner = getattr(owner, part, None)
    if not torch.is_tensor(owner):
        raise ConfigError(f"{what}: no attribute {name!r} to publish to RTP")
    return owner
