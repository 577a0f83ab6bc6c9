"""Test stand-in of RTP-LLM's decode CUDA-graph runner (``cpp/cuda_graph/cuda_graph_runner.cc`` and
``cuda_graph_decode.cc`` at 4b8d39cd5; not RTP-LLM code).

Capture (``initCapture`` / ``captureDecode``):
1. static inputs once at ``max_bs`` (``initCaptureAttentionInputs``): ``input_lengths`` 1, ``sequence_lengths``
   ``max_seq_len - 2`` (``_plus_1_device`` one more), an empty ``prefix_lengths``, zero kernel block tables
   (host and device) ``ceil(max_seq_len / block) * ratio`` wide, ``cu_seqlens`` over the lengths, ``decode_cu_seqlens``
   ``0..max_bs``; ``kv_cache_block_id`` / ``_device`` are never created (None);
2. ``prepare_fmha_impl(static, True)`` and one eager forward under ``RTP_LLM_CUDA_GRAPH_WARMUP_FORWARD=1``;
3. per capture size, largest first: the static inputs are SLICES of the max_bs buffers (shared storage),
   ``prepare_fmha_impl(slice, True)``, two eager forwards, capture, one replay.
Replay (``prepareInputData`` / ``prepareAttentionInputs``), into the smallest captured size >= the batch:
the live ``input_ids`` copied in; the DEVICE kernel table zeroed, then the live rows copied; the HOST kernel
table gets the live rows only (rows and columns past them keep what an earlier, larger step left there);
host ``sequence_lengths`` past the batch are zeroed, host ``input_lengths`` past it stay stale; the device
lengths get the live entries only; then ``prepare_cuda_graph(static attention inputs)`` and the replay.

Target verify (speculative decoding; ``num_tokens_per_bs`` = k+1 > 1 with ``is_target_verify``, as
``PyWrappedModel.h:305-341`` builds the target's runner): the static inputs are a prefill (``is_prefill`` and
``is_target_verify`` set, ``cuda_graph_runner.cc:896-897``) of ``num_tokens_per_bs`` tokens per request
(``input_lengths``, line 902) behind ``prefix_lengths`` ``max_seq_len - num_tokens_per_bs`` (lines 935-937),
``sequence_lengths`` ``max_seq_len - num_tokens_per_bs - 1`` (line 908) and ``batch * num_tokens_per_bs`` token
rows; a replay needs exactly ``batch * num_tokens_per_bs`` tokens (``canRun``, lines 834-847: a failed check,
not a fallback), copies the live ``input_lengths`` / ``prefix_lengths`` / ``cu_seqlens`` (lines 505-511), zeroes
the padding rows' ``input_lengths`` and ``prefix_lengths`` (host and device, lines 588-600) and every host
``sequence_lengths`` entry (the live inputs carry none, lines 519-527), and returns ``hidden[:batch * q]``.

Every graph also has a static ``input_hiddens`` buffer, ``[max_bs * num_tokens_per_bs, hidden_size]`` in the
model's dtype (``cuda_graph_runner.cc:1075-1082``; the width is ``hidden_size * hc_mult``, ``PyWrappedModel.h:282``,
hc_mult 1 here), sliced per size as the other inputs (line 1222); a replay copies the live rows into its head
after RTP's checks (rank 2, the row width, no more rows than captured, the dtype: ``prepareInputData``, lines
193-229). An MTP draft model's decode graph (``draft_model_``, one token per request) reads it.

MTP draft prefill (:class:`DraftPrefillGraphRunner`, RTP's ``sp_prefill_draft_model_``: ``is_prefill_cuda_graph_mode``
with ``num_tokens_per_bs`` = k+1, ``PyWrappedModel.h:323-332``; ``cuda_graph_prefill.cc``): graphs keyed by the
total token count ``i * (k+1)``, ``i = 1..max_bs``, each over all ``max_bs`` request rows, captured largest first;
a replay rounds the packed token count up to the next key and rebuilds the lengths around the live requests
(``cuda_graph_runner.cc:193-229, 232-630, 676-737``). Its ``max_bs`` is the concurrency limit, as every graph
runner's (``cuda_graph_runner.h:51``).

A CUDA graph cannot be captured on a CPU: there step 3's capture call and every replay run
``forward(static, impl)`` eagerly on the prepared static buffers, which keeps everything around the replay
(the Python calls, their order, the buffers and their refresh).
"""

import contextlib
import os

import torch

from rtp_llm.ops.compute_ops import PyAttentionInputs, PyModelInputs

_I32 = torch.int32


@contextlib.contextmanager
def _env_flag(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


class _Instance:
    def __init__(self, inputs, impl, hidden):
        self.inputs, self.impl, self.hidden, self.graph = inputs, impl, hidden, None


class CudaGraphRunner:
    """Counters for tests: ``captured_sizes`` (capture order), ``replays_by_size``, ``warmup_forward_env``
    (the flag's value seen by each forward during capture)."""

    def __init__(self, py_model, *, max_bs, capture_sizes, max_seq_len, block_size, kernel_block_size, hidden_size,
                 dtype, device, num_tokens_per_bs=1, is_target_verify=False):
        self.py_model, self.max_bs, self.device, self.dtype = py_model, max_bs, torch.device(device), dtype
        if is_target_verify != (num_tokens_per_bs > 1):
            raise ValueError("the stand-in runs decode graphs (1 token per request) and target-verify graphs (> 1)")
        self.q, self.verify = num_tokens_per_bs, is_target_verify
        self.sizes = sorted(set(capture_sizes))
        if not self.sizes or self.sizes[-1] > max_bs:
            raise ValueError(f"capture sizes {self.sizes} must be within max_bs {max_bs}")
        self.max_seq_len, self.hidden_size = max_seq_len, hidden_size
        self.max_blocks = -(-max_seq_len // block_size) * (block_size // kernel_block_size)
        self.instances, self.captured_sizes, self.replays_by_size = {}, [], {}
        self.cuda = self.device.type == "cuda"

    def _host(self, t):
        return t.pin_memory() if self.cuda else t

    def _static_inputs(self):
        n, dev, q = self.max_bs, self.device, self.q
        a = PyAttentionInputs()
        a.is_prefill, a.is_cuda_graph, a.is_s_padded, a.dtype = self.verify, True, True, self.dtype
        a.is_target_verify = self.verify
        a.input_lengths = self._host(torch.full((n,), q, dtype=_I32))
        a.input_lengths_device = a.input_lengths.to(dev)
        a.sequence_lengths = self._host(torch.full((n,), self.max_seq_len - q - 1, dtype=_I32))
        a.sequence_lengths_plus_1_device = (a.sequence_lengths + 1).to(dev)
        if self.verify:
            a.prefix_lengths = self._host(torch.full((n,), self.max_seq_len - q, dtype=_I32))
            a.prefix_lengths_device = a.prefix_lengths.to(dev)
        else:
            a.prefix_lengths = self._host(torch.zeros(0, dtype=_I32))
        a.kv_cache_kernel_block_id_device = torch.zeros((n, self.max_blocks), dtype=_I32, device=dev)
        a.kv_cache_kernel_block_id = self._host(torch.zeros((n, self.max_blocks), dtype=_I32))
        a.padding_offset = self._host(torch.zeros(self.max_seq_len * n, dtype=_I32))
        a.decode_cu_seqlens = self._host(torch.arange(n + 1, dtype=_I32))
        a.decode_cu_seqlens_device = a.decode_cu_seqlens.to(dev)
        cu = torch.zeros(n + 1, dtype=_I32)
        cu[1:] = torch.cumsum(a.input_lengths, 0)
        a.cu_seqlens, a.cu_seqlens_device = self._host(cu), cu.to(dev)
        a.cu_kv_seqlens_device = torch.zeros(n + 1, dtype=_I32, device=dev)
        hiddens = torch.zeros((n * q, self.hidden_size), dtype=self.dtype, device=dev)
        return PyModelInputs(input_ids=torch.zeros(n * q, dtype=_I32, device=dev), input_hiddens=hiddens,
                             attention_inputs=a)

    def _slice(self, full, bs):
        f, a = full.attention_inputs, PyAttentionInputs()
        a.is_prefill, a.is_cuda_graph, a.is_s_padded, a.dtype = f.is_prefill, True, True, f.dtype
        a.is_target_verify = f.is_target_verify
        for name in ("input_lengths", "input_lengths_device", "sequence_lengths", "sequence_lengths_plus_1_device",
                     "kv_cache_kernel_block_id", "kv_cache_kernel_block_id_device", "padding_offset"):
            setattr(a, name, getattr(f, name)[:bs])
        for name in ("cu_seqlens", "cu_seqlens_device", "cu_kv_seqlens_device", "decode_cu_seqlens",
                     "decode_cu_seqlens_device"):
            setattr(a, name, getattr(f, name)[:bs + 1])
        if self.verify:  # cuda_graph_runner.cc:1231-1236: the first bs rows
            a.prefix_lengths, a.prefix_lengths_device = f.prefix_lengths[:bs], f.prefix_lengths_device[:bs]
        else:
            a.prefix_lengths = f.prefix_lengths
        return PyModelInputs(input_ids=full.input_ids[:bs * self.q], input_hiddens=full.input_hiddens[:bs * self.q],
                             attention_inputs=a)

    @staticmethod
    def _copy_hiddens(inst, live):
        """``prepareInputData``: the live ``input_hiddens`` rows into the static buffer's head (checked first)."""
        src, dst = live.input_hiddens, inst.inputs.input_hiddens
        if src is None or src.numel() == 0:
            return
        if not src.is_contiguous() or src.dim() != 2:
            raise RuntimeError(f"input_hiddens must be a contiguous rank-2 tensor, got {tuple(src.shape)}")
        if src.shape[1] != dst.shape[1] or src.shape[0] > dst.shape[0] or src.dtype != dst.dtype:
            raise RuntimeError(f"input_hiddens {src.dtype} {tuple(src.shape)} does not fit the graph's "
                               f"{dst.dtype} {tuple(dst.shape)}")
        dst[:src.shape[0]].copy_(src)

    def _forward(self, inst):
        return self.py_model.forward(inst.inputs, inst.impl).hidden_states

    def capture(self):
        full = self._static_inputs()
        impl = self.py_model.prepare_fmha_impl(full, True)
        with _env_flag("RTP_LLM_CUDA_GRAPH_WARMUP_FORWARD", "1"):
            self.py_model.forward(full, impl)
        hidden = torch.zeros((self.max_bs * self.q, self.hidden_size), dtype=self.dtype, device=self.device)
        pool = torch.cuda.graph_pool_handle() if self.cuda else None
        for key in reversed(self.sizes):
            inputs = self._capture_inputs(full, key)
            inst = _Instance(inputs, self.py_model.prepare_fmha_impl(inputs, True), hidden[:self._rows(key)])
            self._forward(inst)
            self._forward(inst)
            if self.cuda:
                torch.cuda.synchronize()
                inst.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(inst.graph, pool=pool):
                    inst.hidden.copy_(self._forward(inst))
            else:  # the capture's forward call, run eagerly
                inst.hidden.copy_(self._forward(inst))
            self.instances[key] = inst
            self._replay(inst)  # replayAndSyncCheck
            self.captured_sizes.append(key)

    def _capture_inputs(self, full, key):
        """The inputs of the graph of ``key`` (a batch size in decode mode), views of the max-size ones."""
        return self._slice(full, key)

    def _rows(self, key) -> int:
        """The token rows of the graph of ``key``."""
        return key * self.q

    def _replay(self, inst):
        if inst.graph is not None:
            inst.graph.replay()
            torch.cuda.synchronize()
        else:
            inst.hidden.copy_(self._forward(inst))

    def can_run(self, bs):
        return bs <= self.sizes[-1]

    def forward(self, live):
        """Replay for a live decode (or verify) batch; returns ``hidden[:bs * q]`` (a copy, as PyWrappedModel
        clones it)."""
        la = live.attention_inputs
        if self.verify:
            return self._forward_verify(live)
        bs = la.sequence_lengths.shape[0]
        key = next(s for s in self.sizes if s >= bs)
        inst = self.instances[key]
        s = inst.inputs.attention_inputs
        inst.inputs.input_ids[:live.input_ids.shape[0]].copy_(live.input_ids)
        self._copy_hiddens(inst, live)
        s.kv_cache_kernel_block_id_device.zero_()
        src = la.kv_cache_kernel_block_id_device
        s.kv_cache_kernel_block_id_device[:src.shape[0], :src.shape[1]].copy_(src)
        for name, n in (("cu_seqlens_device", bs + 1), ("cu_kv_seqlens_device", bs + 1),
                        ("input_lengths_device", bs), ("sequence_lengths_plus_1_device", bs),
                        ("decode_cu_seqlens_device", bs + 1), ("cu_seqlens", bs + 1), ("input_lengths", bs),
                        ("sequence_lengths", bs)):
            getattr(s, name)[:n].copy_(getattr(la, name)[:n])
        src = la.kv_cache_kernel_block_id
        s.kv_cache_kernel_block_id[:src.shape[0], :src.shape[1]].copy_(src)  # host mirror: not zeroed
        s.sequence_lengths[bs:].zero_()
        prepare = getattr(inst.impl, "prepare_cuda_graph", None)  # called only where the impl has it
        if prepare is not None:
            prepare(s)
        self._replay(inst)
        self.replays_by_size[key] = self.replays_by_size.get(key, 0) + 1
        return inst.hidden[:bs].clone()

    def _forward_verify(self, live):
        la = live.attention_inputs
        if not (la.is_target_verify and la.is_prefill):  # canRun: not this graph's step
            raise ValueError("a target-verify graph replays target-verify prefills only")
        bs, q = la.input_lengths.shape[0], self.q
        if live.input_ids.shape[0] != bs * q:
            raise RuntimeError(f"target-verify decode graph expects {bs * q} tokens ({bs} batches * {q}), got "
                               f"{live.input_ids.shape[0]}")
        key = next(s for s in self.sizes if s >= bs)
        inst = self.instances[key]
        s = inst.inputs.attention_inputs
        inst.inputs.input_ids[:bs * q].copy_(live.input_ids)
        self._copy_hiddens(inst, live)
        s.kv_cache_kernel_block_id_device.zero_()
        src = la.kv_cache_kernel_block_id_device
        s.kv_cache_kernel_block_id_device[:src.shape[0], :src.shape[1]].copy_(src)
        src = la.kv_cache_kernel_block_id
        s.kv_cache_kernel_block_id[:src.shape[0], :src.shape[1]].copy_(src)  # host mirror: not zeroed
        for name, n in (("cu_seqlens", bs + 1), ("cu_seqlens_device", bs + 1), ("cu_kv_seqlens_device", bs + 1),
                        ("input_lengths", bs), ("input_lengths_device", bs), ("prefix_lengths", bs),
                        ("prefix_lengths_device", bs)):
            getattr(s, name)[:n].copy_(getattr(la, name)[:n])
        for name in ("input_lengths", "input_lengths_device", "prefix_lengths", "prefix_lengths_device"):
            getattr(s, name)[bs:].zero_()
        s.sequence_lengths.zero_()
        prepare = getattr(inst.impl, "prepare_cuda_graph", None)
        if prepare is not None:
            prepare(s)
        self._replay(inst)
        self.replays_by_size[key] = self.replays_by_size.get(key, 0) + 1
        return inst.hidden[:bs * q].clone()


class DraftPrefillGraphRunner(CudaGraphRunner):
    """RTP's MTP draft-prefill graph runner (``sp_prefill_draft_model_``, ``MtpExecutor.cc:734-744``), which replays
    the draft extend after each verify step: ``num_tokens_per_bs`` = k+1, keys ``i * (k+1)`` for ``i = 1..max_bs``
    (``getPrefillSequenceLengthsToCapture``, ``cuda_graph_prefill.cc:100-114``). Counters for tests:
    ``captured_sizes`` (the keys, capture order), ``replays_by_size`` (per key), ``replayed_batches`` (the live
    batch size of each replay, RTP's ``cuda_graph_prefill_batch_size``)."""

    def __init__(self, py_model, *, max_bs, max_seq_len, block_size, kernel_block_size, hidden_size, dtype, device,
                 num_tokens_per_bs):
        if num_tokens_per_bs < 2:
            raise ValueError("a draft-prefill graph runs k+1 >= 2 tokens per request")
        super().__init__(py_model, max_bs=max_bs, capture_sizes=range(1, max_bs + 1), max_seq_len=max_seq_len,
                         block_size=block_size, kernel_block_size=kernel_block_size, hidden_size=hidden_size,
                         dtype=dtype, device=device, num_tokens_per_bs=num_tokens_per_bs, is_target_verify=True)
        self.verify = False
        self.sizes = [i * num_tokens_per_bs for i in range(1, max_bs + 1)]
        # initCaptureAttentionInputs: ceil(max_seq_len / block) + sp_steps (k) physical blocks per row
        ratio = block_size // kernel_block_size
        self.max_blocks = (-(-max_seq_len // block_size) + num_tokens_per_bs - 1) * ratio
        self.replayed_batches = []

    def _static_inputs(self):
        """``initCaptureAttentionInputs`` in prefill mode (``cuda_graph_runner.cc:895-985``) and
        ``initKernelInternalMemory`` (873-889): ``max_bs`` requests of k+1 tokens, no prefix (CUDA's
        ``prefix_init`` 0), zero tables."""
        n, dev, q = self.max_bs, self.device, self.q
        a = PyAttentionInputs()
        a.is_prefill, a.is_target_verify, a.is_cuda_graph, a.is_s_padded, a.dtype = True, False, True, True, self.dtype
        a.input_lengths = self._host(torch.full((n,), q, dtype=_I32))
        a.input_lengths_device = a.input_lengths.to(dev)
        a.sequence_lengths = self._host(torch.full((n,), self.max_seq_len - q - 1, dtype=_I32))
        a.sequence_lengths_plus_1_device = (a.sequence_lengths + 1).to(dev)
        a.prefix_lengths = self._host(torch.zeros(n, dtype=_I32))
        a.prefix_lengths_device = a.prefix_lengths.to(dev)
        a.kv_cache_kernel_block_id_device = torch.zeros((n, self.max_blocks), dtype=_I32, device=dev)
        a.kv_cache_kernel_block_id = self._host(torch.zeros((n, self.max_blocks), dtype=_I32))
        a.padding_offset = self._host(torch.zeros(self.max_seq_len * n, dtype=_I32))
        a.decode_cu_seqlens = self._host(torch.arange(n + 1, dtype=_I32))
        a.decode_cu_seqlens_device = a.decode_cu_seqlens.to(dev)
        cu, cu_kv = torch.zeros(n + 1, dtype=_I32), torch.zeros(n + 1, dtype=_I32)
        cu[1:], cu_kv[1:] = torch.cumsum(a.input_lengths, 0), torch.cumsum(a.input_lengths + a.prefix_lengths, 0)
        a.cu_seqlens, a.cu_seqlens_device, a.cu_kv_seqlens_device = self._host(cu), cu.to(dev), cu_kv.to(dev)
        a.context_total_kv_length = n * q
        hiddens = torch.zeros((n * q, self.hidden_size), dtype=self.dtype, device=dev)
        return PyModelInputs(input_ids=torch.zeros(n * q, dtype=_I32, device=dev), input_hiddens=hiddens,
                             attention_inputs=a)

    def _capture_inputs(self, full, key):
        """``prepareCaptureInputs(inputs, max_bs, key)`` (``cuda_graph_runner.cc:1212-1297``): every per-request field
        is the max_bs buffer itself (one storage for all keys), the token rows its first ``key``; then the capture's
        lengths (``cuda_graph_prefill.cc:36-71``): ``ceil(key / (k+1))`` requests of k+1 tokens, the others none,
        every request behind the largest legal prefix ``max_seq_len - (k+1)``."""
        inputs = self._slice(full, self.max_bs)
        q = self.q
        inputs.input_ids, inputs.input_hiddens = full.input_ids[:key], full.input_hiddens[:key]
        a = inputs.attention_inputs
        a.is_target_verify = False
        a.prefix_lengths, a.prefix_lengths_device = full.attention_inputs.prefix_lengths, \
            full.attention_inputs.prefix_lengths_device
        a.padding_offset = full.attention_inputs.padding_offset[:key]
        active = -(-key // q)
        a.input_lengths.fill_(0)
        a.prefix_lengths.fill_(self.max_seq_len - q if self.max_seq_len > q else 0)
        for b in range(active):
            a.input_lengths[b] = q if b < active - 1 else key - b * q
        cu, cu_kv = torch.zeros(self.max_bs + 1, dtype=_I32), torch.zeros(self.max_bs + 1, dtype=_I32)
        cu[1:] = torch.cumsum(a.input_lengths, 0)
        cu_kv[1:] = torch.cumsum(a.input_lengths + a.prefix_lengths, 0)
        a.cu_seqlens.copy_(cu)
        a.cu_seqlens_device.copy_(cu)
        a.cu_kv_seqlens_device.copy_(cu_kv)
        a.input_lengths_device.copy_(a.input_lengths)
        a.prefix_lengths_device.copy_(a.prefix_lengths)
        a.context_total_kv_length = key
        return inputs

    def _rows(self, key) -> int:
        """A prefill graph's key is its token count (``capturePrefill``, ``cuda_graph_prefill.cc:6-98``: largest key
        first, its inputs, ``prepare_fmha_impl``, two forwards, the capture, one replay)."""
        return key

    def can_run(self, live):
        """``canRun`` in prefill mode (``cuda_graph_runner.cc:811-870``): a prefill whose total token count is within
        the largest key (lower_bound); the scheduler keeps its batch within ``max_bs``."""
        la = live.attention_inputs
        return bool(la.is_prefill) and 0 < live.input_ids.shape[0] <= self.sizes[-1] and \
            la.input_lengths.shape[0] <= self.max_bs

    def forward(self, live):
        """One replay: ``prepareInputData`` (the live ids and hidden rows into the key's head), then
        ``prepareAttentionInputs`` in prefill mode (the device table zeroed and the live rows copied, the live
        lengths and cumulative lengths copied on device and host, the host table's live rows only, the padding
        requests' lengths zeroed and their cumulative lengths held at the live totals), ``prepare_cuda_graph``,
        the replay; returns ``hidden[:tokens]`` (a copy)."""
        la = live.attention_inputs
        tokens, bs = live.input_ids.shape[0], la.input_lengths.shape[0]
        key = next(k for k in self.sizes if k >= tokens)
        inst = self.instances[key]
        s = inst.inputs.attention_inputs
        inst.inputs.input_ids[:tokens].copy_(live.input_ids)
        self._copy_hiddens(inst, live)
        s.kv_cache_kernel_block_id_device.zero_()
        s.prefix_lengths_device[bs:].zero_()
        s.input_lengths_device[bs:].zero_()
        s.cu_seqlens_device[bs + 1:].fill_(tokens)
        s.cu_kv_seqlens_device[bs + 1:].fill_(int(la.cu_kv_seqlens_device[bs]))
        for name, n in (("cu_seqlens_device", bs + 1), ("cu_kv_seqlens_device", bs + 1), ("input_lengths_device", bs),
                        ("prefix_lengths_device", bs), ("cu_seqlens", bs + 1), ("input_lengths", bs),
                        ("prefix_lengths", bs)):
            getattr(s, name)[:n].copy_(getattr(la, name)[:n])
        for name in ("kv_cache_kernel_block_id_device", "kv_cache_kernel_block_id"):  # host mirror: not zeroed
            src = getattr(la, name)
            getattr(s, name)[:src.shape[0], :src.shape[1]].copy_(src)
        self.replayed_batches.append(bs)  # prefill_cuda_graph_copy_params.cuda_graph_prefill_batch_size
        if bs < self.max_bs:  # cuda_graph_runner.cc:588-612
            for name in ("prefix_lengths", "input_lengths", "prefix_lengths_device", "input_lengths_device"):
                getattr(s, name)[bs:].zero_()
            s.cu_seqlens[bs + 1:].fill_(tokens)
            s.cu_seqlens_device[bs + 1:].fill_(tokens)
            s.cu_kv_seqlens_device[bs + 1:].fill_(int(la.context_total_kv_length))
        prepare = getattr(inst.impl, "prepare_cuda_graph", None)
        if prepare is not None:
            prepare(s)
        self._replay(inst)
        self.replays_by_size[key] = self.replays_by_size.get(key, 0) + 1
        return inst.hidden[:tokens].clone()
