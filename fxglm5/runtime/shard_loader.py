"""One rank's model: its meta model and checkpoint reader (:func:`sharded_model`), and its sharded graph, captured on
the meta device, filled from the unchanged HF checkpoint directory (:func:`load_rank`, :func:`load_sharded`). Both
front doors that run ranks (the Runner at ``tp > 1``, the RTP plugin) load them so.

The shard stage leaves ``graph.meta["shard_plan"]`` (attribute target -> ``Slice(dim, start, stop)``: the rank's
attribute is the full parameter narrowed so, then by its ``inner`` part along another dim: the mixed expert layout's
experts, then rows) and rank-local meta tensors. For every attribute the graph reads,
:func:`load_sharded` reads its slice through safetensors ``get_slice`` (or the whole tensor where the plan has no
entry: replicated) with :meth:`CheckpointReader.param`, so a rank reads only its own bytes and never opens an
expert it does not own (experts are per-expert tensors in the checkpoint); values are checked as the whole-model
loader checks them (NaN / Inf / bounds, naming the file and tensor). Then every constant a pass derived from
weights (``graph.meta["derived_constants"]``: target -> (sources, fn), the absorbed MLA W_UK / W_UV) is derived
again from the rank's slices of its sources, which the graph itself does not read. Last, the compiler places the
filled graph on the rank's device (``fxglm5.compiler.place_loaded_graph``).

The MTP layer's graph (``compiler.compile_mtp``, ``mtp.*`` attributes) loads the same way: each attribute is read
under its checkpoint name (:func:`checkpoint_names`: ``mtp.layer.*`` is ``model.layers.{L}.*``, and the embedding
and head it shares with the model are the model's ``model.embed_tokens`` / ``lm_head``), and the tensors it shares
with a graph already loaded (the target's embedding and lm_head shard: :func:`shared_attributes`) are ``given``,
not read again.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from pathlib import Path

import torch
from torch import fx

from fxglm5.compiler import place_loaded_graph
from fxglm5.errors import CheckpointError, InputError
from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.parallel import Slice, pad_rows
from fxglm5.runtime.distributed import agree

PLAN, DERIVED = "shard_plan", "derived_constants"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    bytes_read: int
    tensors: dict[str, int]  # checkpoint tensor name -> bytes read from it

    def describe(self) -> str:
        return f"read {self.bytes_read / 2**20:.2f} MiB from {len(self.tensors)} checkpoint tensors"


def checkpoint_names(model: torch.nn.Module, config) -> dict[str, str]:
    """Every parameter name of ``model`` (aliases included: the MTP layer's ``mtp.embed_tokens`` / ``mtp.head`` are the
    model's embedding and lm_head) -> the checkpoint tensor it is read from."""
    from fxglm5.model.layout import checkpoint_name

    first: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        names[name] = checkpoint_name(canonical, config)
    return names


def shared_attributes(source: fx.GraphModule, graph: fx.GraphModule, pairs: dict[str, str]) -> dict[str, torch.Tensor]:
    """``graph``'s attributes that ``source`` (a loaded graph) already holds: for each ``graph target -> source
    target`` of ``pairs`` whose two tensors have one shape and dtype (the same part of one parameter), ``source``'s
    tensor, to be ``given`` to :func:`load_sharded`."""
    out = {}
    for target, held_as in pairs.items():
        mine, theirs = (_attribute(g, t) for g, t in ((graph, target), (source, held_as)))
        if mine is not None and theirs is not None and not theirs.is_meta and mine.shape == theirs.shape \
                and mine.dtype == theirs.dtype:
            out[target] = theirs
    return out


def _attribute(graph: fx.GraphModule, target: str):
    try:
        value = operator.attrgetter(target)(graph)
    except AttributeError:
        return None
    return value if torch.is_tensor(value) else None


def load_sharded(graph: fx.GraphModule, reader: CheckpointReader, model: torch.nn.Module, device,
                 given: dict[str, torch.Tensor] | None = None) -> LoadReport:
    """Fill ``graph``'s attributes on ``device`` from ``reader``'s checkpoint (``model``: the meta model the graph was
    captured from, giving the shape and dtype of the derivations' sources the graph does not hold, and the checkpoint
    name of each attribute); returns what was read. ``given``: attribute target -> a tensor already loaded (the
    rank's part, on ``device``: a weight shared with another graph), used as is instead of read. CheckpointError
    names a tensor the plan, the files or ``given`` cannot give."""
    plan, derived = graph.meta.get(PLAN, {}), graph.meta.get(DERIVED, {})
    targets = list(dict.fromkeys(n.target for n in graph.graph.find_nodes(op="get_attr")))
    held = {t: operator.attrgetter(t)(graph) for t in targets}
    params = dict(model.named_parameters(remove_duplicate=False))
    names = checkpoint_names(model, reader.config)
    device = torch.device(device)
    loaded: dict[str, torch.Tensor] = {}
    for target, value in (given or {}).items():
        like = held.get(target)
        if like is None:
            raise CheckpointError(f"given attribute {target!r}: the graph does not read it")
        if tuple(value.shape) != tuple(like.shape) or value.dtype != like.dtype or value.device != device:
            raise CheckpointError(f"given attribute {target!r}: {value.dtype} {list(value.shape)} on {value.device}, "
                                  f"the graph expects {like.dtype} {list(like.shape)} on {device}")
        loaded[target] = value

    def load(target: str, like: torch.Tensor) -> torch.Tensor:
        if target not in loaded:
            loaded[target] = _read(reader, target, like, device, plan.get(target), params, names)
        return loaded[target]

    start = dict(reader.bytes_read)
    with reader:
        for target in targets:
            if target in derived:
                continue
            if target not in params:
                raise CheckpointError(f"graph attribute {target!r}: not a model parameter, and no pass recorded how "
                                      "it is derived")
            _assign(graph, target, load(target, held[target]))
        for target, (sources, derive) in derived.items():
            if target not in held:
                continue
            with torch.no_grad():
                value = derive(*(load(s, _local_like(params, s, plan.get(s))) for s in sources))
            if tuple(value.shape) != tuple(held[target].shape):
                raise CheckpointError(f"derived constant {target!r}: derived from the rank's {list(sources)} it has "
                                      f"shape {list(value.shape)}, the sharded graph expects {list(held[target].shape)}")
            _assign(graph, target, value.to(held[target].dtype))
    left = [t for t in targets if operator.attrgetter(t)(graph).is_meta]
    if left:
        raise CheckpointError(f"graph attribute {left[0]!r}: no data for it after loading")
    place_loaded_graph(graph, device)
    tensors = {k: v - start.get(k, 0) for k, v in reader.bytes_read.items() if v != start.get(k, 0)}
    return LoadReport(sum(tensors.values()), tensors)


def _read(reader, target: str, like: torch.Tensor, device, part, params: dict, names: dict) -> torch.Tensor:
    """The rank's part of ``target`` (read as its checkpoint name); a part that runs past the parameter's end (a padded
    vocabulary shard) is read as far as the parameter goes and padded with zero rows."""
    name = names.get(target, target)
    size = params[target].shape[part.dim] if part is not None and part.padded and target in params else None
    if size is None or part.stop <= size:
        return reader.param(name, like, device, part)
    rows = part.real(size)
    if rows == 0:
        return torch.zeros(like.shape, dtype=like.dtype, device=device)
    clipped = Slice(part.dim, part.start, part.start + rows)
    head = reader.param(name, like.narrow(part.dim, 0, rows), device, clipped)
    return pad_rows(head, part.dim, like.shape[part.dim])


def _local_like(params: dict, name: str, part) -> torch.Tensor:
    """A meta tensor of the rank's part of model parameter ``name`` (a derivation's source)."""
    if name not in params:
        raise CheckpointError(f"derivation source {name!r}: not a model parameter")
    full = params[name]
    return full if part is None else part.apply(full)


def _assign(graph: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Replace the attribute ``target`` of ``graph`` (a parameter or buffer of a submodule) by ``value``."""
    path, _, name = target.rpartition(".")
    owner = graph.get_submodule(path) if path else graph
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def sharded_model(model, tp: int, ep: int | None, dtype, mtp: bool = False):
    """This rank's meta model, the reader it reads its slices from (the checked checkpoint of a directory, or
    ``model`` itself when it is a reader), and its Mapping (rank from the "tp" process group). Every layout rule
    is checked (Mapping.check) before any weight is read. ``mtp``: the model has its MTP layer (``model.mtp``, as the
    checkpoint stores it; a checkpoint without one is a CheckpointError naming its missing tensors), the MTP
    layer's config checked too."""
    import torch.distributed as dist

    from fxglm5.model.checkpoint import CheckpointReader, resolve_dtype
    from fxglm5.model.config import Glm5Config
    from fxglm5.model.modeling import Glm5ForCausalLM
    from fxglm5.parallel import Mapping, resolve_group

    if not isinstance(tp, int) or tp < 1:
        raise InputError(f"tp: must be a positive integer, got {tp!r}")
    is_reader = callable(getattr(model, "param", None)) and isinstance(getattr(model, "config", None), Glm5Config)
    if not isinstance(model, (str, Path)) and not is_reader:
        raise InputError(f"tp={tp}: a rank reads its own slices of a checkpoint directory; give its path, not a "
                         f"loaded {type(model).__name__}")
    if not dist.is_initialized():
        raise InputError(f"tp={tp}: no process group; start the ranks with fxglm5.runtime.distributed.launch "
                         "(fxglm5 generate --tp) or torchrun")
    group = resolve_group("tp")
    if dist.get_world_size(group) != tp:
        raise InputError(f"tp={tp}: the process group 'tp' has {dist.get_world_size(group)} ranks")
    reader = model if is_reader else CheckpointReader(model, mtp=mtp)
    mapping = Mapping(tp=tp, rank=dist.get_rank(group), ep=tp if ep is None else ep)
    mapping.check(reader.config)
    layout = getattr(reader, "mtp_layout", None) if mtp else None
    if layout is not None:
        from fxglm5.compiler import mtp_graph_config

        mapping.check(mtp_graph_config(reader.config))
    return Glm5ForCausalLM(reader.config, dtype=resolve_dtype(dtype), device="meta", mtp=layout or False), reader, \
        mapping


def load_rank(graph, mapping, reader, model, device, given: dict[str, torch.Tensor] | None = None):
    """Refuse to run unless every rank compiled the same program and plan (one all-gather of plan_hash), then
    fill this rank's graph from the checkpoint (``shard_loader``; ``given``: as :func:`load_sharded`'s); returns what
    it read. A graph given already filled (another Runner's) is not read again."""
    from fxglm5.parallel import plan_hash

    agree(plan_hash(graph, mapping), "the sharded graph and its plan (fxglm5.parallel.plan_hash)", mapping.group)
    if not any(t.is_meta for t in itertools.chain(graph.parameters(), graph.buffers())):
        return None
    return load_sharded(graph, reader, model, device, given)
