"""The RTP-LLM test stand-in (tests/rtp_standin/rtp_llm) behaves as RTP-LLM's source does (rtp-llm 4b8d39cd5,
PR #1266; /work/shared/reference/rtp_llm_audit.md): types and enums, package loading, registry, cache layout
and tagged queries, the lifecycle (from_config -> load, warm-ups, initialize order), the CUDA-graph capture
and replay refresh, around a tiny dummy model whose output depends on the KV cache it wrote.

``rtp_llm`` is imported only inside the module-scoped fixture and removed from sys.modules / sys.path
afterwards, so other tests see no ``rtp_llm`` (as on a machine without RTP-LLM).
"""

import importlib
import json
import os
import sys
import types

import pytest
import torch

STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rtp_standin")
V, H = 48, 16


def _rtp_names():
    return [k for k in sys.modules if k == "rtp_llm" or k.startswith("rtp_llm.")]


def _dummy_model_classes(rtp):
    """A 1-layer model: h_t = mean(emb[tok_0..t]) - emb[tok_t] / 2, the mean read back from the paged cache."""

    class Impl:
        def __init__(self, is_cuda_graph):
            self.is_cuda_graph, self.prepared = is_cuda_graph, 0

        def prepare_cuda_graph(self, attention_inputs):
            self.prepared += 1

    class DummyPy(rtp.GptModelBase):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.emb = self.weight.global_weights["embedding"]
            self.init_args, self.impls, self.steps = [], [], []

        def initialize(self, init_resource):
            self.init_args.append(init_resource.kv_cache)
            return super().initialize(init_resource)

        def prepare_fmha_impl(self, inputs, is_cuda_graph=False):
            self.impls.append(Impl(is_cuda_graph))
            return self.impls[-1]

        def forward(self, inputs, fmha_impl=None):
            a = inputs.attention_inputs
            self.steps.append(dict(tokens=inputs.input_ids.shape[0], prefill=a.is_prefill, graph=a.is_cuda_graph,
                                   table=a.kv_cache_kernel_block_id, flag=os.environ.get(
                                       "RTP_LLM_CUDA_GRAPH_WARMUP_FORWARD"),
                                   prefix=None if a.prefix_lengths is None else a.prefix_lengths.tolist()))
            x = self.emb[inputs.input_ids.long()]
            if self.kv_cache is None:  # a warm-up executor without a cache
                return rtp.PyModelOutputs(torch.zeros_like(x))
            layer = self.kv_cache.get_layer_cache(0)
            kbs = layer.seq_size_per_block
            flat = layer.kv_cache_base.view(-1, layer.kv_cache_base.shape[-1])
            table = a.kv_cache_kernel_block_id_device.long()
            if a.is_prefill:  # host metadata is fine here: prefill is never captured
                lens, prefix = a.input_lengths.tolist(), a.prefix_lengths.tolist()
                pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
                req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
            else:  # device tensors only, no host sync
                pos = a.sequence_lengths_plus_1_device.long() - 1
                req = torch.arange(table.shape[0])
            flat[table[req, pos // kbs] * kbs + pos % kbs, :H] = x
            allpos = torch.arange(table.shape[1] * kbs)
            ctx = flat[table[req][:, allpos // kbs] * kbs + allpos % kbs, :H]
            keep = (allpos[None, :] <= pos[:, None]).unsqueeze(-1)
            mean = torch.where(keep, ctx, torch.zeros_like(ctx)).sum(1) / (pos + 1).unsqueeze(-1).to(ctx.dtype)
            return rtp.PyModelOutputs(mean - x / 2)

    class Dummy(rtp.BaseModel):
        loads = 0

        @classmethod
        def _create_config(cls, ckpt_path):
            with open(os.path.join(ckpt_path, "config.json")) as f:
                hf = json.load(f)
            c = rtp.ModelConfig()
            c.num_layers, c.hidden_size, c.vocab_size = 1, H, V
            c.max_seq_len = hf.get("max_seq_len", 0)
            a = c.attn_config
            a.use_mla, a.kv_lora_rank, a.rope_head_dim = True, 512, 64
            a.is_sparse, a.indexer_head_dim = True, 128
            return c

        @staticmethod
        def get_weight_cls():
            return rtp.ModelDeployWeightInfo

        def support_cuda_graph(self):
            return True

        def load(self, skip_python_model=False):
            type(self).loads += 1
            dtype = self.model_config.compute_dtype
            w = rtp.ModelWeights(1, "cpu", dtype)
            emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)).to(dtype)
            w.set_global_weight("embedding", emb)
            w.set_global_weight("lm_head", emb)
            self.weight, self.model_weights_loader = w, "loader"
            if not skip_python_model:
                self.py_model = DummyPy(self.model_config, self.parallelism_config, self.weight,
                                        self.max_generate_batch_size)

    class NoLoader(Dummy):
        def load(self, skip_python_model=False):
            super().load(skip_python_model)
            del self.model_weights_loader

    class RtpLoad(Dummy):
        """Keeps BaseModel.load, where RTP checks support_cuda_graph()."""
        load = rtp.BaseModel.load

        def support_cuda_graph(self):
            return False

    return Dummy, NoLoader, RtpLoad


@pytest.fixture(scope="module")
def rtp():
    saved = {k: sys.modules.pop(k) for k in _rtp_names()}
    sys.path.insert(0, STANDIN)
    try:
        ns = types.SimpleNamespace()
        for mod in ("ops", "model_factory_register", "config.model_config", "model_loader.model_weight_info",
                    "models.base_model", "models_py.model_desc.module_base", "ops.compute_ops", "standin_cache",
                    "utils.import_util", "standin_engine"):
            m = importlib.import_module("rtp_llm." + mod)
            ns.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
        ns.reg = importlib.import_module("rtp_llm.model_factory_register")
        ns.Dummy, ns.NoLoader, ns.RtpLoad = _dummy_model_classes(ns)
        ns.register_model("dummy_standin", ns.Dummy, ["DummyForCausalLM"])
        ns.register_model("dummy_noloader", ns.NoLoader)
        ns.register_model("dummy_rtpload", ns.RtpLoad)
        yield ns
    finally:
        for k in _rtp_names():
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path.remove(STANDIN)


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DummyForCausalLM"], "max_seq_len": 64}))
    return str(tmp_path)


def reference(emb, prompt, n):
    """Greedy generation of the dummy model without any cache."""
    toks = list(prompt)
    for _ in range(n):
        x = emb[torch.tensor(toks)]
        h = x.sum(0) / len(toks) - x[-1] / 2
        toks.append(int((h.float() @ emb.float().t()).argmax()))
    return toks[len(prompt):]


def engine(rtp, ckpt, **kw):
    kw = {"act_type": "FP32", "seq_size_per_block": 8, "kernel_seq_size_per_block": 4, "num_blocks": 32, **kw}
    return rtp.Engine(ckpt, **kw)


def glm5_like_config(rtp, fp8, sparse=True):
    c = rtp.ModelConfig()
    c.num_layers, c.data_type = 2, "bf16"
    a = c.attn_config
    a.use_mla, a.kv_lora_rank, a.rope_head_dim, a.is_sparse, a.indexer_head_dim = True, 512, 64, sparse, 128
    a.kv_cache_dtype = rtp.KvCacheDataType.FP8 if fp8 else rtp.KvCacheDataType.BASE
    return c


def test_registry_conflicts_and_lazy_builtins(rtp):
    class A(rtp.BaseModel):
        pass

    class B(rtp.BaseModel):
        pass

    rtp.register_model("standin_a", A, ["AForCausalLM"], ["org/a"])
    rtp.register_model("standin_a", A)  # same class: no-op
    assert rtp.reg._hf_architecture_2_ft["AForCausalLM"] == "standin_a" and rtp.reg._hf_repo_2_ft["org/a"] == "standin_a"
    with pytest.raises(Exception, match="confict"):
        rtp.register_model("standin_a", B)
    with pytest.raises(Exception, match="confict"):
        rtp.register_model("standin_b", B, ["AForCausalLM"])
    assert "rtp_llm.models.deepseek_v2" not in sys.modules  # built-ins are lazy
    ds = rtp.ensure_model_registered("glm_5")
    assert ds.__module__ == "rtp_llm.models.deepseek_v2" and rtp.reg._model_factory["deepseek2"] is ds
    with pytest.raises(KeyError, match=r"model type \[nope\] is not registered"):
        rtp.ensure_model_registered("nope")


def test_external_packages_come_from_the_cli_flag_only(rtp, tmp_path, monkeypatch):
    pa = rtp.parse_args
    env = {"RTP_LLM_EXTERNAL_MODEL_PACKAGES": "env.pkg", "EXTERNAL_MODEL_PACKAGES": "env.pkg"}
    assert pa([], env)["external_model_packages"] is None
    assert pa(["--external_model_packages", " a.b, c.d,,a.b"], env)["external_model_packages"] == ["a.b", "c.d"]
    assert pa(["--external_model_packages=a.b", "--external_model_packages", "x"], {})["external_model_packages"] == ["x"]
    with pytest.raises(SystemExit):
        pa(["--external_model_packages", "a.1b"], {})
    (tmp_path / "standin_plugin_mod.py").write_text(
        "from rtp_llm.model_factory_register import register_model\n"
        "from rtp_llm.models.base_model import BaseModel\n"
        "class P(BaseModel):\n    pass\n"
        "register_model('standin_plugin', P, ['PForCausalLM'])\n")
    (tmp_path / "standin_broken_mod.py").write_text("raise ValueError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="Failed to import external model package 'standin_broken_mod'") as e:
            rtp.load_external_model_packages(["standin_plugin_mod", "standin_broken_mod"])
        assert isinstance(e.value.__cause__, ValueError)
        assert rtp.reg._model_factory["standin_plugin"].__module__ == "standin_plugin_mod"
        # every spawned rank imports the package itself
        argv = ["--external_model_packages", "standin_plugin_mod", "--model_type", "standin_plugin"]
        assert rtp.rank_model_classes(argv, {}, 2) == ["standin_plugin_mod.P"] * 2
        with pytest.raises(RuntimeError, match="exited"):
            rtp.rank_model_classes(["--model_type", "standin_plugin"], {}, 1)
    finally:
        sys.modules.pop("standin_plugin_mod", None)


def test_config_enums_and_fields(rtp):
    c = rtp.ModelConfig()
    c.data_type = "bf16"
    assert c.data_type is rtp.DataType.TYPE_BF16 and str(c.data_type) == "DataType.TYPE_BF16"
    assert c.compute_dtype is torch.bfloat16
    with pytest.raises(TypeError):
        c.data_type = torch.bfloat16
    with pytest.raises(AttributeError):
        c.no_such_field = 1
    assert c.attn_config.kv_cache_dtype is rtp.KvCacheDataType.BASE and c.attn_config.rope_config.style == 1
    a = rtp.PyAttentionInputs()
    assert a.kv_cache_block_id is None and a.sequence_lengths is None and a.is_prefill is False
    with pytest.raises(AttributeError):
        a.no_such_field = 1
    res = rtp.PyModelInitResources()
    assert res.kv_cache is None
    with pytest.raises(AttributeError):
        res.kv_cache = 1


def test_cache_layout_and_tagged_queries(rtp):
    kv, pools = rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=False), 4, 64, 16, "cpu")
    assert kv.layer_count == 2 and kv.group_tags == ["default"]
    assert kv.get_seq_size_per_block("default") == 64 and kv.get_kernel_seq_size_per_block("default") == 16
    with pytest.raises(TypeError):
        kv.get_seq_size_per_block()
    with pytest.raises(RuntimeError, match="tag"):
        kv.get_kernel_seq_size_per_block("other")
    layer = kv.get_layer_cache(1, "default")
    assert (layer.layer_id, layer.group_id, layer.tag, layer.seq_size_per_block) == (1, 0, "default", 16)
    assert layer.kv_cache_base.shape == (16, 16, 576) and layer.kv_cache_base.dtype == torch.bfloat16
    assert layer.kv_scale_base.shape == (16, 16, 132) and layer.kv_scale_base.dtype == torch.uint8
    assert layer.kv_cache_base.data_ptr() == pools[0][1].data_ptr()  # one pool, sliced per layer
    assert [g.layer_id for g in kv.get_layer_cache_groups(0)] == [0]
    fp8 = rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=True), 4, 64, 0, "cpu")[0].get_layer_cache(0)
    assert fp8.kv_cache_base.shape == (4, 64, 656) and fp8.kv_cache_base.dtype == torch.float8_e4m3fn
    assert rtp.allocate_kv_cache(glm5_like_config(rtp, False, sparse=False), 4, 64, 0, "cpu")[0] \
        .get_layer_cache(0).kv_scale_base is None
    lc = rtp.LayerKVCache(torch.zeros(1), 8, 3, 0, "t", None)
    assert (lc.seq_size_per_block, lc.layer_id, lc.tag, lc.kv_scale_base) == (8, 3, "t", None)
    with pytest.raises(ValueError, match="divide"):
        rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=False), 4, 64, 24, "cpu")


def test_kernel_block_ids(rtp):
    phys = torch.tensor([[3, 5, 0], [2, 0, 0]], dtype=torch.int32)
    got = rtp.kernel_block_table(phys, 4)
    assert got.dtype == torch.int32
    assert got.tolist() == [[12, 13, 14, 15, 20, 21, 22, 23, 0, 0, 0, 0], [8, 9, 10, 11] + [0] * 8]


def test_lifecycle_load_warm_ups_and_initialize_order(rtp, ckpt, tmp_path):
    loads = rtp.Dummy.loads
    e = engine(rtp, ckpt, fp8_kv_cache=True, decode_capture_batch_sizes=(1, 2, 4))
    assert rtp.Dummy.loads == loads + 1  # from_config called load()
    m = e.model
    assert m.model_config.data_type is rtp.DataType.TYPE_FP32 and m.model_config.ckpt_path == ckpt
    assert m.model_config.attn_config.kv_cache_dtype is rtp.KvCacheDataType.FP8
    assert m.max_generate_batch_size == 4 and e.model_weights_loader == "loader"
    assert e.kv_cache.get_layer_cache(0).kv_cache_base.shape == (32 * 2, 4, 656)
    # PDFUSION: a max_seq_len - 1 token prefill without a cache (tables unset), then initialize(kv)
    assert e.init_calls == [None, e.kv_cache] and e.py_model.init_args == [None, e.kv_cache]
    warm = e.py_model.steps[0]
    assert (warm["tokens"], warm["prefill"], warm["table"]) == (63, True, None)
    d = engine(rtp, ckpt, role_type="DECODE", max_generate_batch_size=3)
    five = d.init_calls[0]
    assert five.get_layer_cache(0).kv_cache_base.shape[0] == 5 * 2 and d.init_calls[1:] == [d.kv_cache]
    step = d.py_model.steps[0]
    assert (step["tokens"], step["prefill"], int(step["table"].abs().sum())) == (3, False, 0)
    assert engine(rtp, ckpt, max_seq_len=40, warm_up=False).max_seq_len == 40
    (tmp_path / "nolen").mkdir()
    (tmp_path / "nolen" / "config.json").write_text(json.dumps({"architectures": ["DummyForCausalLM"]}))
    assert engine(rtp, str(tmp_path / "nolen"), warm_up=False).max_seq_len == 8192  # neither model nor MAX_SEQ_LEN set it
    with pytest.raises(AttributeError, match="model_weights_loader"):
        engine(rtp, ckpt, model_type="dummy_noloader")
    with pytest.raises(Exception, match="can't support cuda graph"):
        engine(rtp, ckpt, model_type="dummy_rtpload", enable_cuda_graph=True)
    with pytest.raises(NotImplementedError, match="weight loader"):
        engine(rtp, ckpt, model_type="dummy_rtpload")


def test_generate_eager_matches_reference(rtp, ckpt):
    e = engine(rtp, ckpt)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [40, 41, 42, 43, 44, 45, 46, 47, 5]]
    emb = e.model.weight.global_weights["embedding"]
    out = e.generate(prompts, 12)
    assert out == [reference(emb, p, 12) for p in prompts]
    assert len({t for o in out for t in o}) > 3  # the model is not trivially repeating one token
    assert (e.prefill_steps, e.eager_decode_steps, e.graph_replays) == (1, 11, 0)


def test_cuda_graph_capture_sequence_and_replay_refresh(rtp, ckpt):
    e = engine(rtp, ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4))
    g = e.graph_runner
    assert e.init_calls == [None, e.kv_cache, e.kv_cache] and g.captured_sizes == [4, 1]
    capture = e.py_model.steps[1:]  # after the prefill warm-up
    # one max-batch forward under the warm-up flag, then per size (largest first) two forwards, capture, replay
    assert [(s["tokens"], s["flag"]) for s in capture] == [(4, "1")] + [(4, None)] * 4 + [(1, None)] * 4
    full, four = g.instances[4].inputs.attention_inputs, g.instances[1].inputs.attention_inputs
    assert four.sequence_lengths.data_ptr() == full.sequence_lengths.data_ptr()  # slices of one buffer
    assert full.kv_cache_block_id is None and full.kv_cache_block_id_device is None
    first = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7, 4, 9]]
    second = [[5, 5, 5], [9, 8]]
    emb = e.model.weight.global_weights["embedding"]
    assert e.generate(first, 6) == [reference(emb, p, 6) for p in first]
    stale = full.kv_cache_kernel_block_id[2].clone()
    assert e.generate(second, 6) == [reference(emb, p, 6) for p in second]
    # device table zeroed past the batch; host table and input_lengths keep the 3-request batch's row 2
    assert not full.kv_cache_kernel_block_id_device[2].any() and torch.equal(full.kv_cache_kernel_block_id[2], stale)
    assert stale[0] != 0 and full.sequence_lengths[2:].tolist() == [0, 0] and full.input_lengths[2] == len(first[2])
    assert g.replays_by_size == {4: 10} and g.instances[4].impl.prepared == 10 and e.eager_decode_steps == 0
    big = first + second  # a batch larger than every captured size decodes eagerly
    assert e.generate(big, 3) == [reference(emb, p, 3) for p in big] and e.eager_decode_steps == 2


def test_prefix_reuse(rtp, ckpt):
    e = engine(rtp, ckpt)
    emb = e.model.weight.global_weights["embedding"]
    shared = list(range(20, 37))  # 17 tokens: two full 8-token blocks
    first = e.generate([shared + [1, 2]], 4)
    assert e.py_model.steps[-4]["prefix"] == [0]
    prompts = [shared + [3], [9, 9, 9], shared[:8]]
    out = e.generate(prompts, 5, reuse_prefix=True)
    assert e.py_model.steps[-5]["prefix"] == [16, 0, 0]  # the 8-token prompt keeps >= 1 token to compute
    assert out == [reference(emb, p, 5) for p in prompts]
    assert first == [reference(emb, shared + [1, 2], 4)]


def test_errors_and_precision(rtp, ckpt, tmp_path):
    e = engine(rtp, ckpt, num_blocks=3)
    with pytest.raises(RuntimeError, match="exhausted"):
        e.generate([list(range(10)), list(range(10))], 2)
    assert sorted(e.block_manager.free) == [1, 2]  # released after the failure
    q = tmp_path / "fp8"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({
        "architectures": ["DummyForCausalLM"], "max_seq_len": 64,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert engine(rtp, str(q)).dtype == torch.bfloat16  # ACT_TYPE forced to BF16
    assert engine(rtp, ckpt, act_type=None).dtype == torch.float16  # no ACT_TYPE, no config_dtype


def test_launch_from_settings(rtp, ckpt):
    env = {"CHECKPOINT_PATH": ckpt, "MODEL_TYPE": "dummy_standin", "ACT_TYPE": "FP32", "ENABLE_CUDA_GRAPH": "1",
           "DECODE_CAPTURE_CONFIG": "1,2", "SEQ_SIZE_PER_BLOCK": "8", "KERNEL_SEQ_SIZE_PER_BLOCK": "4",
           "FP8_KV_CACHE": "0", "MAX_SEQ_LEN": "48", "TEST_BLOCK_NUM": "16"}
    e = rtp.launch(["--external_model_packages", "rtp_llm.models.deepseek_v2"], env)
    assert e.graph_runner.captured_sizes == [2, 1] and e.ratio == 2 and e.dtype == torch.float32
    assert e.max_seq_len == 48 and e.block_manager.free == list(range(1, 16))
    assert "rtp_llm.models.deepseek_v2" in sys.modules
    assert e.generate([[1, 2, 3]], 3) == [reference(e.lm_head, [1, 2, 3], 3)]


def test_server_arguments_and_the_propose_config_as_rtp_reads_them(rtp, ckpt, monkeypatch):
    """``setup_args`` parses strictly (stock main has no ``--external_model_packages``; #1266 adds it, flag only);
    ``create_propose_model_config`` gives no draft without a known SP_TYPE or without a draft checkpoint, refuses a
    type the learned-draft engine does not run, and reads the draft's config with the target's max_seq_len;
    an Engine started around a loaded model refuses settings the model was not built with."""
    from rtp_llm.model_factory import ModelFactory
    from rtp_llm.server.server_args.server_args import setup_args

    monkeypatch.delenv("RTP_STANDIN_PR1266", raising=False)
    base = ["--checkpoint_path", ckpt, "--model_type", "dummy_standin", "--act_type", "FP32"]
    with pytest.raises(SystemExit) as exit_:
        setup_args(base + ["--external_model_packages", "rtp_llm.models.deepseek_v2"])
    assert exit_.value.code == 2
    monkeypatch.setenv("EXTERNAL_MODEL_PACKAGES", "rtp_llm.models.deepseek_v2")  # #1266: enable_env=False
    monkeypatch.setenv("RTP_STANDIN_PR1266", "1")
    assert setup_args(base).args["external_model_packages"] is None
    assert setup_args(base + ["--external_model_packages", "a.b,a.b"]).args["external_model_packages"] == ["a.b"]
    monkeypatch.delenv("RTP_STANDIN_PR1266")

    def propose(*extra):
        configs = setup_args(base + list(extra))
        _, target = ModelFactory.create_model_config(configs)
        return target, ModelFactory.create_propose_model_config(configs, target)

    assert propose()[1] is None
    assert propose("--sp_type", "MTP", "--sp_model_type", "dummy_standin", "--sp_checkpoint_path", ckpt)[1] is None
    assert propose("--sp_type", "mtp", "--sp_model_type", "dummy_standin")[1] is None  # no draft checkpoint
    with pytest.raises(ValueError, match="only supports MTP, EAGLE and DSpARK, but got VANILLA"):
        propose("--sp_type", "vanilla", "--sp_model_type", "dummy_standin", "--sp_checkpoint_path", ckpt)
    target, (cls, draft) = propose("--sp_type", "mtp", "--sp_model_type", "dummy_standin", "--sp_checkpoint_path",
                                   ckpt, "--max_seq_len", "40")
    assert cls is rtp.Dummy and draft.max_seq_len == target.max_seq_len == 40 and draft.model_type == "dummy_standin"
    model = rtp.create_model(rtp.Dummy, target, rtp.ParallelismConfig(), rtp.HWKernelConfig(False, (1,)), 4)
    with pytest.raises(ValueError, match=r"\(enable_cuda_graph, seq_size_per_block\) = \(True, 64\): the model "
                                         r"was built with \(False, 64\)"):
        rtp.Engine(ckpt, model=model, enable_cuda_graph=True)
