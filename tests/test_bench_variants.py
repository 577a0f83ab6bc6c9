"""bench/rank_at_depth.py's --variants: each one patches tables the lowering really reads, changes what it says it
changes, and puts everything back (a variant that patched a stale key would time the default under another name)."""

import importlib
import os

from bench.rank_at_depth import VARIANTS, Variant
from fxglm5.lowering.triton import moe


class _NoGraphs:
    """A runner without decode graphs (all Variant needs of one)."""

    decode_graphs = None
    device = "cpu"


def _moe_splits(tokens: int = 1) -> tuple[int, int]:
    """The decode MoE's (gate|up, down) K splits at GLM-5's widths on an EP8 rank (32 experts, top-8, 132 SMs)."""
    cfg = moe.pick_moe_config(tokens, 8, 32)
    return moe._split1(min(32, tokens * 8), 6144, 2048, cfg, 132), moe._split2(2048, cfg)


def test_every_variant_patches_tables_that_exist_with_keys_they_read():
    for name, (env, patches) in VARIANTS.items():
        assert all(key.startswith("FXGLM5_") for key in env), name
        for target, keys in patches.items():
            module, attr = target.rsplit(".", 1)
            table = getattr(importlib.import_module("fxglm5.lowering.triton." + module), attr)
            assert isinstance(table, dict), (name, target)
            # a key the table lacks is read with a default by the code (moe's SPLIT1), never a typo of one it has
            assert all(key in table or key == "SPLIT1" for key in keys), (name, target, keys)


def test_the_moe_split_variants_change_the_splits_and_put_them_back():
    tables = (moe.MOE_DECODE, moe.MOE_DECODE_ONE_TOKEN)
    before, base, base8 = [dict(t) for t in tables], _moe_splits(), _moe_splits(8)
    assert base[0] > 1 and base[1] > 1
    assert base[0] < moe._split1(8, 6144, 2048, dict(moe.MOE_DECODE), 132)  # one token's own CTAS_PER_SM1
    with Variant(_NoGraphs(), "moe_split1_1"):
        assert _moe_splits() == (1, base[1])
    with Variant(_NoGraphs(), "moe_split2_1"):
        assert _moe_splits() == (base[0], 1)
    with Variant(_NoGraphs(), "moe_split2_8"):
        assert _moe_splits() == (base[0], 2 * base[1])
    with Variant(_NoGraphs(), "moe_walk2"):
        assert moe.pick_moe_config(1, 8, 32)["WALK_CTAS_PER_SM"] == 2 and _moe_splits() == base
    with Variant(_NoGraphs(), "moe_blocks_last"):
        assert moe.pick_moe_config(1, 8, 32)["BLOCKS_LAST"] and _moe_splits() == base
    with Variant(_NoGraphs(), "moe_bn2_64"):
        assert moe.pick_moe_config(1, 8, 32)["BLOCK_N2"] == 64 and _moe_splits() == base
    with Variant(_NoGraphs(), "moe_ctas32"):
        assert _moe_splits()[0] > base[0] and _moe_splits(8)[0] > base8[0]
    with Variant(_NoGraphs(), "moe_ctas16"):  # the default of every batch: one token's splits as timed at bd118d2
        assert _moe_splits()[0] > base[0] and _moe_splits(8) == base8
    with Variant(_NoGraphs(), "moe_ctas8"):  # one token's default at every batch
        assert _moe_splits() == base and _moe_splits(8)[0] < base8[0]
    assert [dict(t) for t in tables] == before and _moe_splits() == base and _moe_splits(8) == base8


def test_an_environment_variant_is_set_inside_and_unset_after(monkeypatch):
    monkeypatch.delenv("FXGLM5_DECODE_JOINS", raising=False)
    with Variant(_NoGraphs(), "joins_all"):
        assert os.environ["FXGLM5_DECODE_JOINS"] == "all"
    assert "FXGLM5_DECODE_JOINS" not in os.environ
