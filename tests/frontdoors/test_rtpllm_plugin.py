"""The RTP-LLM plugin (``fxglm5.rtpllm.models``) driven by a stand-in of RTP-LLM (tests/rtp_standin, rebuilt from
RTP-LLM's source: /work/shared/reference/rtp_llm_audit.md; what still differs is in tests/rtp_standin/README.md).

What a user of the plugin relies on: RTP loads it from ``--external_model_packages`` (PR #1266), in the
launcher and every rank; the config is RTP's GLM-5's and sizes RTP's cache; RTP's lifecycle (``from_config``
-> ``load``, the warm-ups, ``initialize`` per executor, graph capture over max-batch slices, replays with stale
host rows) around the plugin produces the tokens fxglm5's own runtime produces on the same checkpoint and
leaves other requests' cache rows alone; bad inputs fail with errors naming the field, before anything is written.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fxglm5.compiler import PREFILL_STEP_TOKENS
from fxglm5.errors import ConfigError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner

ROOT = Path(__file__).parents[2]
STANDIN = Path(__file__).parents[1] / "rtp_standin"
PLUGIN = "fxglm5.rtpllm.models"
# the tiny model at GLM-5's cache widths: RTP allocates the cache from these fields
RTP_TINY = Glm5Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)


def _forget_rtp() -> None:
    """Drop the stand-in and the plugin modules built on its classes, also as attributes of fxglm5.rtpllm (where
    ``from fxglm5.rtpllm import speculative`` would otherwise find the module of an earlier stand-in), and the
    classes ``rtp_symbol`` cached from it."""
    package = sys.modules.get("fxglm5.rtpllm")
    config = sys.modules.get("fxglm5.rtpllm.config")
    if config is not None:
        config.rtp_symbol.cache_clear()  # its cached RTP classes (DataType, ModelConfig) belong to the stand-in just replaced
    for name in list(sys.modules):
        if name == "rtp_llm" or name.startswith("rtp_llm.") or name in (PLUGIN, "fxglm5.rtpllm.glm5", "fxglm5.rtpllm.speculative"):
            del sys.modules[name]
            if package is not None and name.startswith("fxglm5.rtpllm."):
                package.__dict__.pop(name.rpartition(".")[2], None)


@pytest.fixture(scope="module")
def rtp():
    """The stand-in ``rtp_llm`` on the path with fresh registries; removed afterwards (other tests see no RTP)."""
    _forget_rtp()
    sys.path.insert(0, str(STANDIN))
    from rtp_llm import standin_engine

    yield standin_engine
    _forget_rtp()
    sys.path.remove(str(STANDIN))


def engine(rtp, ckpt, **kw):
    """An RTP engine whose launch names the plugin on the command line, as PR #1266 reads it."""
    kw = dict(dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64), **kw)
    return rtp.Engine(ckpt, **kw)


def runner(ckpt, kv_cache, kernel_block, dtype, **kw):
    kw = dict(dict(block_size=16, num_blocks=40, decode_graphs=False), **kw)
    return Runner(ckpt, kv_cache=kv_cache, index_cache="fp8", kernel_block_size=kernel_block or None, dtype=dtype,
                  keep_logits=True, **kw)


def assert_runtime_tokens(got, runtime, prompts, n):
    """``got`` (the plugin's greedy tokens) against fxglm5's own runtime. In bf16 the runtime's logits are bf16
    where RTP's post-layer keeps them in fp32, so the two choose alike wherever the runtime's top logit is unique
    (rounding keeps order). At a step where the runtime's best logits tie, the plugin's token must be one of the
    tied ones, and that request is compared no further (its continuation may follow the other branch). At least
    half of all steps must be compared, so the check cannot pass vacuously."""
    seqs = runtime.run(prompts, n)
    assert [len(tokens) for tokens in got] == [len(seq.output) for seq in seqs] == [n] * len(prompts)
    compared = 0
    for i, (tokens, seq) in enumerate(zip(got, seqs)):
        for step, (token, logits) in enumerate(zip(tokens, seq.logits)):
            best = logits.max()
            if int((logits == best).sum()) > 1:
                assert logits[token] == best, f"prompt {i} step {step}: token {token} is not one of the runtime's tied best"
                break
            assert token == seq.output[step], f"prompt {i} step {step}: plugin {tokens}, runtime {seq.output}"
            compared += 1
    assert 2 * compared >= n * len(prompts), f"only {compared} of {n * len(prompts)} steps comparable (bf16 ties)"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """bf16 weights, so that RTP computes in fp32 (it forces bf16 for block-FP8 weights) and tokens compare exactly."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), fp8=False, config=RTP_TINY)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fp8=True, config=RTP_TINY)


@pytest.fixture(scope="module")
def eager(rtp, ckpt):
    """RTP's PDFUSION role, eager, fp32 compute (ACT_TYPE=FP32), bf16 cache; its prefill warm-up ran first."""
    return engine(rtp, ckpt, act_type="FP32")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def test_importing_the_plugin_without_rtp_llm_registers_nothing():
    code = (f"import sys, {PLUGIN}; "
            "assert 'fxglm5.rtpllm.glm5' not in sys.modules and not any(m.startswith('rtp_llm') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_rtp_loads_the_plugin_from_the_command_line_flag_in_every_rank(rtp):
    """PR #1266: the flag only (the env var leaves RTP serving its own DeepSeekV2 as glm_5), identifiers
    checked, import errors wrapped, the package imported again in each spawned rank process."""
    from rtp_llm.utils.import_util import load_external_model_packages

    env_only = {"RTP_LLM_EXTERNAL_MODEL_PACKAGES": PLUGIN, "MODEL_TYPE": "glm_5"}
    assert rtp.rank_model_classes([], env_only, 1) == ["rtp_llm.models.deepseek_v2.DeepSeekV2"]
    assert rtp.rank_model_classes(["--external_model_packages", PLUGIN], env_only, 2) == \
        ["fxglm5.rtpllm.glm5.Fxglm5Glm5"] * 2
    with pytest.raises(SystemExit):
        rtp.parse_args(["--external_model_packages", "fxglm5.rtpllm-models"], {})
    with pytest.raises(RuntimeError, match="Failed to import external model package 'fxglm5.rtpllm.absent'") as err:
        load_external_model_packages(["fxglm5.rtpllm.absent"])
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    section = (ROOT / "README.md").read_text().split("## RTP-LLM plugin")[1].split("\n## ")[0]
    assert "--external_model_packages fxglm5.rtpllm.models" in section
    assert "RTP_LLM_EXTERNAL_MODEL_PACKAGES=" not in section


def test_the_config_is_rtp_glm5s_and_sizes_its_cache(rtp, ckpt, tmp_path):
    from rtp_llm.ops import DataType

    from fxglm5.rtpllm.config import compute_dtype
    from fxglm5.rtpllm.glm5 import Fxglm5Glm5

    cfg = Glm5Config.from_json(ckpt / "config.json")
    mc = Fxglm5Glm5._create_config(ckpt)
    a, rope = mc.attn_config, mc.attn_config.rope_config
    assert (mc.num_layers, mc.hidden_size, mc.vocab_size) == (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    assert a.use_mla and a.is_sparse and (a.kv_lora_rank, a.rope_head_dim) == (512, 64)
    assert (a.head_num, a.indexer_head_dim, a.indexer_head_num, a.indexer_topk) == (
        cfg.num_attention_heads, cfg.index_head_dim, cfg.index_n_heads, cfg.index_topk)
    # the values RTP's own GLM-5 (DeepSeekV2._from_hf) writes
    assert a.kv_head_num == cfg.num_key_value_heads and mc.inter_size == cfg.n_shared_experts * cfg.moe_intermediate_size
    assert (mc.moe_style, mc.moe_layer_index, mc.routed_scaling_factor, mc.scoring_func, mc.has_moe_norm) == (
        2, [1, 2, 3], 2.5, 1, True)
    assert (mc.config_dtype, mc.norm_type, mc.has_post_decoder_layernorm) == ("bfloat16", "rmsnorm", True)
    assert (rope.style, rope.offset, rope.is_neox_style, rope.indexer_is_neox_style) == (0, 64, False, False)
    # max_seq_len: RTP's 8192 (MAX_SEQ_LEN overrides it), never GLM-5's 202752 positions
    assert mc.max_seq_len == cfg.max_position_embeddings == 4096
    Glm5Config.preset("glm5").save(tmp_path / "glm5")
    assert Fxglm5Glm5._create_config(tmp_path / "glm5").max_seq_len == 8192
    # data_type is RTP's C++ enum; the compute dtype is compute_dtype
    mc.data_type = "bf16"
    assert mc.data_type is DataType.TYPE_BF16 and compute_dtype(mc) is torch.bfloat16
    assert compute_dtype(SimpleNamespace(data_type=DataType.TYPE_FP32)) is torch.float32
    # a model whose rows are not RTP's GLM-5 layouts is refused by name, before RTP allocates anything
    Glm5Config.preset("tiny").replace(quantization_config=None).save(tmp_path / "narrow")
    with pytest.raises(ConfigError, match="kv_lora_rank=128"):
        Fxglm5Glm5._create_config(tmp_path / "narrow")


@pytest.mark.parametrize("fp8_kv,kernel_block", [(False, 0), (True, 4)])
def test_an_rtp_engine_generates_the_tokens_of_the_fxglm5_runtime(rtp, ckpt, eager, fp8_kv, kernel_block):
    """Mixed prompt lengths around index_topk (8); RTP's prefill and eager decode steps on RTP's cache (tagged
    cache calls, the float8_e4m3fn ds_mla rows under FP8_KV_CACHE=1), after RTP's no-cache prefill warm-up."""
    batch = _prompts([5, 20, 11])
    eng = eager if (fp8_kv, kernel_block) == (False, 0) else engine(
        rtp, ckpt, act_type="FP32", fp8_kv_cache=fp8_kv, kernel_seq_size_per_block=kernel_block)
    if fp8_kv:
        assert eng.kv_cache.get_layer_cache(0).kv_cache_base.dtype == torch.float8_e4m3fn
    steps = eng.prefill_steps, eng.eager_decode_steps
    got = eng.generate(batch, 6)
    assert_runtime_tokens(got, runner(ckpt, "fp8" if fp8_kv else "bf16", kernel_block, torch.float32), batch, 6)
    assert (eng.prefill_steps - steps[0], eng.eager_decode_steps - steps[1], eng.graph_replays) == (1, 5, 0)
    assert eng.init_calls[0] is None and eng.init_calls[1:] == [eng.kv_cache]
    assert eng.model_weights_loader is None  # read as rpc_engine._start reads it


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def graphs(request, rtp, fp8_ckpt):
    """RTP's decode CUDA graphs (captured on CPU as the stand-in emulates them) at sizes 1 and 4, kernel blocks
    of 8 in blocks of 16, over the block-FP8 checkpoint (bf16 compute)."""
    kv = request.param
    eng = engine(rtp, fp8_ckpt, fp8_kv_cache=kv == "fp8", kernel_seq_size_per_block=8, enable_cuda_graph=True,
                 decode_capture_batch_sizes=(1, 4))
    return SimpleNamespace(engine=eng, runner=runner(fp8_ckpt, kv, 8, torch.bfloat16))


def test_fxglm5_rtp_act_quant_makes_the_plugins_gemms_w8a8(rtp, fp8_ckpt, monkeypatch):
    """RTP's config has no activation setting to map (its FP8_PER_BLOCK names the weights' format; its own block-FP8
    linears are always W8A8): the plugin's W8A16 default holds unless FXGLM5_RTP_ACT_QUANT=1, which every rank
    inherits. Set, every FP8 GEMM and MoE of the plugin's program is W8A8 (the tiny model's 4 layers: 13 GEMMs, 4 of
    them with the residual add and norm before them, 4 with the latent query and the indexer after them, the dense
    MLP's down projection fused with its SiLU-mul, 3 MoE with their shared expert's GEMMs, their router and their
    norm) and RTP generates the W8A8 Runner's tokens."""
    from fxglm5.compiler import act_quant_ops
    from fxglm5.rtpllm.config import act_quant

    monkeypatch.delenv("FXGLM5_RTP_ACT_QUANT", raising=False)
    assert act_quant() is False
    monkeypatch.setenv("FXGLM5_RTP_ACT_QUANT", "1")
    eng = engine(rtp, fp8_ckpt)
    assert act_quant_ops(eng.py_model.program.graph) == {("fp8_linear", True): 5,
                                                         ("fp8_linear_latent_query_indexer", True): 4,
                                                         ("add_rms_norm_fp8_linear", True): 4,
                                                         ("silu_mul_fp8_linear", True): 1,
                                                         ("add_rms_norm_moe_router_fp8_shared", True): 3}
    batch = _prompts([5, 11])
    assert_runtime_tokens(eng.generate(batch, 4), runner(fp8_ckpt, "bf16", 0, torch.bfloat16, act_quant=True), batch, 4)


def test_rtp_decode_graphs_give_the_runtime_tokens_and_leave_other_requests_rows(graphs):
    """Four requests fill bucket 4; then two new ones replay it with two padding rows whose host block-table rows
    still name the first batch's blocks (RTP zeroes only the device table and the host sequence_lengths).
    Both batches give fxglm5's own tokens, and the first batch's cached blocks keep every byte."""
    eng = graphs.engine
    g = eng.graph_runner
    assert g.captured_sizes == [4, 1] and eng.init_calls[0] is None and eng.init_calls[1:] == [eng.kv_cache] * 2
    first, second = _prompts([20, 33, 17, 40], seed=4), _prompts([7, 18], seed=104)
    assert_runtime_tokens(eng.generate(first, 4), graphs.runner, first, 4)
    host = g.instances[4].inputs.attention_inputs.kv_cache_kernel_block_id
    kept = sorted(eng.block_manager.cached.values())
    assert len(kept) >= 4 and bool((host[2:4, 0] != 0).all())  # rows 2, 3 will be stale padding
    before = [pool[:, kept].clone() for pool in eng.kv_pools]
    assert_runtime_tokens(eng.generate(second, 5), graphs.runner, second, 5)
    assert all(torch.equal(pool[:, kept].view(torch.uint8), b.view(torch.uint8))
               for pool, b in zip(eng.kv_pools, before))
    assert g.replays_by_size == {4: 3 + 4} and eng.eager_decode_steps == 0


@pytest.mark.parametrize("graphs", ["bf16"], indirect=True)
def test_fp8_checkpoint_hidden_states_match_the_eager_model(rtp, graphs):
    """The checkpoint loaded as it is (block-FP8 weights, bf16 compute): the prefill's final-norm hidden states
    against ``Glm5Model`` without a cache (prompts within index_topk, so the indexer selects every key). On the bf16
    cache only: the FP8 cache quantizes the keys the prefill attends to (14.5 % max-relative off the cache-less
    model), so its plugin path is compared token for token with the runtime's FP8-cache Runner instead
    (test_rtp_decode_graphs_give_the_runtime_tokens_and_leave_other_requests_rows[fp8],
    test_an_rtp_engine_generates_the_tokens_of_the_fxglm5_runtime with the FP8 cache)."""
    from fxglm5.model.modeling import Glm5ForCausalLM

    eng = graphs.engine
    assert eng.config.attn_config.kv_cache_dtype.name != "FP8"
    batch = _prompts([6, 8], seed=4)
    hidden = _record(eng.py_model, "forward", lambda args, out: out.hidden_states.float())
    eng.generate(batch, 1)
    model = Glm5ForCausalLM.from_pretrained(eng.config.ckpt_path, dtype=torch.bfloat16, progress=False)
    with torch.no_grad():
        ref = torch.cat([model.model(torch.tensor([p]))[0].float() for p in batch])
    assert hidden[0].shape == ref.shape
    assert (hidden[0] - ref).abs().max() <= 2e-2 * ref.abs().max()


def _record(py_model, method: str, what):
    """Wrap one method of the plugin's model instance, appending ``what(args, result)`` per call."""
    seen, original = [], getattr(py_model, method)

    def wrapped(*args):
        result = original(*args)
        seen.append(what(args, result))
        return result

    object.__setattr__(py_model, method, wrapped)
    return seen


def test_prefix_reuse_gives_the_tokens_of_a_full_prefill(eager):
    first = _prompts([40, 23], seed=3)
    second = [first[0][:35] + [7, 8], first[1][:20] + [9]]
    eager.generate(first, 3)
    prefixes = _record(eager.py_model, "prepare_fmha_impl",
                       lambda args, _: args[0].attention_inputs.prefix_lengths.tolist())
    reused = eager.generate(second, 4, reuse_prefix=True)
    del eager.py_model.prepare_fmha_impl
    assert prefixes[0] == [32, 16]  # whole 16-token blocks of the first batch's requests
    assert reused == eager.generate(second, 4)


def test_a_prefill_longer_than_the_step_limit_runs_in_chunks_with_the_same_hidden_states(eager):
    """A prefill past ``max_step_tokens`` (7 here; 16384 by default: what keeps a 262144-token step of RTP inside
    the kernels' int32 offsets) runs as consecutive row chunks, chunks that cut a request included: the hidden
    states of every row and the greedy tokens are the one-call step's (float32; a chunk's GEMMs see fewer rows)."""
    batch = _prompts([40, 23], seed=5)
    model = eager.py_model
    hidden = _record(model, "forward", lambda args, out: out.hidden_states.clone())
    whole = eager.generate(batch, 3)
    program = model.program
    calls = _record(model, "program", lambda args, out: args[1].shape[0])
    try:
        object.__setattr__(model, "max_step_tokens", 7)
        chunked = eager.generate(batch, 3)
    finally:
        object.__setattr__(model, "max_step_tokens", PREFILL_STEP_TOKENS)
        model.__dict__.pop("forward")  # the wrapper; the class's forward again
        object.__setattr__(model, "program", program)
    assert calls == [7] * 9 + [2, 2]  # 63 prefill rows in 9 calls, then two decode steps of 2 rows
    assert chunked == whole
    assert hidden[3].shape == hidden[0].shape == (63, model.glm5_config.hidden_size)
    torch.testing.assert_close(hidden[3], hidden[0], rtol=1e-5, atol=1e-5)


def test_bad_steps_fail_by_name_and_leave_the_cache_as_it_was(rtp, eager):
    from rtp_llm.ops.compute_ops import KVCache, init_resources

    eng = eager
    eng.generate(_prompts([20]), 2)  # something stored
    model = eng.py_model
    before = [t.clone() for t in eng.kv_pools]
    disagree = eng._decode_inputs([1], [20], [20], [[1, 2]])
    disagree.attention_inputs.sequence_lengths_plus_1_device = torch.tensor([25], dtype=torch.int32)
    steps = {
        "block id 99 out of range": eng._decode_inputs([1], [20], [20], [[1, 99]]),
        "a position needs a block": eng._decode_inputs([1], [20], [40], [[1, 2]]),
        "token id 100000 is out of range": eng._decode_inputs([100000], [20], [20], [[1, 2]]),
        r"requests \[0, 1\] write the same cache slot": eng._decode_inputs([1, 2], [20, 20], [20, 20],
                                                                          [[1, 2], [1, 2]]),
        r"sequence_lengths_plus_1_device: \[25\] disagrees with sequence_lengths \[20\]": disagree,
    }
    for message, inputs in steps.items():
        with pytest.raises(InputError, match=message):
            model.forward(inputs, model.prepare_fmha_impl(inputs, False))
    narrow = [torch.zeros(48, 16, 500)] * 4
    with pytest.raises(InputError, match="kv_cache layer 0 kv_cache_base"):
        model.initialize(init_resources(KVCache(narrow, [None] * 4, 16, 16)))
    assert all(torch.equal(a, b) for a, b in zip(before, eng.kv_pools))
    model.initialize(init_resources(eng.kv_cache))


def test_warm_ups_write_nothing_to_rtps_cache(rtp, eager):
    """PDFUSION: ``initialize(None)`` then steps on private scratch blocks. DECODE role: a 5-block cache and
    rows whose block ids are all 0 (RTP's fakeInitKVBlock), at max_seq_len - 2: run, refused by nothing,
    written nowhere."""
    from rtp_llm.ops.compute_ops import init_resources
    from rtp_llm.standin_cache import allocate_kv_cache

    model = eager.py_model
    before = [t.clone() for t in eager.kv_pools]
    assert model.initialize(init_resources(None)) is True
    inputs = eager._decode_inputs([3, 4], [5, 30], [5, 30], [[1], [2, 3]])
    hidden = model.forward(inputs, model.prepare_fmha_impl(inputs, False)).hidden_states
    assert hidden.shape == (2, RTP_TINY.hidden_size) and torch.isfinite(hidden).all()
    five, pools = allocate_kv_cache(eager.config, 5, 16, 0, "cpu")
    assert model.initialize(init_resources(five, is_decode_role=True)) is True
    fake = eager._decode_inputs([3] * 4, [63] * 4, [62] * 4, [[0] * 4] * 4)
    assert torch.isfinite(model.forward(fake, model.prepare_fmha_impl(fake, False)).hidden_states).all()
    assert all(not p.view(torch.uint8).any() for p in pools)
    assert all(torch.equal(a, b) for a, b in zip(eager.kv_pools, before))
    # a step prepared on RTP's cache cannot run once the model holds none
    model.initialize(init_resources(eager.kv_cache))
    prepared = model.prepare_fmha_impl(inputs, False)
    model.initialize(init_resources(None))
    with pytest.raises(InputError, match="initialize"):
        model.forward(inputs, prepared)
    model.initialize(init_resources(eager.kv_cache))


def test_the_prefill_warm_up_takes_a_cache_of_one_size_and_writes_nothing(rtp, ckpt, eager):
    """RTP reserves its no-cache prefill warm-up's peak memory before sizing the KV cache: the plugin's scratch
    cache does not grow with the warm-up's length and stays unwritten; the stand-in's warm-ups (prefill and
    DECODE role) give finite rows, leave RTP's cache alone, and the steps after them give the runtime's tokens."""
    from fxglm5.rtpllm.context import scratch_step

    model, calls = eager.py_model, list(eager.init_calls)
    before = [t.clone() for t in eager.kv_pools]

    def scratch_bytes(n):
        attn = eager._prefill_inputs([[1] * n], [0], None).attention_inputs
        return sum(c.nbytes for c in scratch_step(attn, model.cache_spec, "cpu", 1 << 20)[1])

    assert scratch_bytes(4096) == scratch_bytes(64)
    hidden = eager._warm_up("PDFUSION", 0)  # initialize(None), then max_seq_len - 1 tokens, no block tables
    assert hidden.shape == (eager.max_seq_len - 1, RTP_TINY.hidden_size) and torch.isfinite(hidden).all()
    inputs = eager._prefill_inputs([[3] * 40, [4] * 23], [0, 0], None)
    impl = model.prepare_fmha_impl(inputs, False)
    assert torch.isfinite(model.forward(inputs, impl).hidden_states).all()
    assert not any(c.view(torch.uint8).any() for c in impl.caches)
    assert torch.isfinite(eager._warm_up("DECODE", 0)).all()  # 5 blocks, zero block ids (fakeInitKVBlock)
    eager._initialize(eager.kv_cache)
    eager.init_calls[:] = calls
    assert all(torch.equal(a, b) for a, b in zip(eager.kv_pools, before))
    batch = _prompts([9, 17], seed=3)
    assert_runtime_tokens(eager.generate(batch, 4), runner(ckpt, "bf16", 0, torch.float32), batch, 4)


def test_cuda_graphs_are_refused_by_name_for_a_bf16_checkpoint(rtp, ckpt, fp8_ckpt):
    """RTP checks support_cuda_graph() inside the BaseModel.load the plugin replaces: the plugin checks it."""
    from fxglm5.rtpllm.glm5 import Fxglm5Glm5

    for path, expected in ((fp8_ckpt, True), (ckpt, False)):
        model = Fxglm5Glm5.__new__(Fxglm5Glm5)
        model.model_config = Fxglm5Glm5._create_config(path)
        assert model.support_cuda_graph() is expected
    with pytest.raises(ConfigError, match="ENABLE_CUDA_GRAPH=1"):
        engine(rtp, ckpt, enable_cuda_graph=True, warm_up=False)


def test_a_sharded_or_too_long_launch_is_refused_at_load(rtp, ckpt):
    from fxglm5.rtpllm.glm5 import Fxglm5Glm5

    hw = rtp.HWKernelConfig(False, ())
    sharded = SimpleNamespace(tp_size=2, tp_rank=0, ep_size=1)
    with pytest.raises(ConfigError, match="tp_size=2"):
        Fxglm5Glm5.from_config(Fxglm5Glm5._create_config(ckpt), sharded, hw, None, None, None, None, 1, None, False,
                               None)
    with pytest.raises(ConfigError, match="MAX_SEQ_LEN=8192 is past the model's max_position_embeddings"):
        engine(rtp, ckpt, max_seq_len=8192, warm_up=False)
