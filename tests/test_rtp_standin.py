"""The RTP-LLM test stand-in (tests/rtp_standin/rtp_llm) behaves as the contract says: registry, package
loading, cache allocation, block tables, and the engine loop (eager and CPU-emulated CUDA graphs, prefix
reuse) around a tiny dummy model whose output depends on the KV cache it wrote.

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

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rtp_standin")
V, H = 48, 16


def _rtp_names():
    return [k for k in sys.modules if k == "rtp_llm" or k.startswith("rtp_llm.")]


def _dummy_model_classes(rtp):
    """A 1-layer model: h_t = mean(emb[tok_0..t]) - emb[tok_t] / 2, the mean read back from the paged cache."""

    class Impl:
        def __init__(self, is_cuda_graph):
            self.is_cuda_graph = is_cuda_graph
            self.prepared = 0

        def prepare_cuda_graph(self, attention_inputs):
            self.prepared += 1

    class DummyPy(rtp.GptModelBase):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.emb = self.weight.global_weights["embedding"]
            self.init_args, self.impls, self.prefix_seen = [], [], []

        def initialize(self, init_resource):
            self.init_args.append(init_resource.kv_cache)
            return super().initialize(init_resource)

        def prepare_fmha_impl(self, inputs, is_cuda_graph=False):
            self.impls.append(Impl(is_cuda_graph))
            return self.impls[-1]

        def forward(self, inputs, fmha_impl=None):
            a = inputs.attention_inputs
            layer = self.kv_cache.get_layer_cache(0)
            kbs = layer.seq_size_per_block
            flat = layer.kv_cache_base.view(-1, layer.kv_cache_base.shape[-1])
            table = a.kv_cache_kernel_block_id_device.long()
            if a.is_prefill:  # host metadata is fine here: prefill is never captured
                lens, prefix = a.input_lengths.tolist(), a.prefix_lengths.tolist()
                self.prefix_seen.append(prefix)
                pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
                req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
                pos, req = pos.to(table.device), req.to(table.device)
            else:  # device tensors only, no host sync
                pos = a.sequence_lengths_plus_1_device.long() - 1
                req = torch.arange(table.shape[0], device=table.device)
            x = self.emb[inputs.input_ids.long()]
            flat[table[req, pos // kbs] * kbs + pos % kbs, :H] = x
            allpos = torch.arange(table.shape[1] * kbs, device=table.device)
            ctx = flat[table[req][:, allpos // kbs] * kbs + allpos % kbs, :H]
            keep = (allpos[None, :] <= pos[:, None]).unsqueeze(-1)
            mean = torch.where(keep, ctx, torch.zeros_like(ctx)).sum(1) / (pos + 1).unsqueeze(-1).to(ctx.dtype)
            return rtp.PyModelOutputs(mean - x / 2)

    class Dummy(rtp.BaseModel):
        @classmethod
        def _create_config(cls, ckpt_path):
            with open(os.path.join(ckpt_path, "config.json")) as f:
                hf = json.load(f)
            c = rtp.ModelConfig()
            c.num_layers, c.hidden_size, c.vocab_size = 1, H, V
            c.max_seq_len = hf["max_position_embeddings"]
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
            dtype = self.model_config.data_type
            w = rtp.ModelWeights(1, "cpu", dtype)
            emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)).to(dtype)
            w.set_global_weight("embedding", emb)
            w.set_global_weight("lm_head", emb)
            w.set_global_weight("final_layernorm.gamma", torch.ones(H, dtype=dtype))
            self.weight, self.weight_manager, self.py_eplb = w, None, None
            if not skip_python_model:
                self._create_python_model()

        def _create_python_model(self):
            self.py_model = DummyPy(self.model_config, self.parallelism_config, self.weight,
                                    self.max_generate_batch_size)

    class NoGraph(Dummy):
        def support_cuda_graph(self):
            return False

    return Dummy, NoGraph


@pytest.fixture(scope="module")
def rtp():
    saved = {k: sys.modules.pop(k) for k in _rtp_names()}
    sys.path.insert(0, STANDIN)
    try:
        ns = types.SimpleNamespace()
        for mod in ("model_factory_register", "config.model_config", "model_loader.model_weight_info",
                    "models.base_model", "models_py.model_desc.module_base", "ops.compute_ops",
                    "standin_engine"):
            m = importlib.import_module("rtp_llm." + mod)
            ns.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
        ns.reg = importlib.import_module("rtp_llm.model_factory_register")
        ns.eng = importlib.import_module("rtp_llm.standin_engine")
        ns.Dummy, ns.NoGraph = _dummy_model_classes(ns)
        ns.register_model("dummy_standin", ns.Dummy, ["DummyForCausalLM"])
        ns.register_model("dummy_nograph", ns.NoGraph)
        yield ns
    finally:
        for k in _rtp_names():
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path.remove(STANDIN)


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DummyForCausalLM"], "max_position_embeddings": 64}))
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
    c.num_layers = 2
    c.data_type = torch.bfloat16
    a = c.attn_config
    a.use_mla, a.kv_lora_rank, a.rope_head_dim, a.is_sparse, a.indexer_head_dim = True, 512, 64, sparse, 128
    a.kv_cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return c


def test_registry_conflict_and_same_class_noop(rtp):
    class A(rtp.BaseModel):
        pass

    class B(rtp.BaseModel):
        pass

    rtp.register_model("standin_a", A, ["AForCausalLM"], ["org/a"])
    rtp.register_model("standin_a", A)  # same class: no-op
    assert rtp.reg._model_factory["standin_a"] is A
    assert rtp.reg._hf_architecture_2_ft["AForCausalLM"] == "standin_a"
    assert rtp.reg._hf_repo_2_ft["org/a"] == "standin_a"
    with pytest.raises(Exception, match="already registered"):
        rtp.register_model("standin_a", B)
    assert rtp.reg._model_factory["standin_a"] is A


def test_deepseek_v2_import_binds_glm5(rtp):
    ds = importlib.import_module("rtp_llm.models.deepseek_v2")
    assert rtp.reg._model_factory["glm_5"] is ds.DeepSeekV2
    assert rtp.reg._model_factory["deepseek2"] is ds.DeepSeekV2
    assert rtp.reg._hf_architecture_2_ft["GlmMoeDsaForCausalLM"] == "glm_5"
    assert rtp.reg._hf_architecture_2_ft["DeepseekV3ForCausalLM"] == "deepseek2"
    assert issubclass(ds.DeepSeekV2, rtp.BaseModel)


def test_external_packages_flag_and_env(rtp, tmp_path, monkeypatch):
    ep = rtp.external_packages
    env = {"RTP_LLM_EXTERNAL_MODEL_PACKAGES": "env.pkg"}
    assert ep(["--external_model_packages", "a.b,c.d"], env) == ["a.b", "c.d"]
    assert ep(["x", "--external_model_packages=a.b"], env) == ["a.b"]
    assert ep([], env) == ["env.pkg"]
    assert ep([], {}) == []
    (tmp_path / "standin_plugin_mod.py").write_text(
        "from rtp_llm.model_factory_register import register_model\n"
        "from rtp_llm.models.base_model import BaseModel\n"
        "IMPORTS = globals().get('IMPORTS', 0) + 1\n"
        "class P(BaseModel):\n    pass\n"
        "register_model('standin_plugin', P, ['PForCausalLM'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mods = rtp.load_external_packages([], {"RTP_LLM_EXTERNAL_MODEL_PACKAGES": "standin_plugin_mod,standin_plugin_mod"})
        assert len(mods) == 1 and mods[0].IMPORTS == 1
        assert rtp.reg._model_factory["standin_plugin"] is mods[0].P
    finally:
        sys.modules.pop("standin_plugin_mod", None)


def test_cache_allocator_shapes(rtp):
    kv = rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=False), 4, 64, 16, "cpu")
    assert kv.layer_count == 2 and kv.get_seq_size_per_block() == 64 and kv.get_kernel_seq_size_per_block() == 16
    layer = kv.get_layer_cache(1)
    assert layer.layer_id == 1 and layer.seq_size_per_block == 16
    assert layer.kv_cache_base.shape == (16, 16, 576) and layer.kv_cache_base.dtype == torch.bfloat16
    assert layer.kv_scale_base.shape == (16, 16, 132) and layer.kv_scale_base.dtype == torch.uint8
    fp8 = rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=True), 4, 64, 0, "cpu").get_layer_cache(0)
    assert fp8.kv_cache_base.shape == (4, 64, 656) and fp8.kv_cache_base.dtype == torch.uint8
    assert fp8.seq_size_per_block == 64
    assert rtp.allocate_kv_cache(glm5_like_config(rtp, False, sparse=False), 4, 64, 0, "cpu") \
        .get_layer_cache(0).kv_scale_base is None
    with pytest.raises(ValueError, match="divide"):
        rtp.allocate_kv_cache(glm5_like_config(rtp, fp8=False), 4, 64, 24, "cpu")


def test_kernel_block_ids(rtp):
    phys = torch.tensor([[3, 5, 0], [2, 0, 0]], dtype=torch.int32)
    got = rtp.kernel_block_table(phys, 4)
    assert got.dtype == torch.int32
    assert got.tolist() == [[12, 13, 14, 15, 20, 21, 22, 23, 0, 0, 0, 0], [8, 9, 10, 11] + [0] * 8]


def test_resolve_model_class(rtp, ckpt):
    assert rtp.resolve_model_class(ckpt) is rtp.Dummy
    assert rtp.resolve_model_class(ckpt, "dummy_nograph") is rtp.NoGraph
    with pytest.raises(ValueError, match="not registered"):
        rtp.resolve_model_class(ckpt, "nope")


def test_engine_builds_model_per_contract(rtp, ckpt):
    e = engine(rtp, ckpt, fp8_kv_cache=True, decode_capture_batch_sizes=(1, 2, 4))
    m = e.model
    assert isinstance(m, rtp.Dummy) and not hasattr(m, "some_future_kwarg")
    assert m.model_config.data_type == torch.float32 and m.model_config.ckpt_path == ckpt
    assert m.model_config.attn_config.kv_cache_dtype == torch.float8_e4m3fn
    assert m.parallelism_config.tp_size == 1 and m.parallelism_config.ep_rank == 0
    assert m.hw_kernel_config.enable_cuda_graph is False and m.max_generate_batch_size == 4
    assert e.kv_cache.get_layer_cache(0).kv_cache_base.shape == (32 * 2, 4, 656)
    assert e.init_calls == [e.kv_cache] and e.py_model.kv_cache is e.kv_cache


def test_generate_eager_matches_reference(rtp, ckpt):
    e = engine(rtp, ckpt)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [40, 41, 42, 43, 44, 45, 46, 47, 5]]
    emb = e.model.weight.global_weights["embedding"]
    out = e.generate(prompts, 12)
    assert out == [reference(emb, p, 12) for p in prompts]
    assert len({t for o in out for t in o}) > 3  # the model is not trivially repeating one token
    assert (e.prefill_steps, e.eager_decode_steps, e.graph_replays) == (1, 11, 0)
    assert [i.is_cuda_graph for i in e.py_model.impls] == [False] * 12


def test_generate_cuda_graph_cpu_emulation_matches_eager(rtp, ckpt):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7, 4, 9]]
    eager = engine(rtp, ckpt).generate(prompts, 10)
    e = engine(rtp, ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 2, 4))
    assert e.init_calls == [None, e.kv_cache] and e.py_model.init_args == [None, e.kv_cache]
    assert e.captured_sizes == [4, 2, 1]
    static_impls = {s: g[1] for s, g in e.graphs.items()}
    assert all(i.is_cuda_graph for i in static_impls.values())
    assert e.generate(prompts, 10) == eager
    assert (e.prefill_steps, e.eager_decode_steps, e.graph_replays) == (1, 0, 9)
    assert e.replays_by_size == {4: 9}
    assert static_impls[4].prepared == 9 and static_impls[2].prepared == 0
    # a batch larger than every captured size decodes eagerly
    big = prompts + [[5, 5], [9]]
    assert e.generate(big, 3) == engine(rtp, ckpt).generate(big, 3)
    assert (e.eager_decode_steps, e.graph_replays) == (2, 9)


def test_prefix_reuse(rtp, ckpt):
    e = engine(rtp, ckpt)
    emb = e.model.weight.global_weights["embedding"]
    shared = list(range(20, 37))  # 17 tokens: two full 8-token blocks
    first = e.generate([shared + [1, 2]], 4)
    assert e.py_model.prefix_seen[-1] == [0]
    prompts = [shared + [3], [9, 9, 9], shared[:8]]
    out = e.generate(prompts, 5, reuse_prefix=True)
    assert e.py_model.prefix_seen[-1] == [16, 0, 0]  # the 8-token prompt keeps >= 1 token to compute
    assert out == [reference(emb, p, 5) for p in prompts]
    assert first == [reference(emb, shared + [1, 2], 4)]


def test_errors(rtp, ckpt, tmp_path):
    with pytest.raises(RuntimeError, match="support_cuda_graph"):
        engine(rtp, ckpt, model_type="dummy_nograph", enable_cuda_graph=True)
    e = engine(rtp, ckpt, num_blocks=3)
    with pytest.raises(RuntimeError, match="exhausted"):
        e.generate([list(range(10)), list(range(10))], 2)
    assert sorted(e.block_manager.free) == [1, 2]  # released after the failure
    q = tmp_path / "fp8"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({
        "architectures": ["DummyForCausalLM"], "max_position_embeddings": 64,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert engine(rtp, str(q)).dtype == torch.bfloat16  # ACT_TYPE forced to BF16


def test_launch_from_settings(rtp, ckpt):
    env = {"CHECKPOINT_PATH": ckpt, "MODEL_TYPE": "dummy_standin", "ACT_TYPE": "FP32", "ENABLE_CUDA_GRAPH": "1",
           "DECODE_CAPTURE_CONFIG": "1,2", "SEQ_SIZE_PER_BLOCK": "8", "KERNEL_SEQ_SIZE_PER_BLOCK": "4",
           "LOAD_PYTHON_MODEL": "1", "FP8_KV_CACHE": "0"}
    e = rtp.launch(["--external_model_packages", "rtp_llm.models.deepseek_v2"], env, num_blocks=16)
    assert e.captured_sizes == [2, 1] and e.ratio == 2 and e.dtype == torch.float32
    assert "rtp_llm.models.deepseek_v2" in sys.modules
    assert e.generate([[1, 2, 3]], 3) == [reference(e.lm_head, [1, 2, 3], 3)]
