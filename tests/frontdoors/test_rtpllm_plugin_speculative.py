"""RTP-LLM's MTP speculative decoding through the plugin (issue 25), driven by the stand-in's MtpEngine
(tests/rtp_standin/rtp_llm/standin_speculative.py, RTP's MtpExecutor as docs/rtp_speculative.md traces it).

What a user relies on: ``--sp_type mtp --sp_model_type glm_5-mtp`` serves the checkpoint's MTP layer as RTP's
draft model; RTP's draft prefill / chain / verify / extend cycle through the plugin gives plain greedy decoding's
tokens (and fxglm5's own speculative Runner's); each verify step's first draft is fxglm5's own MTP drafter's
after the same tokens; the target's verify steps replay from RTP's
target-verify graphs (k+1 tokens per request) with the eager step's tokens; bad input is refused by name. An MTP
layer with a head of its own is served with that head: RTP's weight alias borrows only the embedding, and every
draft is the eager MTP's with that head. The draft-prefill graph's rows are rebuilt for whichever request rows are
live, wherever they sit among padding; the weight alias is declined for a target in another compute dtype; a
vocabulary that RTP cannot all-gather in equal shards is refused when the draft loads, by field, before any
collective.
"""

import copy
import json
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

from fxglm5.errors import CheckpointError, ConfigError, InputError
from fxglm5.model.checkpoint import CheckpointReader, save_checkpoint
from fxglm5.model.layout import is_mtp_draft_tensor, mtp_prefix
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.st_files import INDEX
from fxglm5.model.generate import mtp_drafts
from fxglm5.model.tiny import make_tiny_checkpoint, tiny_state
from fxglm5.runtime.speculative import SpeculativeConfig
from tests.frontdoors.test_rtpllm_plugin import (  # noqa: F401 - fixtures
    PLUGIN, RTP_TINY, _prompts, ckpt, engine, fp8_ckpt, rtp, runner)
from tests.helpers import add_own_mtp_head

PROMPTS_LENGTHS, NEW = (5, 12), 6  # 12 > index_topk (8): the indexer selects


@pytest.fixture(scope="module")
def spec(rtp):
    from rtp_llm import standin_speculative

    return standin_speculative


@pytest.fixture(scope="module")
def mtp2(spec, ckpt):
    """RTP's MTP engine, k = 2, eager, fp32 compute: the draft chain runs."""
    return spec.MtpEngine(ckpt, sp_model_type="glm_5-mtp", sp_checkpoint_path=ckpt, gen_num_per_cycle=2,
                          **dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64,
                                 act_type="FP32"))


def test_rtp_serves_the_mtp_layer_as_its_draft_and_gets_plain_greedy_tokens(rtp, spec, mtp2, ckpt):
    from rtp_llm.model_factory_register import ensure_model_registered

    from fxglm5.rtpllm.speculative import Fxglm5Glm5Mtp

    assert ensure_model_registered("glm_5-mtp") is ensure_model_registered("fxglm5_glm5_mtp") is Fxglm5Glm5Mtp
    dc = mtp2.draft_config  # one MLA layer with its indexer: RTP sizes the MTP module's cache from it
    assert (dc.num_layers, dc.is_mtp, dc.reverse_e_h_norm, dc.attn_config.is_sparse) == (1, True, True, True)
    assert mtp2.draft_cache.layer_count == 1
    prompts = _prompts(PROMPTS_LENGTHS)
    got = mtp2.generate(prompts, NEW)
    plain = engine(rtp, ckpt, act_type="FP32").generate(prompts, NEW)
    fx_runner = runner(ckpt, "bf16", None, torch.float32, speculative=SpeculativeConfig(num_tokens=2))
    propose, fx_drafts = fx_runner.drafter.propose, {}

    def record(seqs, counts):
        drafts = propose(seqs, counts)
        fx_drafts.update((tuple(seq.tokens), d) for seq, d in zip(seqs, drafts))
        return drafts

    fx_runner.drafter.propose = record
    assert got == plain == [s.output for s in fx_runner.run(prompts, NEW)]
    # every verify step's first draft is the one fxglm5's own MTP drafter proposes after the same tokens (its
    # paged MTP graph and caches), whether it came from RTP's draft prefill or from the extend of an earlier step
    assert mtp2.verify_steps == len(mtp2.proposals) // len(prompts) >= NEW // 3
    compared = 0
    for tokens, drafts in mtp2.proposals:
        assert len(drafts) == 2
        if fx_drafts.get(tuple(tokens)):
            assert drafts[0] == fx_drafts[tuple(tokens)][0], tokens
            compared += 1
    assert compared >= len(mtp2.proposals) // 2


def test_the_draft_takes_the_target_hidden_states_and_refuses_what_it_cannot_serve(mtp2, ckpt, tmp_path):
    from rtp_llm.ops.compute_ops import PyModelInputs

    from fxglm5.rtpllm.speculative import Fxglm5Glm5Mtp

    t, draft = mtp2.target, mtp2.py_draft
    inputs = t._prefill_inputs([[1, 2, 3]], [0], [[1]])
    with pytest.raises(InputError, match=r"input_hiddens: the MTP draft needs the target's hidden state of every "
                                         r"input token, expected \(3, 256\), got \(2, 64\)"):
        draft.forward(PyModelInputs(input_ids=inputs.input_ids, input_hiddens=torch.zeros(2, 64),
                                    attention_inputs=inputs.attention_inputs))
    verify = t._prefill_inputs([[1, 2, 3]], [0], [[1]])
    verify.attention_inputs.is_target_verify = True
    with pytest.raises(InputError, match=r"glm_5-mtp is a draft model; RTP builds target-verify graphs for the target "
                                         r"only"):
        draft.prepare_fmha_impl(verify, True)
    step = draft.prepare_fmha_impl(inputs, True)  # what sp_prefill_draft_model_'s capture calls: a 3-row graph
    inputs.attention_inputs.input_lengths[0] = 4
    with pytest.raises(InputError, match=r"input_lengths: \[4\] pack 4 tokens; this draft-prefill graph was captured "
                                         r"for 3"):
        step.prepare_cuda_graph(inputs.attention_inputs)
    no_mtp = make_tiny_checkpoint(tmp_path / "no-mtp", fp8=False, config=RTP_TINY.replace(num_nextn_predict_layers=0))
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers=0; the checkpoint has no MTP layer to serve as "
                                          r"RTP's draft model 'glm_5-mtp'"):
        Fxglm5Glm5Mtp._create_config(no_mtp)  # what create_propose_model_config calls first


def _draft_only_copy(ckpt, dst):
    """A copy of the sharded ``ckpt`` where nothing but the draft's tensors can be read: a shard holding only
    target tensors is emptied (0 bytes: not a safetensors file), and in the others every target tensor's bytes are
    0xff (NaN in bf16, e4m3 and float32), which the loader's value check refuses wherever a tensor is read."""
    shutil.copytree(ckpt, dst)
    cfg = CheckpointReader(ckpt).config
    shards = {}
    for name, shard in json.loads((dst / INDEX).read_text())["weight_map"].items():
        shards.setdefault(shard, []).append(name)
    emptied = [s for s, names in shards.items() if not any(is_mtp_draft_tensor(n, cfg) for n in names)]
    for shard, names in shards.items():
        if shard in emptied:
            (dst / shard).write_bytes(b"")
            continue
        with open(dst / shard, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            for name in names:
                if not is_mtp_draft_tensor(name, cfg):
                    begin, end = header[name]["data_offsets"]
                    f.seek(8 + n + begin)
                    f.write(b"\xff" * (end - begin))
    return dst, emptied


def test_the_draft_reads_only_the_mtp_layer_the_embedding_and_the_lm_head(rtp, spec, mtp2, ckpt, tmp_path,
                                                                           monkeypatch):
    """At GLM-5's scale a draft reading the whole checkpoint would hold the target twice: it must read nothing
    of decoder layers 0..N-1 (nor the final norm), open no shard holding only them, and draft as before."""
    poisoned, emptied = _draft_only_copy(ckpt, tmp_path / "draft-only")
    assert emptied  # the tiny checkpoint has a shard of decoder layers only
    with pytest.raises(CheckpointError):
        Glm5ForCausalLM.from_pretrained(poisoned, progress=False)  # the copy is unreadable as a whole model
    read, get = [], CheckpointReader.get  # the tensors the draft reads (the target reads the intact checkpoint)
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name, *a, **k: (
        self.dir == poisoned and read.append(name)) or get(self, name, *a, **k))
    draft_only = spec.MtpEngine(ckpt, sp_model_type="glm_5-mtp", sp_checkpoint_path=poisoned, gen_num_per_cycle=2,
                                **dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40,
                                       max_seq_len=64, act_type="FP32"))
    cfg = draft_only.py_draft.glm5_config
    draft_reads = [n for n in read if n.startswith(mtp_prefix(CheckpointReader(ckpt).config))]
    assert sorted(set(read) - set(draft_reads)) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert len(draft_reads) == len(set(draft_reads)) > cfg.n_routed_experts * 3  # each of the layer's tensors once
    prompts = _prompts(PROMPTS_LENGTHS)
    before = len(mtp2.proposals)
    assert draft_only.generate(prompts, NEW) == mtp2.generate(prompts, NEW)
    assert draft_only.proposals == mtp2.proposals[before:]


def test_a_checkpoint_without_its_mtp_layer_is_refused_naming_the_missing_tensors(rtp, spec, ckpt, tmp_path):
    cfg = CheckpointReader(ckpt).config  # num_nextn_predict_layers = 1, but no layer 4 in the files
    bare = tmp_path / "no-mtp-layer"
    save_checkpoint(tiny_state(cfg), bare, config=cfg)
    with pytest.raises(CheckpointError, match=r"no complete MTP layer \(model\.layers\.4\.\*\) for the MTP draft "
                                              r"model: missing (\d+) of its \1 tensors: 'model\.layers\.4\.enorm\.weight'"):
        spec.MtpEngine(ckpt, sp_model_type="glm_5-mtp", sp_checkpoint_path=bare, gen_num_per_cycle=1,
                       **dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64,
                              act_type="FP32"))


def test_verify_steps_replay_from_target_verify_graphs(rtp, spec, fp8_ckpt):
    """k = 2 on the block-FP8 checkpoint (its graphs are allowed): a batch of 3 in the size-4 graph (a padding
    request), drafts right for one request and wrong for the others; the replay's greedy rows are the eager
    step's and plain decoding's."""
    from rtp_llm.standin_engine import _Request

    prompts = _prompts((5, 12, 7), seed=1)
    plain = engine(rtp, fp8_ckpt).generate(prompts, 4)
    t = engine(rtp, fp8_ckpt, enable_cuda_graph=True, gen_num_per_cycle=2, decode_capture_batch_sizes=(1, 2, 4))
    assert t.graph_runner.captured_sizes == [4, 2, 1]
    reqs = [_Request(p) for p in prompts]
    for r in reqs:
        t._grow(r, len(r.prompt) + 3)
    for r, token in zip(reqs, t._prefill(reqs)):
        r.tokens.append(token)
    cached = [len(r.tokens) - 1 for r in reqs]
    drafts = [plain[0][1:3], [(plain[1][1] + 1) % 512, 0], [plain[2][1], (plain[2][2] + 1) % 512]]
    hidden, scored = spec.verify_step(t, reqs, cached, drafts)
    assert t.graph_runner.replays_by_size == {4: 1}
    eager_hidden, eager_scored = spec.verify_step(t, reqs, cached, drafts, graphs=False)
    assert scored == eager_scored
    torch.testing.assert_close(hidden, eager_hidden, rtol=0, atol=0.05)
    assert scored[0] == plain[0][1:4]  # both drafts right: the target's rows are plain decoding's next three
    assert scored[1][0] == plain[1][1] and scored[2][:2] == plain[2][1:3]
    # a step of another width than the graph's num_tokens_per_bs: RTP's replay check, and the plugin's own
    with pytest.raises(RuntimeError, match=r"target-verify decode graph expects 6 tokens \(2 batches \* 3\), got 4"):
        spec.verify_step(t, reqs[:2], cached[:2], [d[:1] for d in drafts[:2]])
    inst = t.graph_runner.instances[1]
    static = inst.inputs.attention_inputs
    static.kv_cache_kernel_block_id[0, 0], static.input_lengths[0] = reqs[0].blocks[0], 2
    with pytest.raises(InputError, match=r"input_lengths: request 0 verifies 2 tokens; this graph was captured for "
                                         r"3 per request \(RTP's num_tokens_per_bs = gen_num_per_cycle \+ 1\)"):
        inst.impl.prepare_cuda_graph(static)
    prefill = t._prefill_inputs([[1, 2]], [0], [reqs[0].blocks])
    with pytest.raises(InputError, match="prefill batch without is_target_verify"):
        t.py_model.prepare_fmha_impl(prefill, True)


def test_draft_decode_steps_replay_from_the_drafts_decode_graphs(rtp, spec, fp8_ckpt, ckpt):
    """k = 3 on the block-FP8 checkpoint: each verify step's two chained draft decode steps replay from the draft's
    decode graphs (a batch of 3 in the size-4 graph: a padding request), ``input_hiddens`` through the graph's
    static buffer and the carried rows through each graph's own; tokens and every proposal are the eager draft's."""
    kw = dict(sp_model_type="glm_5-mtp", sp_checkpoint_path=fp8_ckpt, gen_num_per_cycle=3, external_model_packages=[PLUGIN],
              seq_size_per_block=16, num_blocks=40, max_seq_len=64)
    prompts = _prompts((5, 12, 7), seed=1)
    eager = spec.MtpEngine(fp8_ckpt, **kw)
    graphs = spec.MtpEngine(fp8_ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 2, 4), **kw)
    assert graphs.draft_graph.captured_sizes == [4, 2, 1]
    assert graphs.generate(prompts, NEW) == eager.generate(prompts, NEW)
    assert graphs.proposals == eager.proposals
    assert graphs.draft_graph_replays == 2 * graphs.verify_steps and eager.draft_graph is None
    assert graphs.draft_graph.replays_by_size[4] >= 2 and graphs.target.graph_runner.replays_by_size
    with pytest.raises(ConfigError, match=r"is not block-FP8; the bf16 MTP layer's MoE syncs with the host, so the "
                                          r"glm_5-mtp draft cannot be captured"):
        spec.MtpEngine(fp8_ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1,), **dict(kw, sp_checkpoint_path=ckpt))


def test_an_mtp_layer_with_its_own_head_drafts_with_it_through_rtps_alias(rtp, spec, ckpt, tmp_path):
    """The weight alias takes the target's embedding only; the draft publishes its own head as ``lm_head``, and each
    verify step's drafts are the eager MTP's with that head (full recompute), which differ from the lm_head's. The
    requests stay within index_topk (8) tokens, so the indexer selects every key and the paged FP8 index keys cannot
    make the paged drafts differ from the eager ones."""
    own = tmp_path / "own-head"
    shutil.copytree(ckpt, own)
    head = add_own_mtp_head(own)
    mtp = spec.MtpEngine(str(own), sp_model_type="glm_5-mtp", sp_checkpoint_path=str(own), gen_num_per_cycle=2,
                         **dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64,
                                act_type="FP32"))
    assert mtp.alias_names == ("embedding",)
    assert torch.equal(mtp.draft_lm_head.float(), head.float())
    assert mtp.draft.weight.get_global_weight("embedding") is mtp.target.model.weight.get_global_weight("embedding")
    prompts = _prompts((3, 2), seed=1)
    assert mtp.generate(prompts, 4) == engine(rtp, str(own), act_type="FP32").generate(prompts, 4)
    assert max(len(t) + len(d) - 1 for t, d in mtp.proposals) <= RTP_TINY.index_topk  # the keys the MTP reads
    model = Glm5ForCausalLM.from_pretrained(own, dtype=torch.float32, progress=False, mtp=True)

    def eager(tokens, n):
        with torch.no_grad():
            hidden = model(torch.tensor([tokens[:-1]]), return_hidden=True)[1]
        return mtp_drafts(model, torch.tensor([tokens]), hidden, n)

    assert mtp.proposals and [d for _, d in mtp.proposals] == [eager(t, len(d)) for t, d in mtp.proposals]
    model.mtp.head = model.lm_head  # control: the lm_head would have drafted otherwise
    assert [d for _, d in mtp.proposals] != [eager(t, len(d)) for t, d in mtp.proposals]


def test_the_draft_prefill_graph_rebuilds_rows_for_live_requests_among_padding(rtp, spec):
    """RTP's draft-prefill replay packs each request's accepted tokens at ``sum(input_lengths[:b])``; request rows
    that are not live (a zero length, or a table whose first block is 0: the capture's all-zero rows) keep their
    packed rows as padding. Here the live requests are rows 0 and 3, with a dead row of 3 tokens and an empty row
    between them (its stale host table, which RTP does not zero): every row's request, position and slot."""
    from fxglm5.rtpllm.context import CacheLayout
    from fxglm5.rtpllm.speculative import DraftPrefillGraphStep

    block = 4
    kernel = torch.tensor([[1, 2, 0], [0, 0, 0], [5, 6, 0], [7, 8, 9]])
    attn = SimpleNamespace(is_prefill=True, input_lengths=torch.tensor([2, 3, 0, 2]),
                           prefix_lengths=torch.tensor([3, 0, 5, 6]), kv_cache_kernel_block_id=kernel,
                           kv_cache_block_id=None, kv_cache_kernel_block_id_device=kernel.clone(), cu_seqlens=None)
    model = SimpleNamespace(glm5_config=SimpleNamespace(hidden_size=8), dtype=torch.float32, mtp_hidden=None)
    step = DraftPrefillGraphStep(attn, CacheLayout(block, block, 16, 256), "cpu", model, tokens=12)
    pad = (0, -1, 0)  # position 0, written nowhere, request 0
    want = [(3, 1 * block + 3, 0), (4, 2 * block + 0, 0),  # request 0: positions 3, 4 in blocks 1 and 2
            pad, pad, pad,  # request 1's three rows: its table is the capture's zeros
            (6, 8 * block + 2, 3), (7, 8 * block + 3, 3),  # request 3 (request 2 has no tokens): blocks [7, 8, 9]
            *[pad] * 5]
    got = list(zip(step.positions.tolist(), step.slot_mapping.tolist(), step.req_idx.tolist()))
    assert got == want
    assert model.mtp_hidden is step.mtp_hidden and step.mtp_hidden.shape == (12, 8)
    attn.input_lengths = torch.tensor([0, 0, 0, 1])  # the next replay: only request 3, one accepted token
    attn.prefix_lengths = torch.tensor([0, 0, 0, 8])
    step.prepare_cuda_graph(attn)
    got = list(zip(step.positions.tolist(), step.slot_mapping.tolist(), step.req_idx.tolist()))
    assert got == [(8, 9 * block + 0, 3)] + [pad] * 11


def test_the_weight_alias_is_declined_for_another_compute_dtype_or_checkpoint(mtp2, ckpt, tmp_path):
    """RTP then lets the draft read its own embedding and lm_head instead of the target's tensors: a target in
    another dtype holds them rounded otherwise, another checkpoint holds other values."""
    from fxglm5.rtpllm.speculative import Fxglm5Glm5Mtp

    target, config = mtp2.target.model, mtp2.draft_config
    assert Fxglm5Glm5Mtp.speculative_weight_alias_names(target, config) == ("embedding", "lm_head")
    for dtype in ("bf16", "fp16"):  # RTP's ACT_TYPE spellings
        other = copy.copy(config)
        other.data_type = dtype
        assert Fxglm5Glm5Mtp.speculative_weight_alias_names(target, other) == ()
    elsewhere = copy.copy(config)
    elsewhere.ckpt_path = str(shutil.copytree(ckpt, tmp_path / "copy"))
    assert Fxglm5Glm5Mtp.speculative_weight_alias_names(target, elsewhere) == ()
    assert Fxglm5Glm5Mtp.speculative_weight_alias_names(object(), config) == ()  # not an fxglm5 target


def test_an_odd_vocabulary_is_refused_when_the_draft_loads_at_tp2(rtp, spec, tmp_path):
    """RTP's C++ all-gathers the draft's logits as equal shards, so a vocabulary of 509 cannot be padded as the
    Runner pads it: the draft's load refuses it from the config alone (every rank alike, before any collective)."""
    from rtp_llm.ops import ParallelismConfig

    from fxglm5.rtpllm.speculative import Fxglm5Glm5Mtp
    from tests.frontdoors.test_rtpllm_plugin_speculative_tp import RTP_TINY_TP

    odd = make_tiny_checkpoint(tmp_path / "odd", fp8=False, config=RTP_TINY_TP.replace(vocab_size=509))
    draft = Fxglm5Glm5Mtp.__new__(Fxglm5Glm5Mtp)
    draft.model_config = Fxglm5Glm5Mtp._create_config(str(odd))
    draft.parallelism_config = ParallelismConfig()
    draft.parallelism_config.tp_size = draft.parallelism_config.ep_size = draft.parallelism_config.world_size = 2
    for rank in (0, 1):
        draft.parallelism_config.tp_rank = rank
        with pytest.raises(InputError, match=r"^vocab_size = 509 is not divisible by tp=2: RTP-LLM all-gathers the "
                                             r"draft's logits as equal vocabulary shards$"):
            draft.load()
