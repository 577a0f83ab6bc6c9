"""The shard loader on the tiny FP8 checkpoint with a hand-written plan: each attribute is the full parameter's slice
(rows, columns, experts, rows across the gate / up boundary of stacked experts, columns of some experts), the derived
constant is derived from the rank's slice of its source, only those bytes are read (counted by a wrapper around
safetensors' own file handle, independent of the loader's count), experts the rank does not own are never opened, and a
bad value in the rank's slice is refused naming the file and tensor while one outside it is never read."""

import operator
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import fx

from fxglm5.errors import CheckpointError
from fxglm5.lowering.reference.fp8 import dequantize_block_fp8
from fxglm5.model import checkpoint
from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.parallel import Slice, nested
from fxglm5.runtime.shard_loader import load_sharded

A0, E1, E2, E3 = "model.layers.0.self_attn.", *(f"model.layers.{i}.mlp.experts." for i in (1, 2, 3))
KV_B = A0 + "kv_b_proj.weight"
PLAN = {
    A0 + "q_b_proj.weight": Slice(0, 128, 256), A0 + "q_b_proj.weight_scale_inv": Slice(0, 1, 2),
    A0 + "o_proj.weight": Slice(1, 128, 256), A0 + "o_proj.weight_scale_inv": Slice(1, 1, 2),
    E1 + "gate_up_proj": Slice(0, 4, 8), E1 + "gate_up_proj_scale_inv": Slice(0, 4, 8),  # EP: experts 4..7
    E1 + "down_proj": Slice(0, 4, 8), E1 + "down_proj_scale_inv": Slice(0, 4, 8),
    E2 + "gate_up_proj": Slice(1, 64, 192),  # rows 64..191 of [gate; up]: gate's second half, up's first
    E2 + "down_proj": Slice(2, 64, 128),
    E3 + "gate_up_proj": Slice(1, 64, 128, halves=True),  # ep=1, rank 1 of 2: rows 64..127 of gate and of up
    E3 + "gate_up_proj_scale_inv": Slice(1, 0, 1, halves=True),
    E3 + "down_proj": nested(Slice(0, 8, 16), Slice(2, 64, 128)),  # mixed: experts 8..15, columns 64..127 of each
    E3 + "down_proj_scale_inv": nested(Slice(0, 8, 16), Slice(2, 0, 1)),
    KV_B: Slice(0, 128, 256), KV_B + "_scale_inv": Slice(0, 1, 2),  # the derivation's source, not a graph attribute
}
REPLICATED = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
              E2 + "gate_up_proj_scale_inv", E2 + "down_proj_scale_inv"]
W_UK = A0 + "kv_b_proj.w_uk"


def absorbed(weight, scale):
    """A stand-in for the MLA recipe: the dequantized rows, per head of 128 rows."""
    return dequantize_block_fp8(weight, scale).reshape(-1, 64, 128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "fp8", fp8=True, seed=3)


@pytest.fixture(scope="module")
def full(ckpt):
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device="cpu", progress=False)


def sharded_graph(meta_model) -> fx.GraphModule:
    """A graph reading the planned and replicated attributes (and W_UK) as rank-local meta tensors."""
    params = dict(meta_model.named_parameters())
    local = {t: s.apply(params[t]) for t, s in PLAN.items() if t in params}
    local.update({t: params[t] for t in REPLICATED})
    del local[KV_B], local[KV_B + "_scale_inv"]
    local[W_UK] = torch.empty(2, 64, 128, dtype=torch.bfloat16, device="meta")
    graph = fx.Graph()
    graph.output(tuple(graph.get_attr(t) for t in local))
    gm = fx.GraphModule(local, graph)
    gm.meta["shard_plan"] = dict(PLAN)
    gm.meta["derived_constants"] = {W_UK: ((KV_B, KV_B + "_scale_inv"), absorbed)}
    return gm


class Recorder:
    """safe_open, recording every tensor read through it (name -> bytes)."""

    def __init__(self, monkeypatch):
        self.reads: dict[str, int] = {}
        real = checkpoint.safe_open
        recorder = self

        class Handle:
            def __init__(self, *args, **kwargs):
                self.inner = real(*args, **kwargs)

            def __enter__(self):
                self.file = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def get_tensor(self, name):
                return recorder.note(name, self.file.get_tensor(name))

            def get_slice(self, name):
                part = self.file.get_slice(name)

                class Part:
                    def __getitem__(self, index):
                        return recorder.note(name, part[index])
                return Part()

        monkeypatch.setattr(checkpoint, "safe_open", Handle)

    def note(self, name, t):
        self.reads[name] = self.reads.get(name, 0) + t.numel() * t.element_size()
        return t


def test_each_attribute_is_the_rank_slice_and_only_its_bytes_are_read(ckpt, full, monkeypatch):
    reader = CheckpointReader(ckpt)
    meta = Glm5ForCausalLM(reader.config, dtype=torch.bfloat16, device="meta")
    gm = sharded_graph(meta)
    recorder = Recorder(monkeypatch)
    report = load_sharded(gm, reader, meta, "cpu")
    params = dict(full.named_parameters())
    for target, part in PLAN.items():
        if target in (KV_B, KV_B + "_scale_inv"):
            continue
        want = part.apply(params[target])
        got = operator.attrgetter(target)(gm)
        assert got.dtype == want.dtype and torch.equal(got.float(), want.float()), target
    for target in REPLICATED:
        assert torch.equal(operator.attrgetter(target)(gm), params[target]), target
    uk = operator.attrgetter(W_UK)(gm)
    assert torch.equal(uk, absorbed(params[KV_B], params[KV_B + "_scale_inv"])[2:4].to(uk.dtype))
    # What was read: exactly the local bytes, per checkpoint tensor, as safetensors handed them out.
    assert report.tensors == recorder.reads and report.bytes_read == sum(recorder.reads.values())
    held = [operator.attrgetter(t)(gm) for t in [*PLAN, *REPLICATED] if t not in (KV_B, KV_B + "_scale_inv")]
    local = sum(t.numel() * t.element_size() for t in held)  # bf16 as stored, FP8 and float32 scales as stored
    kv_b_part = 128 * 128 + 4  # W_UK's source: 128 FP8 rows and one block scale
    assert report.bytes_read == local + kv_b_part
    read_experts = {int(n.split(".")[5]) for n in recorder.reads if n.startswith(E1)}
    assert read_experts == {4, 5, 6, 7}  # EP: the others are never opened
    assert {int(n.split(".")[5]) for n in recorder.reads if n.startswith(E2)} == set(range(16))
    assert recorder.reads[E1 + "5.gate_proj.weight"] == 128 * 256  # whole per-expert tensors, FP8
    assert recorder.reads[E2 + "5.gate_proj.weight"] == 64 * 256  # its second half only
    assert recorder.reads[E3 + "5.up_proj.weight"] == 64 * 256  # halves: 64 rows of gate and of up
    mixed = {int(n.split(".")[5]) for n in recorder.reads if n.startswith(E3) and ".down_proj." in n}
    assert mixed == set(range(8, 16))
    assert recorder.reads[E3 + "9.down_proj.weight"] == 256 * 64  # the mixed part: its columns of its experts only
    halves = operator.attrgetter(E3 + "gate_up_proj")(gm).float()
    assert torch.equal(halves, torch.cat([params[E3 + "gate_up_proj"][:, 64:128], params[E3 + "gate_up_proj"][:, 192:]], 1).float())
    assert not any(n.startswith("model.layers.3.self_attn") for n in recorder.reads)


def test_bad_value_in_the_slice_is_refused_and_outside_it_never_read(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    name = E1 + "5.gate_proj.weight"
    reader = CheckpointReader(bad)
    file = reader.tensors[name].file
    tensors = load_file(file)
    tensors[name].view(torch.uint8)[0, 0] = 0x7F  # an e4m3 NaN
    save_file(tensors, file, metadata={"format": "pt"})
    meta = Glm5ForCausalLM(reader.config, dtype=torch.bfloat16, device="meta")
    with pytest.raises(CheckpointError, match=rf"{file}: tensor '{name}' holds NaN"):
        load_sharded(sharded_graph(meta), CheckpointReader(bad), meta, "cpu")
    plan = dict(PLAN, **{E1 + k: Slice(0, 8, 12) for k in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj",
                                                           "down_proj_scale_inv")})
    gm = sharded_graph(meta)
    gm.meta["shard_plan"] = plan
    for k in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        assert gm.get_buffer(E1 + k).shape[0] == 4
    load_sharded(gm, CheckpointReader(bad), meta, "cpu")  # experts 8..11: expert 5 is never read


def test_plan_and_graph_that_disagree_are_refused_by_name(ckpt):
    reader = CheckpointReader(ckpt)
    meta = Glm5ForCausalLM(reader.config, dtype=torch.bfloat16, device="meta")
    gm = sharded_graph(meta)
    gm.meta["shard_plan"] = dict(PLAN, **{A0 + "o_proj.weight": Slice(1, 0, 64)})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' part "
                                              r".*has shape \[256, 64\], the model expects \[256, 128\]"):
        load_sharded(gm, reader, meta, "cpu")
    gm.meta["shard_plan"] = dict(PLAN, **{A0 + "o_proj.weight": Slice(1, 200, 328)})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight' of shape \[256, 256\] has no part"):
        load_sharded(gm, reader, meta, "cpu")


@pytest.mark.parametrize("start, real", [(384, 128), (448, 64), (512, 0)])
def test_a_padded_vocabulary_part_reads_the_rows_it_has_and_zeros_past_them(ckpt, full, monkeypatch, start, real):
    """``_read``'s padded branch on the real files: a part of lm_head [start, start + 128) of the 512-row vocabulary
    holds the checkpoint's rows up to V, read and counted as only those, then zero rows; a part wholly past V (the
    last ranks of a large tp over a small vocabulary) reads nothing."""
    reader = CheckpointReader(ckpt)
    meta = Glm5ForCausalLM(reader.config, dtype=torch.bfloat16, device="meta")
    part = Slice(0, start, start + 128, padded=True)
    local = {"lm_head.weight": part.apply(meta.lm_head.weight)}
    graph = fx.Graph()
    graph.output(graph.get_attr("lm_head.weight"))
    gm = fx.GraphModule(local, graph)
    gm.meta["shard_plan"] = {"lm_head.weight": part}
    recorder = Recorder(monkeypatch)
    report = load_sharded(gm, reader, meta, "cpu")
    rows = operator.attrgetter("lm_head.weight")(gm)
    assert rows.shape == (128, reader.config.hidden_size)
    assert torch.equal(rows[:real], full.lm_head.weight[start:start + real])
    assert not rows[real:].any()
    assert recorder.reads.get("lm_head.weight", 0) == report.bytes_read == real * reader.config.hidden_size * 2
