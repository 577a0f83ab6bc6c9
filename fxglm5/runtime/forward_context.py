"""The per-step forward context, shaped like RTP-LLM's ``PyAttentionInputs`` (see
/work/shared/reference/rtp_llm_contract.md), so the RTP plugin and the local runtime feed one graph alike.

A batch is all-prefill or all-decode. RTP passes no positions; they follow from the lengths:
- prefill: ``input_lengths[b]`` new tokens behind ``prefix_lengths[b]`` cached ones (prefix reuse); token
  ``j`` of request ``b`` is at position ``prefix_lengths[b] + j``; ``sequence_lengths`` is empty.
- decode: one token per request at position ``sequence_lengths[b]`` (tokens already cached);
  ``input_lengths[b]`` is the PROMPT length (as in RTP, not 1); ``prefix_lengths`` is empty.
Derived (``validate()`` fills them): ``cu_seqlens`` [B+1] over the tokens computed this step (in decode
that is RTP's ``decode_cu_seqlens``; RTP zeroes its own ``cu_seqlens`` there), and ``req_idx`` /
``positions`` / ``slot_mapping`` [T] (slot = kernel_block_id * kernel_block_size + pos % kernel_block_size,
the same flat slot as at physical granularity).

``validate()`` is the gate before any kernel runs: malformed fields (wrong rank or length, negative,
mismatched tables), block ids outside the cache, positions that need a padding block or lie past
``max_position_embeddings``, two tokens writing one cache slot raise :class:`fxglm5.errors.InputError` naming the field.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Optional

import torch
from torch import Tensor

from fxglm5 import contracts
from fxglm5.errors import InputError
from fxglm5.program import StepInputs
from fxglm5.runtime.cache import kernel_block_table

_INT = (torch.int32, torch.int64)


@dataclasses.dataclass
class ForwardContext:
    is_prefill: bool
    input_lengths: Tensor  # int32 [B]
    prefix_lengths: Tensor  # int32 [B] (prefill) / empty (decode)
    sequence_lengths: Tensor  # int32 [B] (decode) / empty (prefill)
    block_table: Tensor  # int32 [B, max_blocks], physical ids (RTP kv_cache_block_id)
    kernel_block_table: Tensor  # int32 [B, max_blocks * ratio] (RTP kv_cache_kernel_block_id)
    block_size: int
    kernel_block_size: int
    num_blocks: int  # physical blocks in the cache
    max_position_embeddings: int
    cu_seqlens: Optional[Tensor] = None
    req_idx: Optional[Tensor] = None
    positions: Optional[Tensor] = None
    slot_mapping: Optional[Tensor] = None

    @classmethod
    def build(cls, is_prefill: bool, lengths: list[int], starts: list[int], tables: list[list[int]], *,
              block_size: int, kernel_block_size: int, num_blocks: int, max_position_embeddings: int,
              prompt_lengths: list[int] | None = None, device="cpu") -> "ForwardContext":
        """Prefill: ``lengths`` new tokens after ``starts`` cached ones; decode: ``starts`` are the
        sequence lengths (``lengths`` ignored, one token each) and ``prompt_lengths`` the input lengths."""
        i32 = dict(dtype=torch.int32, device=device)
        width = max([len(t) for t in tables] + [1])
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32)
        empty = torch.zeros(0, **i32)
        inputs = lengths if is_prefill else (prompt_lengths or [1] * len(starts))
        return cls(is_prefill, torch.tensor(inputs, **i32), torch.tensor(starts, **i32) if is_prefill else empty,
                   empty if is_prefill else torch.tensor(starts, **i32), table,
                   kernel_block_table(table, block_size // kernel_block_size), block_size, kernel_block_size,
                   num_blocks, max_position_embeddings)

    @property
    def batch_size(self) -> int:
        return self.input_lengths.shape[0]

    def new_tokens(self) -> Tensor:
        """Tokens computed this step per request: input_lengths (prefill) or 1 (decode)."""
        return self.input_lengths if self.is_prefill else torch.ones_like(self.sequence_lengths)

    def step_inputs(self, logits_indices: Tensor | None = None) -> StepInputs:
        """The validated context as a program takes it, keeping the output rows ``logits_indices`` (default: each
        request's last token)."""
        if self.positions is None:
            raise InputError("forward context: validate() it before it is run")
        rows = self.cu_seqlens[1:].long() - 1 if logits_indices is None else logits_indices
        return StepInputs(self.positions, self.slot_mapping, self.kernel_block_table, self.req_idx, rows)

    def validate(self) -> "ForwardContext":
        # The checks run on Python lists of the per-request fields and of the block table (B and B x width
        # ints), the per-token tensors are made with a few torch ops: on host tensors the ~70 torch calls of a
        # tensor-at-a-time check cost 1.1 ms a decode step at B=64 (bench/rtpllm_host_time.py), each of them
        # dispatch overhead on a tiny tensor.
        lengths = self._check_vector("input_lengths", self.input_lengths, None)
        B = len(lengths)
        if B == 0:
            raise InputError("input_lengths: empty batch")
        if self.is_prefill:
            starts = self._check_vector("prefix_lengths", self.prefix_lengths, B)
            self._check_vector("sequence_lengths", self.sequence_lengths, 0)
            if min(lengths) < 1:
                raise InputError("input_lengths: a prefill request has no new tokens")
            n = lengths
        else:
            starts = self._check_vector("sequence_lengths", self.sequence_lengths, B)
            self._check_vector("prefix_lengths", self.prefix_lengths, 0)
            n = [1] * B
        rows = self._check_tables(B)
        device = self.input_lengths.device
        cu_list = list(itertools.accumulate(n, initial=0))
        cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
        self._check_given("cu_seqlens", self.cu_seqlens, cu)
        last = [s + k - 1 for s, k in zip(starts, n)]  # each request's last position (its positions are a run)
        if max(last) >= self.max_position_embeddings:
            raise InputError(f"positions: position {max(last)} is past max_position_embeddings "
                             f"({self.max_position_embeddings})")
        for row, p in zip(rows, last):  # every block up to the last position's must be a real one
            need = p // self.block_size
            if need >= len(row) or 0 in row[:need + 1]:
                raise InputError("block_table: a position needs a block the table does not give (0 = padding)")
        T = cu_list[-1]
        if self.is_prefill:
            # the request of every token (searchsorted: repeat_interleave took 0.14 ms a call on the GPU host)
            tokens = torch.arange(T, device=device)
            req = torch.searchsorted(cu[1:].long(), tokens, right=True)
            pos = torch.tensor(starts, device=device)[req] + tokens - cu.long()[:-1][req]
        else:
            req, pos = torch.arange(B, device=device), torch.tensor(starts, device=device)
        slots = contracts.slots(self.kernel_block_table, req, pos, self.kernel_block_size)
        self._check_distinct_slots(slots, req)
        self._check_given("req_idx", self.req_idx, req)
        self._check_given("positions", self.positions, pos)
        self._check_given("slot_mapping", self.slot_mapping, slots)
        self.cu_seqlens, self.req_idx, self.positions, self.slot_mapping = cu, req, pos, slots
        return self

    # ---- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _check_vector(name: str, t, length: int | None) -> list[int]:
        """The entries of a 1-D int tensor field as a list, checked: ``length`` entries (None: any), none negative."""
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in _INT:
            raise InputError(f"{name}: expected a 1-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if length is not None and t.shape[0] != length:
            raise InputError(f"{name}: expected {length} entries, got {t.shape[0]}")
        values = t.tolist()
        if values and min(values) < 0:
            raise InputError(f"{name}: negative entry {min(values)}")
        return values

    def _check_tables(self, B: int) -> list[list[int]]:
        """Check both block tables; returns the physical one's rows as lists."""
        if self.kernel_block_size < 1 or self.block_size % self.kernel_block_size:
            raise InputError(f"kernel_block_size: {self.kernel_block_size} must divide block_size {self.block_size}")
        ratio = self.block_size // self.kernel_block_size
        for name, t, hi in (("block_table", self.block_table, self.num_blocks),
                            ("kernel_block_table", self.kernel_block_table, self.num_blocks * ratio)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in _INT or t.shape[0] != B:
                raise InputError(f"{name}: expected an int32 [{B}, max_blocks] tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if t.numel():
                lo, top = (int(v) for v in torch.aminmax(t))
                if lo < 0 or top >= hi:
                    raise InputError(f"{name}: block id {lo if lo < 0 else top} out of range [0, {hi})")
        # at ratio 1 the kernel table is the physical one (kernel id = physical * 1 + 0)
        expected = self.block_table if ratio == 1 else kernel_block_table(self.block_table, ratio)
        if self.kernel_block_table.shape != expected.shape or not torch.equal(self.kernel_block_table.long(),
                                                                              expected.long()):
            raise InputError(f"kernel_block_table: does not match block_table at ratio {ratio} "
                             "(kernel id = physical * ratio + j)")
        return self.block_table.tolist()

    @staticmethod
    def _check_distinct_slots(slots: Tensor, req: Tensor) -> None:
        """Two tokens writing one cache slot (a block in two requests' tables, or twice in one) would leave
        whichever write lands last: refuse the step."""
        values = slots.tolist()
        if len(set(values)) == len(values):
            return
        slot = min(v for v, count in collections.Counter(values).items() if count > 1)
        who = sorted({r for r, v in zip(req.tolist(), values) if v == slot})
        raise InputError(f"slot_mapping: requests {who} write the same cache slot {slot} (a block is in two "
                         "requests' tables, or twice in one)")

    @staticmethod
    def _check_given(name: str, given, expected: Tensor) -> None:
        if given is None:
            return
        if not isinstance(given, Tensor) or given.shape != expected.shape or not torch.equal(given.long(),
                                                                                            expected.long()):
            raise InputError(f"{name}: inconsistent with the lengths and block tables")
