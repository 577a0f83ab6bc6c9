"""Test stand-in of the RTP-LLM runtime around an external (plugin) model. NOT RTP-LLM code.

Written from rtp-llm's source (main 4b8d39cd5 and PR #1266 head 6a6024414; see
/work/shared/reference/rtp_llm_audit.md and tests/rtp_standin/README.md for what still differs). What RTP
does to a plugin model, on one device, greedily:

- ``parse_args``: launch settings, flags first then env; ``--external_model_packages`` is a CLI flag only
  (PR #1266: identifiers checked, duplicates dropped, the last flag wins; no env var is read);
- ``rank_model_classes``: the per-rank processes (``spawn``), each importing the packages again;
- ``Engine``: ``ModelFactory.create_model_config`` (packages imported, model type resolved, ``_create_config``,
  then RTP's own fields: ``data_type``, ``kv_cache_dtype``, ``max_seq_len``), ``from_config`` (which calls
  ``load()``), the warm-up of the role (PDFUSION: a ``max_seq_len - 1`` token prefill with no cache after
  ``initialize(None)``; DECODE: a 5-block cache with zero block ids), the cache allocation, ``initialize(kv)``
  (twice with CUDA graphs) and the graph capture (``standin_graph``), prefill / decode steps with the
  C++ post-layers (lm_head from ``global_weights`` in fp32) and greedy sampling, then ``model_weights_loader``
  read as ``rpc_engine._start`` does.
"""

import argparse
import json
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import traceback
from itertools import accumulate

import torch

from rtp_llm.model_factory_register import _hf_architecture_2_ft, ensure_model_registered
from rtp_llm.models_py.model_desc.module_base import GptModelBase
from rtp_llm.config.server_config_setup import set_parallelism_config
from rtp_llm.models_py.distributed import collective_torch
from rtp_llm.models_py.distributed.collective_torch import Group
from rtp_llm.ops import KvCacheDataType, NcclCommConfig, ParallelismConfig
from rtp_llm.ops.compute_ops import PyAttentionInputs, PyModelInputs, init_resources
from rtp_llm.standin_cache import BlockManager, allocate_kv_cache, kernel_block_table
from rtp_llm.standin_graph import CudaGraphRunner
from rtp_llm.utils.import_util import load_external_model_packages

_I32 = torch.int32
DEFAULT_MAX_SEQ_LEN = 8192  # build_model_config: 8192 when neither the model nor MAX_SEQ_LEN sets it
DEFAULT_CAPTURE_SIZES = (1, 8, 16, 24, 32)  # cuda_graph_decode.cc, up to max_generate_batch_size


def parse_external_model_packages(value):
    names = []
    for item in value.split(","):
        name = item.strip()
        if not name:
            continue
        if not all(part.isidentifier() for part in name.split(".")):
            raise argparse.ArgumentTypeError(f"invalid external model package path: {name!r}")
        if name not in names:
            names.append(name)
    return names


def _bool(value):
    return str(value).strip().lower() in ("1", "true", "yes", "on")


_SETTINGS = (  # (flag, env var or None for CLI only, type, default)
    ("external_model_packages", None, parse_external_model_packages, None),
    ("checkpoint_path", "CHECKPOINT_PATH", str, None),
    ("model_type", "MODEL_TYPE", str, None),
    ("act_type", "ACT_TYPE", str, None),
    ("fp8_kv_cache", "FP8_KV_CACHE", _bool, False),
    ("enable_cuda_graph", "ENABLE_CUDA_GRAPH", _bool, False),
    ("seq_size_per_block", "SEQ_SIZE_PER_BLOCK", int, 64),
    ("kernel_seq_size_per_block", "KERNEL_SEQ_SIZE_PER_BLOCK", int, 0),
    ("decode_capture_config", "DECODE_CAPTURE_CONFIG", str, ""),
    ("max_seq_len", "MAX_SEQ_LEN", int, None),
    ("warm_up", "WARM_UP", _bool, True),
    ("role_type", "ROLE_TYPE", str, "PDFUSION"),
    ("concurrency_limit", "CONCURRENCY_LIMIT", int, 32),
    ("test_block_num", "TEST_BLOCK_NUM", int, 0),
)


_SERVER_SETTINGS = (  # the server's own settings (rtp_llm/server/server_args/ at 4b8d39cd5)
    ("tp_size", "TP_SIZE", int, 1),  # parallel_group_args.py:14-62
    ("ep_size", "EP_SIZE", int, 0),
    ("dp_size", "DP_SIZE", int, 1),
    ("world_size", "WORLD_SIZE", int, 1),
    ("world_rank", "WORLD_RANK", int, 0),
    ("local_world_size", "LOCAL_WORLD_SIZE", int, 1),
    ("sp_model_type", "SP_MODEL_TYPE", str, ""),  # speculative_decoding_group_args.py:9-84
    ("sp_type", "SP_TYPE", str, ""),
    ("sp_checkpoint_path", "SP_CHECKPOINT_PATH", str, None),
    ("gen_num_per_cycle", "GEN_NUM_PER_CIRCLE", int, 1),
)


def parse_args(argv, env, *, pr1266=True, server=False):
    """Settings as a dict: a flag wins over its env var; argparse exits (SystemExit 2) on a bad value or an
    unknown flag. ``pr1266``: RTP with PR #1266, which declares ``--external_model_packages`` (stock main
    4b8d39cd5 does not, so there the flag is an unknown one). ``server``: also the server's parallelism and
    speculative-decoding settings (``rtp_llm.server.server_args.setup_args``)."""
    parser = argparse.ArgumentParser(prog="rtp_llm.start_server", allow_abbrev=False)
    settings = tuple(s for s in _SETTINGS if pr1266 or s[0] != "external_model_packages")
    for flag, var, kind, default in settings + (_SERVER_SETTINGS if server else ()):
        value = env.get(var) if var else None
        parser.add_argument("--" + flag, type=kind, default=kind(value) if value is not None else default)
    args = vars(parser.parse_args(list(argv)))
    args.setdefault("external_model_packages", None)
    return args


def _read_hf_config(ckpt_path):
    path = os.path.join(ckpt_path, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def resolve_model_class(ckpt_path, model_type=None):
    """The class for MODEL_TYPE, or for config.json ``architectures[0]`` when it is unset (KeyError if none)."""
    key = model_type
    if not key:
        archs = _read_hf_config(ckpt_path).get("architectures") or []
        key = _hf_architecture_2_ft.get(archs[0]) if archs else None
        if key is None:
            raise KeyError(f"cannot infer the model type of {ckpt_path!r} from architectures {archs}")
    return ensure_model_registered(key)


def _rank_main(packages, model_type, queue):
    load_external_model_packages(packages)
    cls = ensure_model_registered(model_type)
    queue.put(f"{cls.__module__}.{cls.__qualname__}")


def rank_model_classes(argv, env, world_size):
    """What each of ``world_size`` spawned rank processes resolves MODEL_TYPE to, after importing the packages
    itself (``start_backend_server``: a ``spawn`` context; ``ModelFactory.create_model_config`` per rank)."""
    args = parse_args(argv, env)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(args["external_model_packages"], args["model_type"], queue))
             for _ in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"rank processes exited with {[p.exitcode for p in procs]}")
    return [queue.get(timeout=10) for _ in procs]


def _act_type(hf, act_type, config_dtype):
    """``init_precision_config``: block-FP8 weights force BF16; else ACT_TYPE, else config_dtype, else FP16."""
    q = hf.get("quantization_config") or {}
    if q.get("quant_method") == "fp8" and q.get("weight_block_size"):
        return "bf16"
    name = act_type or config_dtype or "fp16"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(name).lower(), str(name).lower())


def build_model_config(model_cls, ckpt_path, *, act_type=None, fp8_kv_cache=False, seq_size_per_block=64,
                       max_seq_len=None):
    """The model's ``_create_config``, then what RTP's ``build_model_config`` sets that a plugin reads (the
    stand-in sets these fields by hand): ``ckpt_path``, the compute dtype (``init_precision_config``), the KV cache
    dtype, ``tokens_per_block`` and ``max_seq_len`` (MAX_SEQ_LEN over the model's value, 8192 if neither)."""
    config = model_cls._create_config(ckpt_path)
    config.ckpt_path = ckpt_path
    config.data_type = _act_type(_read_hf_config(ckpt_path), act_type, config.config_dtype)
    config.attn_config.kv_cache_dtype = KvCacheDataType.FP8 if fp8_kv_cache else KvCacheDataType.BASE
    config.attn_config.tokens_per_block = seq_size_per_block
    if max_seq_len:
        config.max_seq_len = max_seq_len
    if not config.max_seq_len:
        config.max_seq_len = DEFAULT_MAX_SEQ_LEN
    return config


def create_model(model_cls, config, parallelism_config, hw_kernel_config, max_generate_batch_size, **alias):
    """``model_cls.from_config`` (which calls ``load``) with RTP's arguments in order, as
    ``ModelFactory._create_model`` (``model_factory.py:94-110``) and ``get_sp_model`` (``:183-199``, the draft
    with the target's ``parallelism_config``, and ``alias``: its ``weight_alias_owner`` / ``weight_alias_names``,
    passed only with names) call it; the stand-in passes None for the configs no plugin reads."""
    if not alias.get("weight_alias_names"):
        alias = {}
    return model_cls.from_config(config, parallelism_config, hw_kernel_config, None, None, None, None,
                                 max_generate_batch_size, None, False, None, **alias)


class HWKernelConfig:
    def __init__(self, enable_cuda_graph, decode_capture_batch_sizes):
        self.enable_cuda_graph = enable_cuda_graph
        self.decode_capture_batch_sizes = list(decode_capture_batch_sizes)
        self.enable_layer_micro_batch = 0


class _Request:
    def __init__(self, prompt):
        self.prompt = list(prompt)
        self.tokens = list(prompt)  # prompt + generated; all but the last are in the cache
        self.blocks = []
        self.prefix_len = 0


class Engine:
    """RTP's runtime around one registered model class. Counters for tests: ``prefill_steps``,
    ``eager_decode_steps``, ``graph_replays``, ``init_calls`` (the kv_cache of each ``initialize``),
    ``graph_runner`` (captured sizes, replays per size); ``kv_pools``: the cache allocations."""

    def __init__(self, ckpt_path, *, external_model_packages=None, model_type=None, act_type=None,
                 fp8_kv_cache=False, seq_size_per_block=64, kernel_seq_size_per_block=0, enable_cuda_graph=False,
                 decode_capture_batch_sizes=None, max_generate_batch_size=None, num_blocks=64, max_seq_len=None,
                 warm_up=True, role_type="PDFUSION", device="cpu", parallelism_config=None, gen_num_per_cycle=0,
                 model=None):
        """``gen_num_per_cycle`` k > 0: the target of speculative decoding (``standin_speculative``), whose graphs
        are target-verify graphs of k+1 tokens per request (``PyWrappedModel.h:317-341``). ``model``: a model the
        launch already built and loaded (``ModelFactory.from_model_configs``, ``rtp_llm.model_factory``); the
        engine then starts around it, and the config arguments must be the ones it was built with."""
        self.device = torch.device(device)
        self.parallelism_config = parallelism_config or ParallelismConfig()
        sizes = tuple(decode_capture_batch_sizes or ())
        self.max_generate_batch_size = max_generate_batch_size or (max(sizes) if sizes else 32)
        sizes = sizes or tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= self.max_generate_batch_size)
        if model is None:
            # ModelFactory.create_model_config, then _create_model (from_config calls load)
            load_external_model_packages(external_model_packages)
            self.model_cls = resolve_model_class(ckpt_path, model_type)
            config = build_model_config(self.model_cls, ckpt_path, act_type=act_type, fp8_kv_cache=fp8_kv_cache,
                                        seq_size_per_block=seq_size_per_block, max_seq_len=max_seq_len)
            model = create_model(self.model_cls, config, self.parallelism_config,
                                 HWKernelConfig(enable_cuda_graph, sizes), self.max_generate_batch_size)
        self.model_cls, self.model, self.config = type(model), model, model.model_config
        config = self.config
        self.dtype, self.max_seq_len = config.compute_dtype, config.max_seq_len
        self.hw_kernel_config = model.hw_kernel_config
        built = (self.hw_kernel_config.enable_cuda_graph, config.attn_config.tokens_per_block)
        if built != (bool(enable_cuda_graph), seq_size_per_block):
            raise ValueError(f"(enable_cuda_graph, seq_size_per_block) = {(bool(enable_cuda_graph), seq_size_per_block)}"
                             f": the model was built with {built}")
        sizes = tuple(self.hw_kernel_config.decode_capture_batch_sizes)
        self.py_model = self.model.py_model
        if not isinstance(self.py_model, GptModelBase):
            raise TypeError(f"model.py_model must be a GptModelBase, got {type(self.py_model).__name__}")
        self.lm_head = self.model.weight.global_weights["lm_head"]  # WeightsConverter: W::lm_head
        # enable_fp32_lm_head (default True, model_weight_info.py:573-578): RTP holds the fp32 lm_head from the load
        # on; converting the bf16 one every step (1.9 GB read, 3.8 GB written at GLM-5's widths) cost a decode
        # step ~1.5 ms on an H200 that RTP never spends, and the scale-out bench charged it to the plugin
        self._lm_head_fp32 = self.lm_head.float()

        self.block_size, self.init_calls = seq_size_per_block, []
        self.prefill_steps = self.eager_decode_steps = self.graph_replays = 0
        if warm_up:
            self._warm_up(role_type, kernel_seq_size_per_block)
        self.num_blocks = num_blocks = self._sync_block_num(num_blocks)
        self.kv_cache, self.kv_pools = allocate_kv_cache(config, num_blocks, seq_size_per_block,
                                                         kernel_seq_size_per_block, self.device)
        self.kernel_block_size = self.kv_cache.get_kernel_seq_size_per_block(self.kv_cache.group_tags[0])
        self.ratio = seq_size_per_block // self.kernel_block_size
        self.block_manager = BlockManager(num_blocks, seq_size_per_block)
        self.graph_runner = None
        self._initialize(self.kv_cache)
        if enable_cuda_graph:
            self._initialize(self.kv_cache)
            self.graph_runner = CudaGraphRunner(
                self.py_model, max_bs=self.max_generate_batch_size, capture_sizes=sizes, max_seq_len=self.max_seq_len,
                block_size=seq_size_per_block, kernel_block_size=self.kernel_block_size,
                hidden_size=config.hidden_size, dtype=self.dtype, device=self.device,
                num_tokens_per_bs=gen_num_per_cycle + 1, is_target_verify=gen_num_per_cycle > 0)
            self.graph_runner.capture()
        self.model_weights_loader = self.model.model_weights_loader  # rpc_engine._start

    # --- lifecycle -----------------------------------------------------------------------------------
    def _initialize(self, kv_cache, **fields):
        self.init_calls.append(kv_cache)
        if self.py_model.initialize(init_resources(kv_cache, **fields)) is not True:
            raise RuntimeError("py_model.initialize() did not return True")

    def _warm_up(self, role_type, kernel_seq_size_per_block):
        """The role's warm-up; returns its hidden rows. RTP samples the step and drops the result: it keeps
        only the peak device memory the step took (``NormalEngine.cc:332-397``). Without
        ``warm_up_with_loss`` (false by default) the prefill's post-layers take its last token, as any prefill's."""
        n = self.max_seq_len - 1
        ids = torch.randint(0, self.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        if role_type == "DECODE":  # decodeWarmUp: a 5-block cache, fakeInitKVBlock (zero block ids)
            kv, _ = allocate_kv_cache(self.config, 5, self.block_size, kernel_seq_size_per_block, self.device)
            self.ratio = self.block_size // kv.get_kernel_seq_size_per_block(kv.group_tags[0])
            self._initialize(kv, is_decode_role=True)
            rows = self.max_generate_batch_size
            blocks = [[0] * -(-n // self.block_size)] * rows
            hidden = self._eager(self._decode_inputs(ids[:rows], [n] * rows, [n - 1] * rows, blocks))
            self._post_layers(hidden)
        else:  # prefillWarmUp: an executor without a cache layout
            self._initialize(None)
            hidden = self._eager(self._prefill_inputs([ids], [0], None))
            self._post_layers(hidden[-1:])
        return hidden

    # --- ranks: what RTP's C++ does over the process groups collective_torch created ----------------------
    def _sync_block_num(self, num_blocks):
        """``KVCacheManager::allocateAndSync``: every rank's block count all-gathered over DP_AND_TP, the least."""
        if self.parallelism_config.world_size == 1:
            return num_blocks
        return int(collective_torch.all_gather(torch.tensor([num_blocks], device=self.device), Group.DP_AND_TP).min())

    def _tp_sync_inputs(self, inputs):
        """``tpSyncModelInputs``: TP rank 0's step inputs (here the token ids) broadcast to the TP group."""
        pc = self.parallelism_config
        if pc.tp_size > 1:
            collective_torch.broadcast(inputs.input_ids, pc.dp_rank * pc.tp_size, Group.TP)
        return inputs

    def _tp_sync_logits(self, logits):
        """``PyWrappedModel::tpSyncEmbeddingOrLogits``: each rank's [rows, V/tp] logits all-gathered, laid out
        [tp, rows, V/tp] and transposed to [rows, tp * V/tp] (rank order along the vocabulary)."""
        tp = self.parallelism_config.tp_size
        if tp == 1:
            return logits
        rows, cols = logits.shape
        gathered = collective_torch.all_gather(logits.contiguous(), Group.TP)
        return gathered.reshape(tp, rows, cols).permute(1, 0, 2).reshape(rows, tp * cols)

    # --- inputs, as NormalModelInputGatherer + PyWrappedModel::buildPyAttentionInputs --------------------------
    def _host(self, values):
        t = torch.tensor(values, dtype=_I32)
        return t.pin_memory() if torch.cuda.is_available() else t

    def _set_tables(self, a, block_lists):
        if block_lists is None:  # no cache: the tables stay undefined
            return
        width = max(1, max(len(b) for b in block_lists))
        phys = self._host([b + [0] * (width - len(b)) for b in block_lists])
        kern = kernel_block_table(phys, self.ratio)
        a.kv_cache_block_id, a.kv_cache_block_id_device = phys, phys.to(self.device)
        a.kv_cache_kernel_block_id, a.kv_cache_kernel_block_id_device = kern, kern.to(self.device)

    def _prefill_inputs(self, token_lists, prefix, block_lists):
        a, dev = PyAttentionInputs(), self.device
        lens = [len(t) for t in token_lists]
        a.is_prefill, a.dtype = True, self.dtype
        a.input_lengths, a.prefix_lengths, a.sequence_lengths = self._host(lens), self._host(prefix), self._host([])
        a.input_lengths_device, a.prefix_lengths_device = a.input_lengths.to(dev), a.prefix_lengths.to(dev)
        a.cu_seqlens = self._host(list(accumulate(lens, initial=0)))
        a.cu_seqlens_device = a.cu_seqlens.to(dev)
        a.cu_kv_seqlens_device = self._host(list(accumulate((n + p for n, p in zip(lens, prefix)), initial=0))).to(dev)
        a.sequence_lengths_plus_1_device = (a.sequence_lengths + 1).to(dev)
        a.total_tokens, a.context_total_kv_length = sum(lens), sum(lens) + sum(prefix)
        self._set_tables(a, block_lists)
        ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=_I32, device=dev)
        return self._tp_sync_inputs(PyModelInputs(input_ids=ids, attention_inputs=a))

    def _decode_inputs(self, ids, input_lengths, seq_lens, block_lists):
        a, dev, b = PyAttentionInputs(), self.device, len(ids)
        a.is_prefill, a.dtype = False, self.dtype
        a.input_lengths, a.prefix_lengths, a.sequence_lengths = (self._host(input_lengths), self._host([]),
                                                                 self._host(seq_lens))
        a.input_lengths_device, a.prefix_lengths_device = a.input_lengths.to(dev), a.prefix_lengths.to(dev)
        a.cu_seqlens = self._host([0] * (b + 1))
        a.cu_seqlens_device, a.cu_kv_seqlens_device = a.cu_seqlens.to(dev), a.cu_seqlens.to(dev)
        a.decode_cu_seqlens = self._host(list(range(b + 1)))
        a.decode_cu_seqlens_device = a.decode_cu_seqlens.to(dev)
        a.sequence_lengths_plus_1_device = (a.sequence_lengths + 1).to(dev)
        self._set_tables(a, block_lists)
        return self._tp_sync_inputs(PyModelInputs(input_ids=torch.tensor(ids, dtype=_I32, device=dev),
                                                  attention_inputs=a))

    # --- steps -----------------------------------------------------------------------------------------
    def _check_hidden(self, hidden, rows):
        want = (rows, self.config.hidden_size)
        if not torch.is_tensor(hidden) or tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            got = (tuple(hidden.shape), hidden.dtype) if torch.is_tensor(hidden) else type(hidden)
            raise RuntimeError(f"forward hidden_states: expected {want} {self.dtype}, got {got}")
        return hidden

    def _eager(self, inputs):
        impl = self.py_model.prepare_fmha_impl(inputs, False)
        return self._check_hidden(self.py_model.forward(inputs, impl).hidden_states, inputs.input_ids.shape[0])

    def _post_layers(self, rows):
        """callForwardPostLayers with skip_final_layernorm: fp32 logits from global_weights' lm_head (at tp > 1
        the rank's vocabulary shard, then gathered), argmax."""
        return self._tp_sync_logits(rows.float() @ self._lm_head_fp32.t()).argmax(dim=-1).tolist()

    def _prefill(self, reqs):
        inputs = self._prefill_inputs([r.prompt[r.prefix_len:] for r in reqs], [r.prefix_len for r in reqs],
                                      [r.blocks for r in reqs])
        hidden = self._eager(inputs)
        self.prefill_steps += 1
        last = (inputs.attention_inputs.cu_seqlens[1:] - 1).long().to(hidden.device)
        return self._post_layers(hidden[last])

    def _decode(self, reqs):
        live = self._decode_inputs([r.tokens[-1] for r in reqs], [len(r.prompt) for r in reqs],
                                   [len(r.tokens) - 1 for r in reqs], [r.blocks for r in reqs])
        if self.graph_runner is not None and self.graph_runner.can_run(len(reqs)):
            hidden = self._check_hidden(self.graph_runner.forward(live), len(reqs))
            self.graph_replays += 1
        else:
            hidden = self._eager(live)
            self.eager_decode_steps += 1
        return self._post_layers(hidden)

    def _grow(self, req, n_tokens):
        while len(req.blocks) * self.block_size < n_tokens:
            req.blocks.append(self.block_manager.alloc())

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
    """An Engine from launch settings (``parse_args``); ``overrides`` are Engine keyword arguments."""
    args = parse_args(argv, dict(os.environ if env is None else env))
    load_external_model_packages(args["external_model_packages"])  # setup_default_args, before type inference
    ckpt = overrides.pop("ckpt_path", None) or args["checkpoint_path"]
    if not ckpt:
        raise ValueError("CHECKPOINT_PATH is not set")
    return Engine(ckpt, **engine_kwargs(args, **overrides))


def engine_kwargs(args, **overrides):
    """The Engine keyword arguments of launch settings (``parse_args``), ``overrides`` last."""
    sizes = tuple(int(x) for x in args["decode_capture_config"].split(",") if x.strip())
    kwargs = dict(external_model_packages=args["external_model_packages"], model_type=args["model_type"],
                  act_type=args["act_type"], fp8_kv_cache=args["fp8_kv_cache"],
                  enable_cuda_graph=args["enable_cuda_graph"], seq_size_per_block=args["seq_size_per_block"],
                  kernel_seq_size_per_block=args["kernel_seq_size_per_block"], decode_capture_batch_sizes=sizes,
                  max_generate_batch_size=args["concurrency_limit"] if not sizes else None,
                  max_seq_len=args["max_seq_len"], warm_up=args["warm_up"], role_type=args["role_type"])
    if args["test_block_num"]:
        kwargs["num_blocks"] = args["test_block_num"]
    kwargs.update(overrides)
    return kwargs


# --- several ranks: start_backend_server.multi_rank_start + BackendManager.start ------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_parallelism_config(world_rank, tp_size=1, dp_size=1, ep_size=0, fields=None):
    """A rank's ParallelismConfig as RTP derives it (``set_parallelism_config``; ``ep_size`` 0 is EP_SIZE unset).
    ``fields`` are set afterwards: configs RTP's own asserts stop (ep_size=3) or its arguments never set
    (pp_size), to test the model's refusal of them."""
    pc = ParallelismConfig()
    pc.tp_size, pc.dp_size, pc.ep_size, pc.world_size = tp_size, dp_size, ep_size, tp_size * dp_size
    set_parallelism_config(pc, world_rank)
    for name, value in (fields or {}).items():
        setattr(pc, name, value)
    return pc


def _rank_start(world_rank, tp_size, dp_size, port, backend, job, args, results):
    torch.set_num_threads(1)
    report = (world_rank, "ok", None)
    try:
        pc = rank_parallelism_config(world_rank, tp_size, dp_size)
        if backend == "nccl":  # local_rank_start: torch.cuda.set_device(local_rank)
            torch.cuda.set_device(pc.local_rank)
        collective_torch.init_distributed_environment(pc, NcclCommConfig("127.0.0.1"), port, backend=backend)
        report = (world_rank, "ok", job(world_rank, tp_size, dp_size, *args))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the test
        report = (world_rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    finally:
        results.put(pickle.dumps(report))
        collective_torch.destroy_distributed_environment()


def multi_rank_start(tp_size, dp_size, job, *args, backend="gloo", timeout=900):
    """``tp_size * dp_size`` spawned rank processes, each with its RTP process groups (``backend``), running
    ``job(world_rank, tp_size, dp_size, *args)``; the values in rank order. RuntimeError if a rank fails outside
    ``job``'s own reports, or if the ranks do not all finish within ``timeout`` seconds (a hang)."""
    world = tp_size * dp_size
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_start, args=(r, tp_size, dp_size, port, backend, job, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(world):
            rank, status, value = pickle.loads(results.get(timeout=timeout))
            reports[rank] = (status, value)
    except queue_module.Empty:
        raise RuntimeError(f"ranks {sorted(set(range(world)) - set(reports))} did not finish in {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    failed = {r: v for r, (status, v) in reports.items() if status != "ok"}
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return [reports[r][1] for r in range(world)]


def generate_on_rank(world_rank, tp_size, dp_size, ckpt_paths, runs):
    """One rank's Engines in turn, one per run: ``dict(ckpt=key of ckpt_paths, ep_size=0 | 1, fields={...},
    engine={Engine kwargs}, requests=[(prompts, max_new_tokens, reuse_prefix)])``. Each run gives ``("ok",
    {tokens, lm_head})`` or, where the Engine raised, ``("error", "Type: message")``; the next run goes on."""
    out = []
    for run in runs:
        pc = rank_parallelism_config(world_rank, tp_size, dp_size, run.get("ep_size", 0), run.get("fields"))
        try:
            engine = Engine(ckpt_paths[run.get("ckpt", "default")], parallelism_config=pc, **run.get("engine", {}))
        except Exception as err:  # noqa: BLE001 - the run's outcome, compared by the test
            out.append(("error", f"{type(err).__name__}: {err}"))
            continue
        tokens = [engine.generate(p, n, reuse_prefix=reuse) for p, n, reuse in run.get("requests", ())]
        out.append(("ok", dict(tokens=tokens, lm_head=engine.lm_head.detach().clone())))
    return out
