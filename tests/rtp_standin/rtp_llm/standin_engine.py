"""Test stand-in of the RTP-LLM runtime around an external (plugin) model. NOT RTP-LLM code.

Written from /work/shared/reference/rtp_llm_contract.md; it does what RTP's C++/Python runtime does to a
plugin model, on one device, greedily:

- ``external_packages`` / ``load_external_packages``: ``--external_model_packages`` or the env var
  ``RTP_LLM_EXTERNAL_MODEL_PACKAGES``, each dotted module imported once;
- ``resolve_model_class``: MODEL_TYPE, else config.json ``architectures[0]`` through the registry;
- ``allocate_kv_cache``: the "C++ allocator", sized only from config fields;
- ``Engine``: config, ``from_config``, ``load``, ``initialize`` (twice with CUDA graphs), a block manager
  with optional prefix reuse, all-prefill then all-decode steps, the LM head applied by the engine in fp32,
  decode CUDA graphs. On CPU nothing is captured: a "replay" calls ``forward(static, impl)`` again on the
  same static inputs, which keeps the call protocol (static buffers, ``prepare_cuda_graph``, ``[:bs]``).
- ``launch``: an Engine from CLI flags / env settings (the contract's settings table).
"""

import importlib
import json
import math
import os
from collections import OrderedDict
from itertools import accumulate

import torch

from rtp_llm.model_factory_register import _hf_architecture_2_ft, _model_factory
from rtp_llm.models_py.model_desc.module_base import GptModelBase
from rtp_llm.ops.compute_ops import (
    KVCache, LayerKVCache, PyAttentionInputs, PyModelInitResources, PyModelInputs,
)

_ACT_TYPES = {"BF16": torch.bfloat16, "FP16": torch.float16, "FP32": torch.float32}
_REQUIRED_GLOBAL_WEIGHTS = ("lm_head", "embedding", "final_layernorm.gamma")
_I32 = torch.int32


def _cli_value(argv, flag):
    """The value of ``--flag v`` or ``--flag=v`` in argv (the last one wins), or None."""
    value, opt = None, "--" + flag
    for i, arg in enumerate(argv):
        if arg == opt and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(opt + "="):
            value = arg[len(opt) + 1:]
    return value


def _setting(argv, env, name):
    value = _cli_value(argv, name)
    return env.get(name.upper()) if value is None else value


def _truthy(value):
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def external_packages(argv, env):
    """Dotted module paths from ``--external_model_packages`` (either spelling), else the env var."""
    raw = _cli_value(argv, "external_model_packages")
    if raw is None:
        raw = env.get("RTP_LLM_EXTERNAL_MODEL_PACKAGES", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def load_external_packages(argv, env):
    """Import each external package once (registration is the import's side effect); return the modules."""
    modules = []
    for name in dict.fromkeys(external_packages(argv, env)):
        modules.append(importlib.import_module(name))
    return modules


def _read_hf_config(ckpt_path):
    path = os.path.join(ckpt_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def resolve_model_class(ckpt_path, model_type=None):
    """The registered class for MODEL_TYPE, or for config.json ``architectures[0]`` when it is unset."""
    key = model_type
    if not key:
        hf = _read_hf_config(ckpt_path)
        archs = (hf or {}).get("architectures") or []
        if not archs:
            raise ValueError(f"MODEL_TYPE unset and no config.json architectures under {ckpt_path!r}")
        key = _hf_architecture_2_ft.get(archs[0])
        if key is None:
            raise ValueError(f"architecture {archs[0]!r} is not registered (known: {sorted(_hf_architecture_2_ft)})")
    if key not in _model_factory:
        raise ValueError(f"model type {key!r} is not registered (known: {sorted(_model_factory)})")
    return _model_factory[key]


def _act_type_for(ckpt_path, act_type):
    """ACT_TYPE, forced to BF16 for block-wise FP8 checkpoints (config.json quantization_config)."""
    q = ((_read_hf_config(ckpt_path) or {}).get("quantization_config")) or {}
    if q.get("quant_method") == "fp8" and q.get("weight_block_size"):
        return "BF16"
    return act_type.upper()


def allocate_kv_cache(config, num_blocks, seq_size_per_block, kernel_seq_size_per_block, device):
    """The per-layer MLA cache (+ DSA indexer cache in ``kv_scale_base``), from config fields only.

    ``config.data_type`` and ``config.attn_config.kv_cache_dtype`` must be set. Kernel blocks per layer:
    ``num_blocks * ratio``. Compute-dtype cache width kv_lora_rank + rope_head_dim; FP8 ("ds_mla") a uint8
    width kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * rope_head_dim; indexer uint8 indexer_head_dim + 4.
    """
    attn = config.attn_config
    if not attn.use_mla:
        raise ValueError("the stand-in allocates MLA caches only (attn_config.use_mla is False)")
    kbs = kernel_seq_size_per_block or seq_size_per_block
    if seq_size_per_block % kbs:
        raise ValueError(f"kernel block size {kbs} does not divide block size {seq_size_per_block}")
    n = num_blocks * (seq_size_per_block // kbs)
    if attn.kv_cache_dtype == torch.float8_e4m3fn:
        shape = (n, kbs, attn.kv_lora_rank + 4 * (attn.kv_lora_rank // 128) + 2 * attn.rope_head_dim)
        dtype = torch.uint8
    else:
        shape, dtype = (n, kbs, attn.kv_lora_rank + attn.rope_head_dim), config.data_type
    layers = []
    for i in range(config.num_layers):
        kv = torch.zeros(shape, dtype=dtype, device=device)
        scale = None
        if attn.is_sparse:
            scale = torch.zeros((n, kbs, attn.indexer_head_dim + 4), dtype=torch.uint8, device=device)
        layers.append(LayerKVCache(kv, scale, kbs, i))
    return KVCache(layers, seq_size_per_block, kbs)


def kernel_block_table(physical, ratio):
    """[B, M] physical ids -> [B, M * ratio] kernel ids ``physical * ratio + j``; padding 0 stays 0."""
    j = torch.arange(ratio, dtype=physical.dtype, device=physical.device)
    kernel = physical.unsqueeze(-1) * ratio + j
    kernel = torch.where(physical.unsqueeze(-1) == 0, torch.zeros_like(kernel), kernel)
    return kernel.reshape(physical.shape[0], -1)


class ParallelismConfig:
    """Single device: tp = ep = 1."""

    def __init__(self):
        self.tp_size, self.tp_rank, self.ep_size, self.ep_rank = 1, 0, 1, 0
        self.dp_size, self.dp_rank, self.world_size, self.world_rank, self.local_rank = 1, 0, 1, 0, 0


class HWKernelConfig:
    def __init__(self, enable_cuda_graph, decode_capture_batch_sizes):
        self.enable_cuda_graph = enable_cuda_graph
        self.decode_capture_batch_sizes = list(decode_capture_batch_sizes)


class BlockManager:
    """Physical blocks 1..num_blocks-1 (0 is reserved), refcounted, with a prefix cache of full blocks.

    Cache keys chain (parent key, block tokens). Finished requests' full blocks stay cached until a block
    is needed and none is free; then the least recently used unreferenced cached block is evicted.
    """

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        self.refs = {}
        self.cached = OrderedDict()  # key -> block
        self.key_of = {}  # block -> key

    def alloc(self):
        if not self.free:
            idle = next((k for k, b in self.cached.items() if not self.refs.get(b)), None)
            if idle is not None:
                block = self.cached.pop(idle)
                del self.key_of[block]
                self.free.append(block)
        if not self.free:
            raise RuntimeError("KV cache exhausted: no free block (raise num_blocks)")
        block = self.free.pop(0)
        self.refs[block] = 1
        return block

    def match_prefix(self, tokens):
        """Cached blocks for the leading full blocks of ``tokens``, leaving at least one token to compute."""
        blocks, key, bs = [], None, self.block_size
        for i in range((len(tokens) - 1) // bs):
            key = (key, tuple(tokens[i * bs:(i + 1) * bs]))
            block = self.cached.get(key)
            if block is None:
                break
            self.cached.move_to_end(key)
            self.refs[block] = self.refs.get(block, 0) + 1
            blocks.append(block)
        return blocks

    def release(self, blocks, cached_tokens):
        """Cache the full blocks holding ``cached_tokens``, then drop the request's references."""
        key, bs = None, self.block_size
        for i in range(len(cached_tokens) // bs):
            key = (key, tuple(cached_tokens[i * bs:(i + 1) * bs]))
            if key not in self.cached and blocks[i] not in self.key_of:
                self.cached[key] = blocks[i]
                self.key_of[blocks[i]] = key
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0 and block not in self.key_of:
                del self.refs[block]
                self.free.append(block)


class _Request:
    def __init__(self, prompt):
        self.prompt = list(prompt)
        self.tokens = list(prompt)  # prompt + generated; all but the last are in the cache
        self.blocks = []
        self.prefix_len = 0


class Engine:
    """RTP's runtime around one registered model class. Counters for tests:
    ``prefill_steps``, ``eager_decode_steps``, ``graph_replays`` (total), ``replays_by_size`` {S: n},
    ``captured_sizes`` (capture order, largest first), ``init_calls`` (kv_cache passed each time).
    """

    def __init__(self, ckpt_path, *, model_type=None, act_type="BF16", fp8_kv_cache=False,
                 seq_size_per_block=64, kernel_seq_size_per_block=0, enable_cuda_graph=False,
                 decode_capture_batch_sizes=(1, 2, 4, 8), num_blocks=64, max_seq_len=None, device="cpu"):
        self.device = torch.device(device)
        self.model_cls = resolve_model_class(ckpt_path, model_type)
        self.act_type = _act_type_for(ckpt_path, act_type)
        if self.act_type not in _ACT_TYPES:
            raise ValueError(f"ACT_TYPE {act_type!r} not one of {sorted(_ACT_TYPES)}")
        self.dtype = _ACT_TYPES[self.act_type]
        self.config = config = self.model_cls._create_config(ckpt_path)
        config.data_type = self.dtype
        config.attn_config.kv_cache_dtype = torch.float8_e4m3fn if fp8_kv_cache else self.dtype
        config.ckpt_path = ckpt_path
        self.enable_cuda_graph = enable_cuda_graph
        self.capture_sizes = sorted(set(decode_capture_batch_sizes), reverse=True)
        self.parallelism_config = ParallelismConfig()
        self.hw_kernel_config = HWKernelConfig(enable_cuda_graph, decode_capture_batch_sizes)
        self.model = self.model_cls.from_config(
            model_config=config, parallelism_config=self.parallelism_config,
            hw_kernel_config=self.hw_kernel_config, kv_cache_config=None, fmha_config=None,
            moe_config=None, load_method=None, max_generate_batch_size=max(decode_capture_batch_sizes),
            some_future_kwarg=1)
        if enable_cuda_graph and not self.model.support_cuda_graph():
            raise RuntimeError(f"ENABLE_CUDA_GRAPH=1 but {self.model_cls.__name__}.support_cuda_graph() is False")
        self.model.load()
        self.py_model = self.model.py_model
        if not isinstance(self.py_model, GptModelBase):
            raise TypeError(f"model.py_model must be a GptModelBase, got {type(self.py_model).__name__}")
        gw = getattr(self.model.weight, "global_weights", None) or {}
        missing = [k for k in _REQUIRED_GLOBAL_WEIGHTS if k not in gw]
        if missing:
            raise KeyError(f"model.weight.global_weights lacks {missing}")
        self.lm_head = gw["lm_head"]

        self.block_size = seq_size_per_block
        self.kv_cache = allocate_kv_cache(config, num_blocks, seq_size_per_block, kernel_seq_size_per_block,
                                          self.device)
        self.kernel_block_size = self.kv_cache.get_kernel_seq_size_per_block()
        self.ratio = seq_size_per_block // self.kernel_block_size
        self.block_manager = BlockManager(num_blocks, seq_size_per_block)
        self.max_seq_len = max_seq_len or config.max_seq_len
        if not self.max_seq_len:
            raise ValueError("max_seq_len: neither given nor set by _create_config")

        self.prefill_steps = self.eager_decode_steps = self.graph_replays = 0
        self.replays_by_size, self.captured_sizes, self.init_calls = {}, [], []
        self.graphs = {}  # S -> (static PyModelInputs, impl, CUDAGraph or None, static PyModelOutputs)
        for cache in ([None] if enable_cuda_graph else []) + [self.kv_cache]:
            self.init_calls.append(cache)
            if self.py_model.initialize(PyModelInitResources(kv_cache=cache)) is not True:
                raise RuntimeError("py_model.initialize() did not return True")
        if enable_cuda_graph:
            self._capture_all()

    # --- tensors -------------------------------------------------------------------------------------
    @staticmethod
    def _pin(t):
        return t.pin_memory() if torch.cuda.is_available() else t

    def _host(self, values):
        return self._pin(torch.tensor(values, dtype=_I32))

    def _dev(self, t):
        return t.to(self.device)

    def _tables(self, block_lists, width=None):
        width = width or max(1, max(len(b) for b in block_lists))
        phys = torch.zeros((len(block_lists), width), dtype=_I32)
        for i, b in enumerate(block_lists):
            phys[i, :len(b)] = torch.tensor(b, dtype=_I32)
        phys, kern = self._pin(phys), self._pin(kernel_block_table(phys, self.ratio))
        return dict(kv_cache_block_id=phys, kv_cache_block_id_device=self._dev(phys),
                    kv_cache_kernel_block_id=kern, kv_cache_kernel_block_id_device=self._dev(kern))

    def _decode_inputs(self, ids, input_lengths, seq_lens, block_lists, width=None, is_cuda_graph=False):
        b = len(ids)
        seq = self._host(seq_lens)
        zeros = self._host([0] * (b + 1))
        attn = PyAttentionInputs(
            is_prefill=False, is_cuda_graph=is_cuda_graph, dtype=self.dtype,
            input_lengths=self._host(input_lengths), prefix_lengths=self._host([]), sequence_lengths=seq,
            sequence_lengths_plus_1_device=self._dev(seq + 1), cu_seqlens=zeros,
            cu_seqlens_device=self._dev(zeros), cu_kv_seqlens_device=self._dev(zeros),
            decode_cu_seqlens_device=self._dev(torch.arange(b + 1, dtype=_I32)),
            **self._tables(block_lists, width))
        return PyModelInputs(input_ids=self._dev(torch.tensor(ids, dtype=_I32)), attention_inputs=attn)

    def _check_hidden(self, hidden, rows):
        want = (rows, self.config.hidden_size)
        if not torch.is_tensor(hidden) or tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            got = (tuple(hidden.shape), hidden.dtype) if torch.is_tensor(hidden) else type(hidden)
            raise RuntimeError(f"forward hidden_states: expected {want} {self.dtype}, got {got}")

    def _next_tokens(self, rows):
        logits = rows.float() @ self.lm_head.float().t()
        return logits.argmax(dim=-1).tolist()

    # --- CUDA graphs ---------------------------------------------------------------------------------
    def _capture_all(self):
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        width = math.ceil(self.max_seq_len / self.block_size)
        for s in self.capture_sizes:
            static = self._decode_inputs([0] * s, [1] * s, [self.max_seq_len - 2] * s, [[]] * s,
                                         width=width, is_cuda_graph=True)
            impl = self.py_model.prepare_fmha_impl(static, True)
            out = self.py_model.forward(static, impl)  # eager warm-up
            graph = None
            if cuda:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.py_model.forward(static, impl)
            self.graphs[s] = (static, impl, graph, out)
            self.captured_sizes.append(s)

    def _replay(self, s, live, bs):
        static, impl, graph, out = self.graphs[s]
        sa, la = static.attention_inputs, live.attention_inputs
        for name in ("kv_cache_block_id", "kv_cache_block_id_device",
                     "kv_cache_kernel_block_id", "kv_cache_kernel_block_id_device"):
            dst, src = getattr(sa, name), getattr(la, name)
            dst.zero_()
            dst[:bs, :src.shape[1]].copy_(src)
        static.input_ids[:bs].copy_(live.input_ids)
        for name in ("input_lengths", "sequence_lengths", "sequence_lengths_plus_1_device", "prefix_lengths",
                     "cu_seqlens", "cu_seqlens_device", "decode_cu_seqlens_device"):
            src = getattr(la, name)
            if src.numel():
                getattr(sa, name)[:src.numel()].copy_(src)
        impl.prepare_cuda_graph(sa)
        if graph is not None:
            graph.replay()
        else:  # CPU emulation of a replay: the same forward on the same static inputs
            out = self.py_model.forward(static, impl)
        self.graph_replays += 1
        self.replays_by_size[s] = self.replays_by_size.get(s, 0) + 1
        self._check_hidden(out.hidden_states, s)
        return out.hidden_states[:bs]

    # --- generation ----------------------------------------------------------------------------------
    def _grow(self, req, n_tokens):
        while len(req.blocks) * self.block_size < n_tokens:
            req.blocks.append(self.block_manager.alloc())

    def _prefill(self, reqs):
        lens, prefix, ids = [], [], []
        for r in reqs:
            lens.append(len(r.prompt) - r.prefix_len)
            prefix.append(r.prefix_len)
            ids.extend(r.prompt[r.prefix_len:])
        cu = self._host(list(accumulate(lens, initial=0)))
        cu_kv = self._host(list(accumulate((a + b for a, b in zip(lens, prefix)), initial=0)))
        attn = PyAttentionInputs(
            is_prefill=True, is_cuda_graph=False, dtype=self.dtype, input_lengths=self._host(lens),
            prefix_lengths=self._host(prefix), sequence_lengths=self._host([]),
            sequence_lengths_plus_1_device=self._dev(self._host([])), cu_seqlens=cu,
            cu_seqlens_device=self._dev(cu), cu_kv_seqlens_device=self._dev(cu_kv),
            decode_cu_seqlens_device=self._dev(self._host([])),
            **self._tables([r.blocks for r in reqs]))
        inputs = PyModelInputs(input_ids=self._dev(torch.tensor(ids, dtype=_I32)), attention_inputs=attn)
        impl = self.py_model.prepare_fmha_impl(inputs, False)
        hidden = self.py_model.forward(inputs, impl).hidden_states
        self._check_hidden(hidden, len(ids))
        self.prefill_steps += 1
        return self._next_tokens(hidden[(cu[1:] - 1).long().to(hidden.device)])

    def _decode(self, reqs):
        bs = len(reqs)
        live = self._decode_inputs([r.tokens[-1] for r in reqs], [len(r.prompt) for r in reqs],
                                   [len(r.tokens) - 1 for r in reqs], [r.blocks for r in reqs])
        sizes = [s for s in self.capture_sizes if s >= bs] if self.enable_cuda_graph else []
        if sizes:
            hidden = self._replay(min(sizes), live, bs)
        else:
            impl = self.py_model.prepare_fmha_impl(live, False)
            hidden = self.py_model.forward(live, impl).hidden_states
            self._check_hidden(hidden, bs)
            self.eager_decode_steps += 1
        return self._next_tokens(hidden)

    def generate(self, prompts, max_new_tokens, *, reuse_prefix=False):
        """Greedy: one all-prefill batch of every prompt, then all-decode steps; returns the new tokens."""
        if max_new_tokens < 1 or not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need non-empty prompts and max_new_tokens >= 1")
        for p in prompts:
            if len(p) + max_new_tokens - 1 > self.max_seq_len:
                raise ValueError(f"prompt of {len(p)} + {max_new_tokens} new tokens exceeds max_seq_len")
        reqs = [_Request(p) for p in prompts]
        try:
            for r in reqs:
                if reuse_prefix:
                    r.blocks = self.block_manager.match_prefix(r.prompt)
                    r.prefix_len = len(r.blocks) * self.block_size
                self._grow(r, len(r.prompt))
            for r, t in zip(reqs, self._prefill(reqs)):
                r.tokens.append(t)
            for _ in range(max_new_tokens - 1):
                for r in reqs:
                    self._grow(r, len(r.tokens))
                for r, t in zip(reqs, self._decode(reqs)):
                    r.tokens.append(t)
        finally:
            for r in reqs:
                # only fully computed blocks are worth caching; on error, cache nothing
                done = len(r.tokens) - len(r.prompt) == max_new_tokens
                self.block_manager.release(r.blocks, r.tokens[:-1] if done else [])
        return [r.tokens[len(r.prompt):] for r in reqs]


def launch(argv=(), env=None, **overrides):
    """An Engine from launch settings: flags ``--name v`` first, then env ``NAME`` (contract's table).

    Imports the external packages first, then resolves MODEL_TYPE / config.json. LOAD_PYTHON_MODEL is
    accepted and ignored. ``overrides`` are Engine keyword arguments (e.g. num_blocks, device).
    """
    env = dict(os.environ if env is None else env)
    argv = list(argv)
    load_external_packages(argv, env)
    ckpt = overrides.pop("ckpt_path", None) or _setting(argv, env, "checkpoint_path")
    if not ckpt:
        raise ValueError("CHECKPOINT_PATH is not set")
    kwargs = dict(
        model_type=_setting(argv, env, "model_type") or None,
        act_type=_setting(argv, env, "act_type") or "BF16",
        fp8_kv_cache=_truthy(_setting(argv, env, "fp8_kv_cache") or "0"),
        enable_cuda_graph=_truthy(_setting(argv, env, "enable_cuda_graph") or "0"),
        seq_size_per_block=int(_setting(argv, env, "seq_size_per_block") or 64),
        kernel_seq_size_per_block=int(_setting(argv, env, "kernel_seq_size_per_block") or 0),
        decode_capture_batch_sizes=tuple(
            int(x) for x in (_setting(argv, env, "decode_capture_config") or "1,2,4,8").split(",") if x.strip()),
    )
    kwargs.update(overrides)
    return Engine(ckpt, **kwargs)
