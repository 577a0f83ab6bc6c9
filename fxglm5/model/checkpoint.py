"""Loading and saving GLM-5 checkpoints in the HF safetensors layout (GLM-5-FP8, bf16, transformers').

Loading is two-phase so that a bad checkpoint fails fast and without touching memory: first every
header is read and every tensor's name, shape and dtype is checked against the table derived from
config.json (``fxglm5.model.layout``); only then does ``Glm5ForCausalLM.from_pretrained`` build the model
on the meta device, and :meth:`CheckpointReader.load_into` materialises each parameter once, directly on
``device``, from memory-mapped files (``safe_open``). This module is pure I/O: it never imports the model.
Routed experts are stored per expert in files and stacked per layer in the model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from fxglm5.contracts import FP8_MAX
from fxglm5.errors import CheckpointError, ConfigError
from fxglm5.model.config import Glm5Config
from fxglm5.model.layout import (
    MTP_MODULE, SCALE_SUFFIX, MtpLayout, TensorSpec, check_fp8_layout, check_mtp_config, checkpoint_name, expected_tensors,
    is_mtp_draft_tensor, is_mtp_tensor, is_packed_expert, mtp_layout, mtp_prefix, mtp_shared_tensors, mtp_tensors,
)
from fxglm5.model.st_files import PlannedTensor, TensorInfo, scan_checkpoint, write_shards

log = logging.getLogger("fxglm5.checkpoint")

_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_scale_inv)?$")
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight(_scale_inv)?$")
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(table)}")
    return table[dtype]


# Bounds on the values a checkpoint may hold, checked as each tensor is read. Trained weights are O(1) (norm
# gains, embeddings and projections alike); a weight beyond float16's largest finite value cannot be held by a
# float16 engine and, squared in the next RMSNorm, quickly overflows float32 and bf16 too: a 1e30 weight makes the
# logits NaN, and their argmax silently generates token 0 every step. FP8 block scales obey the same bound once
# applied to e4m3's largest value (448), and must be positive (a scale of 0 or below is no quantization).
MAX_WEIGHT = torch.finfo(torch.float16).max  # 65504
MAX_SCALE_INV = MAX_WEIGHT / FP8_MAX  # about 146.2
_CHECK_CHUNK = 1 << 24  # elements per reduction: bounds the temporaries of a check on a large stacked tensor


def check_values(t: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """Return ``t`` after checking its values on its own device (one min/max pass, one host sync): no NaN or
    Inf, magnitudes within MAX_WEIGHT, FP8 block scales (``*_scale_inv``) in (0, MAX_SCALE_INV]; else
    CheckpointError naming ``file`` and the tensor."""
    if not t.numel():
        return t
    chunks = t.reshape(-1).split(_CHECK_CHUNK)
    if t.dtype == torch.float8_e4m3fn:  # e4m3fn has no Inf; its NaNs are the codes S.1111.111
        if torch.stack([((c.view(torch.uint8) & 0x7F) == 0x7F).any() for c in chunks]).any():
            raise CheckpointError(f"{file}: tensor {name!r} holds NaN (an e4m3 NaN code)")
        return t
    lows, highs = zip(*(torch.aminmax(c) for c in chunks))
    lo, hi = torch.stack(lows).min().item(), torch.stack(highs).max().item()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CheckpointError(f"{file}: tensor {name!r} holds {'NaN' if math.isnan(lo) else 'Inf'} values")
    if name.endswith(SCALE_SUFFIX) and not 0 < lo <= hi <= MAX_SCALE_INV:
        value = lo if lo <= 0 else hi
        raise CheckpointError(
            f"{file}: scale tensor {name!r} holds {value:.3g}; block scales must lie in (0, {MAX_SCALE_INV:.4g}] "
            f"(448, e4m3's largest value, times the scale must stay within float16's {MAX_WEIGHT:g})")
    if max(-lo, hi) > MAX_WEIGHT:
        raise CheckpointError(
            f"{file}: tensor {name!r} holds {lo if -lo > hi else hi:.3g}, beyond float16's largest value {MAX_WEIGHT:g}: "
            "no trained weight is that large, and the model's activations would overflow to NaN")
    return t


def check_tensors(tensors: Mapping[str, TensorInfo], expected: Mapping[str, TensorSpec], cfg: Glm5Config, where: Path,
                  skip_mtp: bool = True) -> list[str]:
    """Check every tensor against the table; returns the MTP tensor names the table lacks (present but not
    used: ``skip_mtp``; else such a tensor is unexpected, as the table then holds the MTP layer's)."""
    mtp = []
    for name, info in tensors.items():
        spec = expected.get(name)
        if spec is None:
            if skip_mtp and is_mtp_tensor(name, cfg):
                mtp.append(name)
                continue
            hint = " (config.json has no quantization_config, but this is an FP8 scale)" if (
                name.endswith(SCALE_SUFFIX) and not cfg.is_fp8) else ""
            raise CheckpointError(f"{info.file}: unexpected tensor {name!r}: not part of GLM-5 with this config.json{hint}")
        if info.dtype not in spec.dtypes:
            allowed = sorted(_DTYPE_NAMES.get(d, str(d)) for d in spec.dtypes)
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype_name}, expected one of {allowed}")
        if info.shape != spec.shape:
            what = "scale tensor" if spec.kind == "scale" else "tensor"
            note = " (one float32 per 128x128 block of its weight)" if spec.kind == "scale" else ""
            raise CheckpointError(
                f"{info.file}: {what} {name!r} has shape {list(info.shape)}, expected {list(spec.shape)}{note}"
            )
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} (shape {list(expected[missing[0]].shape)}){more}")
    return mtp


class CheckpointReader:
    """A checked checkpoint directory: config, tensor table and lazy access to tensor data.

    Construction reads only config.json and the safetensors headers and raises on any mismatch. Use as a
    context manager around data access; files are opened (memory-mapped) on first use.
    """

    def __init__(self, path: str | Path, mtp: bool | None = False, mtp_only: bool = False):
        """``mtp``: the MTP layer is part of the table (``mtp_layout`` says how the files store it); None: when the
        files hold MTP tensors; False: its tensors are skipped unread, with one notice. ``mtp_only``: the table is
        the MTP layer and the model tensors it shares (``mtp_shared_tensors``), for a draft model beside a target
        that holds the rest: no other tensor is checked or read, and a shard holding none of them is not opened."""
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory not found")
        config_path = self.dir / "config.json"
        self.config = Glm5Config.from_json(config_path)
        check_fp8_layout(self.config, str(config_path))
        wanted = (lambda name: is_mtp_draft_tensor(name, self.config)) if mtp_only else None
        self.tensors, self.where = scan_checkpoint(self.dir, wanted)
        self.packed = any(is_packed_expert(n) for n in self.tensors)
        self.expected = {} if mtp_only else expected_tensors(self.config, packed=self.packed)
        if mtp is None:
            mtp = any(is_mtp_tensor(name, self.config) for name in self.tensors)
        self.mtp_layout: MtpLayout | None = self._expect_mtp("the MTP draft model" if mtp_only else "mtp=True") if (
            mtp or mtp_only) else None
        if mtp_only:  # the lm_head is not read where the MTP layer has a head of its own
            self.expected.update(mtp_shared_tensors(self.config, self.mtp_layout))
            self.tensors = {n: i for n, i in self.tensors.items() if n in self.expected or is_mtp_tensor(n, self.config)}
        mtp = check_tensors(self.tensors, self.expected, self.config, self.where, skip_mtp=self.mtp_layout is None)
        if mtp:
            layers = sorted({int(n.split(".")[2]) for n in mtp})
            log.info("%s: skipping %d tensors of the MTP layer %s (multi-token prediction is not used: load with "
                     "mtp=True to use it)", self.where, len(mtp), layers)
        self._stack: contextlib.ExitStack | None = None
        self._files: dict[Path, Any] = {}
        self.bytes_read: dict[str, int] = {}

    def __enter__(self) -> "CheckpointReader":
        self._stack = contextlib.ExitStack()
        return self

    def __exit__(self, *exc) -> None:
        self._files.clear()
        if self._stack is not None:
            self._stack.close()
        self._stack = None

    def _expect_mtp(self, asked: str) -> MtpLayout:
        """Add the MTP layer's tensors to the table; CheckpointError naming what is missing (and the option
        ``asked`` that needs them)."""
        check_mtp_config(self.config)
        layout = mtp_layout(self.tensors, self.config)
        table = mtp_tensors(self.config, layout, packed=self.packed)
        missing = [n for n in table if n not in self.tensors]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise CheckpointError(f"{self.where}: no complete MTP layer ({mtp_prefix(self.config)}*) for {asked}: "
                                  f"missing {len(missing)} of its {len(table)} tensors: {shown}")
        self.expected.update(table)
        return layout

    def _file(self, name: str):
        info = self._info(name)
        if info.file not in self._files:
            if self._stack is None:
                raise RuntimeError("CheckpointReader data access outside its 'with' block")
            self._files[info.file] = self._stack.enter_context(safe_open(str(info.file), framework="pt", device="cpu"))
        return self._files[info.file]

    def get(self, name: str, device: torch.device | None = None, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``name`` as stored (or only its part ``index``, one slice per leading dim, read through
        ``get_slice``), on ``device`` (default: the CPU), its values checked there. ``bytes_read`` counts the bytes
        read per tensor name."""
        file = self._file(name)
        t = file.get_tensor(name) if index is None else file.get_slice(name)[index]
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        where = name if index is None else name + "[" + ", ".join(f"{s.start or ''}:{s.stop or ''}" for s in index) + "]"
        return check_values(t if device is None else t.to(device), where, self.tensors[name].file)

    def get_expert(self, name: str) -> torch.Tensor:
        """A per-expert (GLM-5-FP8) tensor by name, sliced out of the packed tensor if the file is packed."""
        if name in self.tensors or not self.packed:
            return self.get(name)
        m = _EXPERT_RE.match(name)
        if m is None:
            return self.get(name)
        prefix, e, proj, scale = m.groups()
        packed = prefix + ("down_proj" if proj == "down" else "gate_up_proj") + (scale or "")
        full = check_values(self._file(packed).get_slice(packed)[int(e)], f"{packed}[{e}]", self.tensors[packed].file)
        if proj == "down":
            return full
        half = full.shape[0] // 2
        return full[:half] if proj == "gate" else full[half:]

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the model parameter ``name`` (stacked experts: [E, rows of the pieces, columns])."""
        m = _STACKED_RE.match(name)
        if m is None or self.packed:
            return self._info(name).shape
        pieces = [self._info(n).shape for n in self._expert_pieces(m, 0)]
        return (self.config.n_routed_experts, sum(p[0] for p in pieces), *pieces[0][1:])

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.where}: missing tensor {name!r}")
        return self.tensors[name]

    @staticmethod
    def _expert_pieces(m: re.Match, e: int) -> list[str]:
        """Expert ``e``'s checkpoint tensors that the stacked parameter ``m`` concatenates along its rows."""
        prefix, kind, scale = m.groups()
        suffix = ".weight" + (scale or "")
        return [f"{prefix}{e}.{p}{suffix}" for p in (("down_proj",) if kind == "down_proj" else ("gate_proj", "up_proj"))]

    def _part_shape(self, name: str, full: tuple[int, ...], part) -> list[int]:
        """The shape of ``part`` (each of its levels on a dim of its own, one at most in ``halves``) of the parameter
        ``name`` of shape ``full``; CheckpointError if it has no such part."""
        levels, shape = part.levels(), list(full)
        if len({p.dim for p in levels}) == len(levels) and sum(p.halves for p in levels) <= 1:
            for p in levels:
                if not 0 <= p.dim < len(full):
                    break
                size = full[p.dim] // 2 if p.halves else full[p.dim]
                if not 0 <= p.start < p.stop <= size or (p.halves and full[p.dim] % 2):
                    break
                shape[p.dim] = (p.stop - p.start) * (2 if p.halves else 1)
            else:
                return shape
        raise CheckpointError(f"{self.where}: tensor {name!r} of shape {list(full)} has no part {part}")

    def param(self, name: str, like: torch.Tensor, device: torch.device, part=None) -> torch.Tensor:
        """The model parameter ``name`` (shape/dtype of ``like``) built on ``device`` from the files. ``part`` (a
        ``fxglm5.parallel.Slice``): only the part ``part.apply(parameter)`` is read (narrowed along each level's
        ``dim``, or each half of it narrowed alike when ``halves``: the stacked gate | up weight);
        of stacked experts only the experts in the part are opened (the others' tensors are never read)."""
        full = self.full_shape(name)
        shape = list(full) if part is None else self._part_shape(name, full, part)
        if tuple(shape) != tuple(like.shape):
            raise CheckpointError(f"{self.where}: tensor {name!r}{'' if part is None else f' part {part}'} has shape "
                                  f"{shape}, the model expects {list(like.shape)}")
        levels = () if part is None else part.levels()
        m = _STACKED_RE.match(name)
        if m is None or self.packed:
            if part is None:
                return self.get(name, device).to(dtype=like.dtype)
            return self._get_part(name, device, full, levels).to(dtype=like.dtype)
        by_expert = next((p for p in levels if p.dim == 0), None)
        rows = next((p for p in levels if p.dim != 0), None)
        experts = range(full[0]) if by_expert is None else range(by_expert.start, by_expert.stop)
        out = torch.empty(like.shape, dtype=like.dtype, device=device)
        for i, e in enumerate(experts):
            at = row = 0
            for piece in self._expert_pieces(m, e):
                count = self._info(piece).shape[0]
                index = _piece_index(rows, row, count)
                row += count
                if index is not None:
                    t = self.get(piece, device, index or None)
                    out[i, at:at + t.shape[0]].copy_(t)
                    at += t.shape[0]
        return out

    def _get_part(self, name: str, device, full, levels) -> torch.Tensor:
        """``levels`` of the stored tensor ``name`` (of shape ``full``) read through ``get_slice``: one read, or one
        per half (concatenated along its dim) when a level is ``halves``. Contiguous: safetensors hands a part narrowed
        on two dims out as a strided view."""
        index = [slice(None)] * (max(p.dim for p in levels) + 1)
        halves = next((p for p in levels if p.halves), None)
        for p in levels:
            index[p.dim] = slice(p.start, p.stop)
        if halves is None:
            return self.get(name, device, tuple(index)).contiguous()
        pieces = []
        for offset in (0, full[halves.dim] // 2):
            index[halves.dim] = slice(offset + halves.start, offset + halves.stop)
            pieces.append(self.get(name, device, tuple(index)))
        return torch.cat(pieces, halves.dim)

    def load_into(self, model: torch.nn.Module, device: torch.device, progress: bool = True) -> torch.nn.Module:
        """Fill every parameter of ``model`` (built on the meta device for this config, in the model's naming)
        from the files, on ``device``; CheckpointError naming the first parameter the files do not give. Pure
        I/O: the caller (``Glm5ForCausalLM.from_pretrained``) builds the model, this module never imports it."""
        params = list(model.named_parameters())
        with self, tqdm(total=len(params), desc=f"loading {self.dir.name}", unit="tensor", disable=not progress,
                        leave=False) as bar:
            for name, meta in params:
                owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
                data = self.param(checkpoint_name(name, self.config), meta, device)
                owner._parameters[leaf] = torch.nn.Parameter(data, requires_grad=False)
                bar.update()
        leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if leftover:
            raise CheckpointError(f"{self.where}: no data for {leftover[0]!r}")
        return model.eval()


def _piece_index(part, row: int, rows: int) -> tuple[slice, ...] | None:
    """What of an expert's piece (rows [row, row + rows) of the stacked parameter's dim 1) ``part`` (the narrowing of
    dim 1 or 2, None: neither) reads: () the whole piece, None none of it, else the slices. A ``halves`` part narrows
    each of the two pieces (gate, up)."""
    if part is None:
        return ()
    if part.dim == 2:
        return (slice(None), slice(part.start, part.stop))
    if part.halves:  # gate | up: each piece is one half, narrowed alike
        return (slice(part.start, part.stop),)
    lo, hi = max(part.start - row, 0), min(part.stop - row, rows)
    return (slice(lo, hi),) if lo < hi else None


def _state_tensor(state: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Tensor, str]:
    """The checkpoint tensor ``name`` from a model state dict (stacked experts) and the key it came from."""
    if name in state:
        return state[name], name
    m = _EXPERT_RE.match(name)
    if m is None:
        raise CheckpointError(f"state dict: missing tensor {name!r}")
    prefix, e, proj, scale = m.groups()
    key = prefix + ("down_proj" if proj == "down" else "gate_up_proj") + (scale or "")
    if key not in state:
        raise CheckpointError(f"state dict: missing tensor {name!r} (or stacked {key!r})")
    full = state[key][int(e)]
    if proj == "down":
        return full, key
    half = full.shape[0] // 2
    return (full[:half] if proj == "gate" else full[half:]), key


def _checkpoint_state(state: Mapping[str, torch.Tensor], cfg: Glm5Config, layout: MtpLayout) -> dict:
    """``state`` with the MTP module's tensors under their checkpoint names (stacked experts kept stacked), less
    the ones it shares with the model (embed_tokens; the head unless ``layout.own_head``)."""
    shared = (MTP_MODULE + "embed_tokens.",) + (() if layout.own_head else (MTP_MODULE + "head.",))
    return {checkpoint_name(k, cfg): v for k, v in state.items() if not k.startswith(shared)}


def save_checkpoint(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor], path: str | Path,
                    max_shard_bytes: int | None = None, config: Glm5Config | None = None) -> list[str]:
    """Write config.json and the weights in the GLM-5-FP8 layout (per-expert tensors, ``weight_scale_inv``).

    ``model_or_state``: a Glm5ForCausalLM, or a state dict in its naming (stacked experts) or in checkpoint
    naming, with ``config``. An MTP module (``model.mtp``, state ``mtp.*``) is written as its checkpoint layer
    ``model.layers.{L}.*`` (``layout.checkpoint_name``). One model.safetensors unless ``max_shard_bytes`` asks for
    shards + index. Returns the safetensors file names written.
    """
    if isinstance(model_or_state, torch.nn.Module):
        cfg, state = model_or_state.config, model_or_state.state_dict()
        mtp = getattr(model_or_state, "mtp", None)
        layout = None if mtp is None else mtp.layout
    else:
        if config is None:
            raise ConfigError("save_checkpoint: a state dict needs its Glm5Config (config=...)")
        cfg, state = config, dict(model_or_state)
        layout = MtpLayout(eh_proj_fp8=MTP_MODULE + "eh_proj.weight" + SCALE_SUFFIX in state,
                           own_head=MTP_MODULE + "head.weight" in state) if any(
            k.startswith(MTP_MODULE) for k in state) else None
    check_fp8_layout(cfg, "config")
    table = expected_tensors(cfg)
    if layout is not None:
        state = _checkpoint_state(state, cfg, layout)
        table.update(mtp_tensors(cfg, layout))
    planned, used = [], set()
    for name, spec in table.items():
        tensor, key = _state_tensor(state, name)
        used.add(key)
        if tuple(tensor.shape) != spec.shape or tensor.dtype not in spec.dtypes:
            raise CheckpointError(
                f"state dict: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, expected {list(spec.shape)}"
            )
        planned.append(PlannedTensor(name, tensor.numel() * tensor.element_size(), lambda t=tensor: t.detach().cpu()))
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"state dict: unexpected tensor {extra[0]!r}: not part of GLM-5 with this config")
    path = Path(path)
    files = write_shards(path, planned, max_shard_bytes)
    cfg.save(path)
    return files
