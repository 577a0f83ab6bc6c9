"""The RTP-LLM plugin (``fxglm5.rtpllm.models``) driven by a stand-in of RTP-LLM (tests/rtp_standin, written
from /work/shared/reference/rtp_llm_contract.md; RTP-LLM itself is not installable here).

What a user of the plugin relies on: importing it without RTP does nothing; with RTP it takes ``glm_5`` over;
the config sizes RTP's cache; an RTP engine loop (prefill, eager or CUDA-graph decode, prefix reuse, kernel
blocks smaller than the physical ones, bf16 or FP8 caches) produces the tokens fxglm5's own runtime produces
on the same checkpoint; bad inputs fail with errors naming the field, before anything is written.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxglm5.errors import ConfigError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner

STANDIN = Path(__file__).parent / "rtp_standin"
PLUGIN = "fxglm5.rtpllm.models"


def _forget_rtp() -> None:
    for name in list(sys.modules):
        if name == "rtp_llm" or name.startswith("rtp_llm.") or name in (PLUGIN, "fxglm5.rtpllm.glm5"):
            del sys.modules[name]


@pytest.fixture
def rtp(monkeypatch):
    """The stand-in ``rtp_llm`` on the path, fresh registries, the plugin loaded as RTP loads it."""
    _forget_rtp()
    monkeypatch.syspath_prepend(str(STANDIN))
    from rtp_llm import standin_engine

    standin_engine.load_external_packages(["--external_model_packages", PLUGIN], {})
    yield standin_engine
    _forget_rtp()


# the tiny model at GLM-5's cache widths: RTP allocates the cache from these fields
RTP_TINY = Glm5Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """bf16 weights, so that RTP computes in fp32 (it forces bf16 for block-FP8 weights) and tokens compare exactly."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), fp8=False, config=RTP_TINY)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fp8=True, config=RTP_TINY)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def test_importing_the_plugin_without_rtp_llm_registers_nothing():
    code = (f"import sys, {PLUGIN}; "
            "assert 'fxglm5.rtpllm.glm5' not in sys.modules and not any(m.startswith('rtp_llm') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_the_plugin_takes_glm_5_over_from_rtp(rtp, ckpt, monkeypatch):
    from rtp_llm import model_factory_register as reg
    from rtp_llm.models.deepseek_v2 import DeepSeekV2

    from fxglm5.rtpllm.glm5 import Fxglm5Glm5

    assert reg._model_factory["glm_5"] is Fxglm5Glm5 and reg._model_factory["fxglm5_glm5"] is Fxglm5Glm5
    assert reg._model_factory["deepseek2"] is DeepSeekV2  # RTP's other models are untouched
    assert reg._hf_architecture_2_ft["GlmMoeDsaForCausalLM"] == "glm_5"
    assert rtp.resolve_model_class(ckpt) is Fxglm5Glm5  # MODEL_TYPE unset: from config.json architectures
    # the older spelling: the package list in RTP_LLM_EXTERNAL_MODEL_PACKAGES, imported once
    assert rtp.external_packages([], {"RTP_LLM_EXTERNAL_MODEL_PACKAGES": PLUGIN}) == [PLUGIN]


def test_the_config_describes_the_mla_and_indexer_caches(rtp, ckpt, tmp_path):
    from fxglm5.rtpllm.glm5 import Fxglm5Glm5

    cfg = Glm5Config.from_json(ckpt / "config.json")
    mc = Fxglm5Glm5._create_config(ckpt)
    a = mc.attn_config
    assert (mc.num_layers, mc.hidden_size, mc.vocab_size) == (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    assert a.use_mla and a.is_sparse and (a.kv_lora_rank, a.rope_head_dim) == (512, 64)
    assert (a.head_num, a.indexer_head_dim, a.indexer_head_num, a.indexer_topk) == (
        cfg.num_attention_heads, cfg.index_head_dim, cfg.index_n_heads, cfg.index_topk)
    # a model whose rows are not RTP's GLM-5 layouts is refused by name, before RTP allocates anything
    narrow = Glm5Config.preset("tiny").replace(quantization_config=None)
    narrow.save(tmp_path)
    with pytest.raises(ConfigError, match="kv_lora_rank=128"):
        Fxglm5Glm5._create_config(tmp_path)


@pytest.mark.parametrize("fp8_kv,kernel_block", [(False, 0), (True, 4), (False, 8)])
def test_an_rtp_engine_generates_the_tokens_of_the_fxglm5_runtime(rtp, ckpt, fp8_kv, kernel_block):
    """Mixed prompt lengths around index_topk (8); RTP's prefill and eager decode steps."""
    batch = _prompts([5, 20, 11])
    eng = rtp.Engine(ckpt, act_type="FP32", fp8_kv_cache=fp8_kv, seq_size_per_block=16,
                     kernel_seq_size_per_block=kernel_block, num_blocks=24)
    got = eng.generate(batch, 6)
    runner = Runner(ckpt, kv_cache="fp8" if fp8_kv else "bf16", index_cache="fp8", block_size=16,
                    kernel_block_size=kernel_block or None, dtype=torch.float32, num_blocks=24, decode_graphs=False)
    assert got == runner.generate(batch, 6)
    assert rtp_counts(eng) == dict(prefill=1, eager_decode=5, replays=0)


@pytest.mark.parametrize("fp8_kv,kernel_block", [(True, 0), (False, 8)])
def test_rtp_decode_graph_steps_give_the_eager_tokens(rtp, fp8_ckpt, fp8_kv, kernel_block):
    """RTP's CUDA-graph decode protocol (static buffers at the bucket size, zeroed tables, live rows copied in,
    prepare_cuda_graph, replay; emulated on the CPU by the stand-in) with 3 requests in a bucket of 4."""
    batch = _prompts([5, 20, 11])
    kw = dict(act_type="BF16", fp8_kv_cache=fp8_kv, seq_size_per_block=16, kernel_seq_size_per_block=kernel_block,
              num_blocks=24)
    graphs = rtp.Engine(fp8_ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4), **kw)
    assert graphs.generate(batch, 6) == rtp.Engine(fp8_ckpt, **kw).generate(batch, 6)
    assert rtp_counts(graphs) == dict(prefill=1, eager_decode=0, replays=5)
    assert graphs.init_calls[0] is None  # the warm-up initialize() came first, without a cache


def rtp_counts(eng) -> dict:
    return dict(prefill=eng.prefill_steps, eager_decode=eng.eager_decode_steps, replays=eng.graph_replays)


def _engine(rtp, ckpt, **kw):
    return rtp.Engine(ckpt, act_type=kw.pop("act_type", "FP32"), seq_size_per_block=16, num_blocks=24, **kw)


def _record(py_model, method: str, what):
    """Wrap one method of the plugin's model instance, appending ``what(args, result)`` per call."""
    seen, original = [], getattr(py_model, method)

    def wrapped(*args):
        result = original(*args)
        seen.append(what(args, result))
        return result

    object.__setattr__(py_model, method, wrapped)
    return seen


def test_prefix_reuse_gives_the_tokens_of_a_full_prefill(rtp, ckpt):
    first = _prompts([40, 23], seed=3)
    second = [first[0][:35] + [7, 8], first[1][:20] + [9]]
    eng = _engine(rtp, ckpt)
    eng.generate(first, 3)
    prefixes = _record(eng.py_model, "prepare_fmha_impl", lambda args, _: args[0].attention_inputs.prefix_lengths.tolist())
    reused = eng.generate(second, 4, reuse_prefix=True)
    assert prefixes[0] == [32, 16]  # whole 16-token blocks of the first batch's requests
    assert reused == _engine(rtp, ckpt).generate(second, 4)


def test_fp8_checkpoint_hidden_states_match_the_eager_model(rtp, fp8_ckpt):
    """The checkpoint loaded as it is (block-FP8 weights, bf16 compute): the prefill's final-norm hidden states
    against ``Glm5Model`` without a cache (prompts within index_topk, so the indexer selects every key)."""
    from fxglm5.model.checkpoint import load_checkpoint

    batch = _prompts([6, 8], seed=4)
    eng = _engine(rtp, fp8_ckpt, act_type="BF16")
    hidden = _record(eng.py_model, "forward", lambda args, out: out.hidden_states.float())
    eng.generate(batch, 1)
    model = load_checkpoint(fp8_ckpt, dtype=torch.bfloat16, progress=False)
    with torch.no_grad():
        ref = torch.cat([model.model(torch.tensor([p]))[0].float() for p in batch])
    assert hidden[0].shape == ref.shape
    assert (hidden[0] - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_bad_steps_fail_by_name_and_leave_the_cache_as_it_was(rtp, ckpt):
    from rtp_llm.ops.compute_ops import KVCache, LayerKVCache, PyModelInitResources

    eng = _engine(rtp, ckpt)
    eng.generate(_prompts([20]), 2)  # something stored
    model = eng.py_model
    before = [t.clone() for t in model.caches]
    steps = {
        "block id 99 out of range": eng._decode_inputs([1], [20], [20], [[1, 99]]),
        "a position needs a block": eng._decode_inputs([1], [20], [40], [[1, 2]]),
        "token id 100000 is out of range": eng._decode_inputs([100000], [20], [20], [[1, 2]]),
    }
    for message, inputs in steps.items():
        with pytest.raises(InputError, match=message):
            model.forward(inputs, model.prepare_fmha_impl(inputs, False))
    narrow = [LayerKVCache(torch.zeros(24, 16, 500), None, 16, i) for i in range(4)]
    with pytest.raises(InputError, match="kv_cache layer 0 kv_cache_base"):
        model.initialize(PyModelInitResources(kv_cache=KVCache(narrow, 16, 16)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.caches))


def test_cuda_graphs_are_offered_for_block_fp8_checkpoints_only(rtp, ckpt, fp8_ckpt):
    """RTP refuses ENABLE_CUDA_GRAPH=1 for a model that says no: a bf16 checkpoint's MoE syncs with the host."""
    for path, expected in ((fp8_ckpt, True), (ckpt, False)):
        cls = rtp.resolve_model_class(path)
        assert cls.from_config(model_config=cls._create_config(path)).support_cuda_graph() is expected
    with pytest.raises(RuntimeError, match="support_cuda_graph"):
        _engine(rtp, ckpt, enable_cuda_graph=True)


def test_a_sharded_launch_is_refused_at_load(rtp, ckpt):
    from types import SimpleNamespace

    cls = rtp.resolve_model_class(ckpt)
    config = cls._create_config(ckpt)
    model = cls.from_config(model_config=config, parallelism_config=SimpleNamespace(tp_size=2, tp_rank=0, ep_size=1))
    with pytest.raises(ConfigError, match="tp_size=2"):
        model.load()


def test_warm_up_steps_before_the_cache_write_nothing_to_it(rtp, ckpt):
    """RTP's first initialize() has no cache (warm-up); steps then run on private scratch blocks."""
    from rtp_llm.ops.compute_ops import PyModelInitResources

    eng = _engine(rtp, ckpt)
    model = eng.py_model
    rtp_cache, before = list(model.caches), [t.clone() for t in model.caches]
    assert model.initialize(PyModelInitResources(kv_cache=None)) is True
    inputs = eng._decode_inputs([3, 4], [5, 30], [5, 30], [[1], [2, 3]])
    hidden = model.forward(inputs, model.prepare_fmha_impl(inputs, False)).hidden_states
    assert hidden.shape == (2, RTP_TINY.hidden_size) and torch.isfinite(hidden).all()
    assert all(torch.equal(a, b) for a, b in zip(rtp_cache, before))
    # a step prepared on RTP's cache cannot run once the model holds none
    model.initialize(PyModelInitResources(kv_cache=eng.kv_cache))
    prepared = model.prepare_fmha_impl(inputs, False)
    model.initialize(PyModelInitResources(kv_cache=None))
    with pytest.raises(InputError, match="initialize"):
        model.forward(inputs, prepared)
