"""The launch a user makes: ``python -m fxglm5.rtpllm.serve <RTP's arguments>`` on stock RTP-LLM (main 4b8d39cd5,
with no external-model loader) and on RTP-LLM patched with PR #1266. It is driven through the stand-in's server
entry (tests/rtp_standin: ``rtp_llm.start_server``), in real processes (docs/rtp_launch.md has RTP's file:line).

The stand-in's server does what RTP's does. It parses ``sys.argv`` strictly; stock main has no
``--external_model_packages``, and ``RTP_STANDIN_PR1266=1`` emulates #1266. It infers the model type from
config.json. It spawns a backend process and a frontend process; the backend spawns one process per rank, all with
``spawn``. Each rank reads the draft's config (if any) before any load, loads the target, then the draft, then
starts the engine (``model_factory.py:262-299``). Each process looks the model type up in RTP's factory. The ranks
run the TP test's requests on gloo and write what they resolved, did and generated (``standin_report``).

- Through the launcher, at tp=1, at tp=2 with ``EP_SIZE`` unset and at tp=2 with ``--ep_size 1``, every process
  resolves ``glm_5`` to fxglm5's class, registered once. Its ``__main__`` is the launcher, re-run by
  multiprocessing as ``__mp_main__``. Every rank gives exactly the single-rank plugin's greedy tokens, over the TP
  test's requests (a batch, then a batch that reuses a cached prefix).
- Every rank holds the routed experts RTP's ``ep_size`` asks for: ep = tp, experts [E/tp * r, E/tp * (r + 1))
  whole; ep = 1, every expert's intermediate rows [I/tp * r, I/tp * (r + 1)) (checksums against the checkpoint).
  Both layouts give the same tokens, so only this tells a plugin that ignores ``ep_size`` apart.
- With MTP (``--sp_type mtp --sp_model_type glm_5-mtp``, tp=1): the rank reads the draft's config before the
  target loads, loads the draft after the target and before the engine, and gives the plain greedy tokens.
- With MTP k=2 and every graph RTP captures (``ENABLE_CUDA_GRAPH=1``: the target's verify graphs, the draft's decode
  graphs and its draft-prefill graphs), at tp=2 by RTP's variables and at tp=1 by its flags, on a block-FP8
  checkpoint: every rank gives exactly the plain greedy tokens and the eager draft's proposals, in that order, and
  the stand-in's counts show each graph captured and replayed. The launched draft borrows the target's embedding and
  lm_head shard through RTP's weight alias (``get_sp_model``, ``model_factory.py:173-218``): the same tensors, on
  the same storage.
- With #1266, the flag alone works, and the flag beside the launcher registers once per process.
- Without the launcher, stock RTP resolves ``glm_5`` to its own DeepSeekV2 in every process. Real RTP would serve
  it silently; the stand-in stops with a message saying so. The environment variable changes nothing, and the flag
  is argparse's exit 2, where the launcher adds a note.
- Without ``rtp_llm``, the launcher fails with one line. Importing it by name registers nothing. Its check names the
  class RTP would serve instead of fxglm5's.
"""

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_rtpllm_plugin import PLUGIN, ROOT, STANDIN, _prompts, ckpt, rtp  # noqa: F401 - fixtures
from tests.frontdoors.test_rtpllm_plugin_speculative_tp import ENGINE as SP_ENGINE
from tests.frontdoors.test_rtpllm_plugin_speculative_tp import NEW as SP_NEW
from tests.frontdoors.test_rtpllm_plugin_speculative_tp import RTP_TINY_TP
from tests.frontdoors.test_rtpllm_plugin_speculative_tp import K as SP_K
from tests.frontdoors.test_rtpllm_plugin_speculative_tp import forced
from tests.frontdoors.test_rtpllm_plugin_tp import ENGINE, REQUESTS

FXGLM5 = "fxglm5.rtpllm.glm5.Fxglm5Glm5"
DEEPSEEK = "rtp_llm.models.deepseek_v2.DeepSeekV2"
LAUNCHER = "fxglm5.rtpllm.serve"
# ENGINE's settings as RTP's arguments (the plugin package aside: how it gets in is what is tested)
ARGS = ["--act_type", "FP32", "--max_seq_len", "64", "--seq_size_per_block", "16", "--test_block_num", "40"]
PROBE = "tests.frontdoors.rtp_launch_probe:expert_shards"
TIMEOUT = 900  # seconds for one launch (ranks compile on shared cores)
PLAIN_STEPS = [["create_model_config", "glm_5"], ["load", "glm_5"], ["create_engine", "glm_5"]]
# a rank's order with a draft (model_factory.py:231-301): the draft's config before any load, the draft loaded after
# the target and before the engine (its warm-up, cache and graphs)
MTP_STEPS = [["create_model_config", "glm_5"], ["create_propose_model_config", "glm_5-mtp"], ["load", "glm_5"],
             ["load", "glm_5-mtp"], ["create_engine", "glm_5"]]


def launch(tmp_path_factory, module, argv, *, env=(), standin=True):
    """``python -m module *argv`` in a fresh environment; returns (exit code, stderr, {role: record})."""
    out = tmp_path_factory.mktemp("launch")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RTP_STANDIN_", "RTP_LLM_"))
             and k not in ("MODEL_TYPE", "CHECKPOINT_PATH", "TP_SIZE", "WORLD_SIZE", "EP_SIZE", "DP_SIZE")}
    path = [str(STANDIN)] if standin else []
    clean.update(PYTHONPATH=os.pathsep.join(path + [str(ROOT)]), OMP_NUM_THREADS="1", RTP_STANDIN_RESULT_DIR=str(out),
                 RTP_STANDIN_REQUESTS=json.dumps(REQUESTS), RTP_STANDIN_INSPECT=PROBE)
    clean.update(env)
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=clean, capture_output=True, text=True,
                          timeout=TIMEOUT)
    records = {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
    return proc.returncode, proc.stderr, records


@pytest.fixture(scope="module")
def expected(rtp, ckpt):
    """The single-rank plugin's greedy tokens over the TP test's requests (in-process stand-in Engine)."""
    single = rtp.Engine(ckpt, **ENGINE)
    return [single.generate(p, n, reuse_prefix=reuse) for p, n, reuse in REQUESTS]


# each launch once per module: (tp, the ep_size RTP derives, exit code, stderr, records)
LAUNCHES = {
    # the model type inferred from config.json, in the parent
    "tp1": (LAUNCHER, 1, 1, [], {}),
    # TP by the environment, EP_SIZE unset: RTP makes ep_size tp * dp (whole experts per rank)
    "tp2-ep2": (LAUNCHER, 2, 2, [], {"TP_SIZE": "2", "WORLD_SIZE": "2", "MODEL_TYPE": "glm_5"}),
    # TP by RTP's flags, ep_size 1 (every expert split along its intermediate dim)
    "tp2-ep1": (LAUNCHER, 2, 1, ["--tp_size", "2", "--world_size", "2", "--ep_size", "1", "--model_type", "glm_5"],
                {}),
}


@pytest.fixture(scope="module")
def launched(ckpt, tmp_path_factory):
    done = {}

    def get(name):
        if name not in done:
            module, tp, ep, argv, env = LAUNCHES[name]
            code, err, records = launch(tmp_path_factory, module, ["--checkpoint_path", str(ckpt), *ARGS, *argv],
                                        env=env)
            done[name] = tp, ep, code, err, records
        return done[name]

    return get


@pytest.fixture(scope="module")
def pr1266(ckpt, tmp_path_factory):
    """RTP with #1266: the flag alone (RTP's own entry), and the flag beside the launcher."""
    argv = ["--external_model_packages", PLUGIN, "--checkpoint_path", str(ckpt), "--model_type", "glm_5", *ARGS]
    return {module: launch(tmp_path_factory, module, argv, env={"RTP_STANDIN_PR1266": "1"})
            for module in (LAUNCHER, "rtp_llm.start_server")}


def assert_served_by_fxglm5(records, main_module, ranks, expected):
    assert sorted(records) == sorted(["server", "frontend"] + [f"rank{r}" for r in range(ranks)]), records
    for role, record in records.items():
        assert record["model_class"] == FXGLM5, (role, record)
        assert record["fxglm5_registrations"] == 1, (role, record)  # registered once in each process
        assert record["main_spec"] == main_module, (role, record)
        assert record["main"] == ("__main__" if role == "server" else "__mp_main__"), (role, record)
    assert len({r["pid"] for r in records.values()}) == len(records)  # one process each
    for r in range(ranks):
        assert records[f"rank{r}"].get("tokens") == expected, (r, records[f"rank{r}"])


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_the_launcher_serves_fxglm5_in_every_process_stock_rtp_spawns(name, launched, expected):
    tp, _, code, err, records = launched(name)
    assert code == 0, err[-3000:]
    assert records["server"]["model_type"] == "glm_5"
    assert_served_by_fxglm5(records, LAUNCHER, tp, expected)
    for r in range(tp):
        assert records[f"rank{r}"]["events"] == PLAIN_STEPS


def expected_shards(ckpt, tp, rank, ep):
    """What rank ``rank`` of ``tp`` must hold of each MoE layer's routed experts when RTP's ep_size is ``ep``:
    the probe's record (``rtp_launch_probe.expert_shards``), from the checkpoint's expert tensors."""
    cfg = json.loads((ckpt / "config.json").read_text())
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(name):
        with safe_open(str(ckpt / index[name]), "pt") as f:
            return f.get_tensor(name).double()

    held = range(experts // tp * rank, experts // tp * (rank + 1)) if ep == tp > 1 else range(experts)
    lo, hi = (0, inter) if ep == tp else (inter // tp * rank, inter // tp * (rank + 1))
    hidden = cfg["hidden_size"]
    layers = {}
    model = Glm5Config.from_json(ckpt / "config.json")
    for layer in range(model.num_hidden_layers):
        if not model.is_moe_layer(layer):
            continue
        w = f"model.layers.{layer}.mlp.experts.{{}}.{{}}.weight"
        layers[str(layer)] = dict(
            offset=held.start if ep == tp > 1 else None, gate_up=[len(held), 2 * (hi - lo), hidden],
            down=[len(held), hidden, hi - lo],
            gate_up_sums=[float(tensor(w.format(e, "gate_proj"))[lo:hi].sum() + tensor(w.format(e, "up_proj"))[lo:hi].sum())
                          for e in held],
            down_sums=[float(tensor(w.format(e, "down_proj"))[:, lo:hi].sum()) for e in held])
    return dict(mapping=[tp, rank, ep], layers=layers)


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_each_rank_holds_the_experts_rtps_ep_size_asks_for(name, launched, ckpt):
    tp, ep, code, err, records = launched(name)
    assert code == 0, err[-3000:]
    for r in range(tp):
        got, want = records[f"rank{r}"]["inspected"], expected_shards(ckpt, tp, r, ep)
        assert got["layers"], got
        for layer, shard in want["layers"].items():
            held = got["layers"][layer]
            assert {k: held[k] for k in ("offset", "gate_up", "down")} == \
                {k: shard[k] for k in ("offset", "gate_up", "down")}, (name, r, layer)
            for key in ("gate_up_sums", "down_sums"):
                assert held[key] == pytest.approx(shard[key], rel=1e-9, abs=1e-9), (name, r, layer, key)
        assert got["mapping"] == want["mapping"], (name, r)
        assert sorted(got["layers"]) == sorted(want["layers"]), (name, r)


def test_with_mtp_the_draft_config_comes_first_and_the_draft_loads_after_the_target(ckpt, expected,
                                                                                     tmp_path_factory):
    argv = ["--checkpoint_path", str(ckpt), *ARGS, "--sp_type", "mtp", "--sp_model_type", "glm_5-mtp",
            "--sp_checkpoint_path", str(ckpt), "--gen_num_per_cycle", "2"]
    # the stand-in's MtpEngine has no prefix reuse: the second batch computes its prefix again, same tokens
    requests = [(prompts, n, False) for prompts, n, _ in REQUESTS]
    code, err, records = launch(tmp_path_factory, LAUNCHER, argv, env={"RTP_STANDIN_REQUESTS": json.dumps(requests)})
    assert code == 0, err[-3000:]
    assert_served_by_fxglm5(records, LAUNCHER, 1, expected)
    assert records["rank0"]["events"] == MTP_STEPS


# MTP with every graph RTP captures (issue 39): a block-FP8 checkpoint (RTP captures those only) whose widths split
# over 2 ranks, the speculative TP test's (its requests give the plain greedy tokens at tp 1 and tp 2)
SP_ARGS = ["--max_seq_len", "64", "--seq_size_per_block", "16", "--test_block_num", "40"]
SP_PROBE = "tests.frontdoors.rtp_launch_probe:mtp_draft"
SP_LAUNCHES = {
    # RTP's flags
    "tp1": (1, ["--sp_type", "mtp", "--sp_model_type", "glm_5-mtp", "--gen_num_per_cycle", str(SP_K),
                "--enable_cuda_graph", "1", "--decode_capture_config", "1,2,4"], {}),
    # RTP's environment variables (GEN_NUM_PER_CIRCLE: RTP's spelling)
    "tp2": (2, [], {"TP_SIZE": "2", "WORLD_SIZE": "2", "SP_TYPE": "mtp", "SP_MODEL_TYPE": "glm_5-mtp",
                    "GEN_NUM_PER_CIRCLE": str(SP_K), "ENABLE_CUDA_GRAPH": "1", "DECODE_CAPTURE_CONFIG": "1,2,4"}),
}


@pytest.fixture(scope="module")
def sp_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rtp-tiny-tp"), config=RTP_TINY_TP, seed=1)


@pytest.fixture(scope="module")
def sp_prompts():
    return _prompts((5, 12, 7), seed=0)


@pytest.fixture(scope="module")
def sp_reference(rtp, sp_ckpt, sp_prompts):
    """In process, at tp 1, eager: plain greedy decoding's tokens (as the launch's requests: one batch), the forced
    drafts (request 0 verifies its plain continuation, request 2 one with every third token wrong, request 1 the
    draft model's own proposals: accepted counts of 0 to k that differ inside one step), and the eager MTP engine's
    proposals and accepted count under them."""
    from rtp_llm.standin_speculative import MtpEngine

    plain = rtp.Engine(str(sp_ckpt), **SP_ENGINE).generate(sp_prompts, SP_NEW)
    drafts = forced(sp_prompts, plain)
    eager = MtpEngine(str(sp_ckpt), sp_model_type="glm_5-mtp", sp_checkpoint_path=str(sp_ckpt), gen_num_per_cycle=SP_K,
                      forced_drafts=drafts, **SP_ENGINE)
    assert eager.generate(sp_prompts, SP_NEW) == plain
    return dict(tokens=[plain], forced=[[list(p), c] for p, c in drafts.items()],
                proposals=json.loads(json.dumps(eager.proposals)), accepted=eager.accepted)


@pytest.fixture(scope="module")
def sp_launched(sp_ckpt, sp_prompts, sp_reference, tmp_path_factory):
    done = {}

    def get(name):
        if name not in done:
            tp, argv, env = SP_LAUNCHES[name]
            env = dict(env, RTP_STANDIN_REQUESTS=json.dumps([[sp_prompts, SP_NEW, False]]),
                       RTP_STANDIN_FORCED_DRAFTS=json.dumps(sp_reference["forced"]), RTP_STANDIN_INSPECT=SP_PROBE,
                       SP_CHECKPOINT_PATH=str(sp_ckpt))
            done[name] = (tp, *launch(tmp_path_factory, LAUNCHER, ["--checkpoint_path", str(sp_ckpt), *SP_ARGS, *argv],
                                      env=env))
        return done[name]

    return get


@pytest.mark.parametrize("name", list(SP_LAUNCHES))
def test_mtp_with_every_graph_through_the_launcher_gives_the_plain_greedy_tokens(name, sp_launched, sp_reference):
    """TP_SIZE=2 (and 1), SP_TYPE=mtp, GEN_NUM_PER_CIRCLE=2, ENABLE_CUDA_GRAPH=1, through ``fxglm5.rtpllm.serve``:
    every rank gives exactly the plain greedy tokens and the eager draft's proposals, in RTP's order (the draft's
    config before the target loads, the draft loaded after the target and before the engine), and every graph RTP
    captures was captured (emulated on the CPU) and replayed: the target's verify graphs, the draft's decode graphs
    and its draft-prefill graphs, these with per-request accepted counts that differ inside one replay."""
    tp, code, err, records = sp_launched(name)
    assert code == 0, err[-3000:]
    assert_served_by_fxglm5(records, LAUNCHER, tp, sp_reference["tokens"])
    assert len({t for seq in sp_reference["tokens"][0] for t in seq}) > 6  # tokens that can tell shards apart
    for r in range(tp):
        rank = records[f"rank{r}"]
        assert rank["events"] == MTP_STEPS, (r, rank["events"])
        s = rank["served"]
        assert s["proposals"] == sp_reference["proposals"], r  # the draft model's own, eager at tp 1
        assert s["accepted"] == sp_reference["accepted"] > 0, (r, s["accepted"])
        assert s["k"] == SP_K and s["verify_steps"] > 0 and s["drafted"] == SP_K * sum(
            len(lengths) for lengths in s["extend_lengths"]), (r, s)
        # extends of requests with different accepted counts, packed totals off the keys (padding tokens)
        assert any(len(set(n)) > 1 and sum(n) % (SP_K + 1) for n in s["extend_lengths"]), (r, s["extend_lengths"])
        g = s["graphs"]
        assert g["target"]["captured"] == g["draft_decode"]["captured"] == [4, 2, 1], (r, g)
        assert g["draft_prefill"]["captured"] == [12, 9, 6, 3], (r, g)  # keys i*(k+1), largest first
        assert all(graph["emulated"] for graph in g.values()), (r, g)
        # every verify step replayed a target-verify graph; the k-1 draft decode steps and the draft extend after it
        # replayed the draft's graphs; only the prefills ran eagerly
        assert s["graph_replays"] == sum(g["target"]["replays"].values()) == s["verify_steps"], (r, s)
        assert s["draft_decode_replays"] == sum(g["draft_decode"]["replays"].values()) == \
            (SP_K - 1) * s["verify_steps"], (r, s)
        assert s["draft_prefill_replays"] == sum(g["draft_prefill"]["replays"].values()) == s["verify_steps"], (r, s)
        assert len(g["draft_prefill"]["replays"]) > 1 and len(g["target"]["replays"]) > 1, (r, g)  # several keys
        assert s["eager_decode_steps"] == 0 and s["prefill_steps"] == 1, (r, s)
    # the ranks ran the same steps (TP rank 0's tokens broadcast, the logits gathered)
    assert len({json.dumps(records[f"rank{r}"]["served"], sort_keys=True) for r in range(tp)}) == 1


@pytest.mark.parametrize("name", list(SP_LAUNCHES))
def test_the_launched_draft_shares_the_targets_embedding_and_lm_head_shard(name, sp_launched, sp_ckpt):
    """RTP's weight alias (``get_sp_model``, ``model_factory.py:173-218``), applied where the launch creates the draft
    after the target's load: the draft's ``embedding`` and ``lm_head`` are the target's tensors themselves (same
    object, same storage), the lm_head the rank's vocabulary rows of the checkpoint's, the embedding whole."""
    tp, code, err, records = sp_launched(name)
    assert code == 0, err[-3000:]
    index = json.loads((sp_ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(name):
        with safe_open(str(sp_ckpt / index[name]), "pt") as f:
            return f.get_tensor(name).double()

    head, embedding = tensor("lm_head.weight"), tensor("model.embed_tokens.weight")
    vocab = head.shape[0]
    for r in range(tp):
        probe = records[f"rank{r}"]["inspected"]
        assert probe["alias_names"] == ["embedding", "lm_head"], (r, probe)
        for weight in probe["draft"].values():
            assert weight["aliased"] and weight["same_storage"], (r, probe["draft"])
        rows = head[vocab // tp * r:vocab // tp * (r + 1)]
        assert probe["draft"]["lm_head"]["shape"] == list(rows.shape), (r, probe["draft"])
        assert probe["draft"]["lm_head"]["sum"] == pytest.approx(float(rows.sum()), rel=1e-9, abs=1e-9), r
        assert probe["draft"]["embedding"]["shape"] == list(embedding.shape), (r, probe["draft"])
        assert probe["draft"]["embedding"]["sum"] == pytest.approx(float(embedding.sum()), rel=1e-9, abs=1e-9), r


def test_the_standin_launchs_alias_step_refuses_what_rtp_refuses(rtp):
    """``get_sp_model``'s checks as the stand-in's launch runs them: alias names need a loaded owner, and each aliased
    tensor must be the owner's object on its storage (a copy, or a view of the same storage, is RTP's RuntimeError)."""
    from types import SimpleNamespace

    import torch

    from rtp_llm import model_factory

    class Weights:
        def __init__(self, **tensors):
            self.tensors = tensors

        def get_global_weight(self, name):
            return self.tensors[name]

    class Draft:
        @staticmethod
        def speculative_weight_alias_names(target, config):
            return ("lm_head",)

    head = torch.ones(4, 2)
    target = SimpleNamespace(weight=Weights(lm_head=head))
    assert model_factory.weight_alias_names(Draft, target, None) == ("lm_head",)
    assert model_factory.weight_alias_names(Draft, None, None) == ()
    with pytest.raises(RuntimeError, match="speculative shared-weight owner is not loaded"):
        model_factory.weight_alias_names(Draft, SimpleNamespace(weight=None), None)
    model_factory.check_weight_aliases(target, SimpleNamespace(weight=Weights(lm_head=head)), ("lm_head",))
    for other in (head.clone(), head.view(4, 2)):
        with pytest.raises(RuntimeError, match="speculative global weight alias 'lm_head' did not preserve storage"):
            model_factory.check_weight_aliases(target, SimpleNamespace(weight=Weights(lm_head=other)), ("lm_head",))


@pytest.mark.parametrize("module", [LAUNCHER, "rtp_llm.start_server"])
def test_with_pr1266_its_flag_serves_fxglm5_alone_and_beside_the_launcher(module, pr1266, expected):
    code, err, records = pr1266[module]
    assert code == 0, err[-3000:]
    assert_served_by_fxglm5(records, module, 1, expected)


def test_stock_rtp_without_the_launcher_resolves_its_own_deepseek_v2_in_every_process(ckpt, tmp_path_factory):
    env = {"MODEL_TYPE": "glm_5", "RTP_LLM_EXTERNAL_MODEL_PACKAGES": PLUGIN}  # a variable RTP never reads
    code, err, records = launch(tmp_path_factory, "rtp_llm.start_server", ["--checkpoint_path", str(ckpt)], env=env)
    assert code == 1
    assert f"RTP-LLM resolved this launch's model type to its own {DEEPSEEK}, which real RTP would load and " \
           "serve without a word" in err
    assert records["server"]["model_class"] == DEEPSEEK
    for role in ("server", "frontend", "rank0"):
        assert records[role]["fxglm5_registrations"] == 0, records[role]
    for role in ("frontend", "rank0"):
        assert records[role]["error"].startswith("NotImplementedError: RTP-LLM resolved"), records[role]


@pytest.mark.parametrize("module", [LAUNCHER, "rtp_llm.start_server"])
def test_stock_rtp_refuses_the_pr1266_flag_and_the_launcher_says_why(module, ckpt, tmp_path_factory):
    argv = ["--external_model_packages", PLUGIN, "--checkpoint_path", str(ckpt)]
    code, err, records = launch(tmp_path_factory, module, argv)
    assert code == 2 and "error: unrecognized arguments: --external_model_packages fxglm5.rtpllm.models" in err
    note = "fxglm5.rtpllm.serve: note: --external_model_packages exists only in RTP-LLM patched with PR #1266"
    assert (note in err) == (module == LAUNCHER)
    assert not records  # argparse exits before the parent records anything or starts a process


def test_the_launcher_without_rtp_llm_fails_in_one_line(tmp_path_factory):
    code, err, _ = launch(tmp_path_factory, LAUNCHER, ["--checkpoint_path", "x"], standin=False)
    assert code == 1
    assert err.splitlines() == [f"fxglm5.rtpllm.serve: error: rtp_llm is not importable by {sys.executable}: run "
                                "the launcher with the Python that has RTP-LLM installed"]


def test_importing_the_launcher_registers_nothing_and_its_check_names_what_rtp_would_serve(rtp):
    code = (f"import sys, {LAUNCHER}; assert {PLUGIN!r} not in sys.modules "
            "and 'rtp_llm.start_server' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT)])))
    import importlib

    serve = importlib.import_module(LAUNCHER)
    importlib.import_module(PLUGIN)
    from rtp_llm import model_factory_register as factory
    from rtp_llm.models.deepseek_v2 import DeepSeekV2

    assert {name: f"{c.__module__}.{c.__qualname__}" for name, c in serve.check_registered().items()} == {
        "glm_5": FXGLM5, "fxglm5_glm5": FXGLM5, "glm_5-mtp": "fxglm5.rtpllm.speculative.Fxglm5Glm5Mtp"}
    saved = factory._model_factory["glm_5"]
    factory._model_factory["glm_5"] = DeepSeekV2  # what RTP binds when nothing takes glm_5 over
    try:
        with pytest.raises(serve.LaunchError, match=rf"RTP resolves model type 'glm_5' to {DEEPSEEK}, not {FXGLM5}"):
            serve.check_registered()
    finally:
        factory._model_factory["glm_5"] = saved
    factory._hf_architecture_2_ft["GlmMoeDsaForCausalLM"] = "deepseek_v32"
    try:
        with pytest.raises(serve.LaunchError, match="infers architecture 'GlmMoeDsaForCausalLM' as model type "
                                                    "'deepseek_v32'"):
            serve.check_registered()
    finally:
        factory._hf_architecture_2_ft["GlmMoeDsaForCausalLM"] = "glm_5"


def test_the_readme_shows_the_launch_for_stock_rtp_and_for_pr1266():
    section = (ROOT / "README.md").read_text().split("## RTP-LLM plugin")[1].split("\n## ")[0]
    assert "python3 -m fxglm5.rtpllm.serve" in section
    assert "python3 -m rtp_llm.start_server --external_model_packages fxglm5.rtpllm.models" in section
    for setting in ("TP_SIZE=8", "WORLD_SIZE=8", "ENABLE_CUDA_GRAPH=1", "FP8_KV_CACHE=1", "SP_TYPE=mtp",
                    "SP_MODEL_TYPE=glm_5-mtp", "SP_CHECKPOINT_PATH=", "GEN_NUM_PER_CIRCLE="):
        assert setting in section, setting
