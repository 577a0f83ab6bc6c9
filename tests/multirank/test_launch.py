"""The launcher and the agreement between ranks (gloo, CPU): spawned and joined ranks, every rank's value, a rank's
error raised in the parent, a hang stopped by the timeout, and a mismatch refused on every rank."""

import time

import pytest
import torch
import torch.distributed as dist

from fxglm5.errors import InputError
from fxglm5.runtime import distributed
from fxglm5.runtime.distributed import RankMismatchError, agree, launch, spawn


def summed(info, base):
    """Each rank's all-reduced sum of ``base + rank``, with its rank and device."""
    t = torch.tensor([base + info.rank])
    dist.all_reduce(t)
    return info.rank, info.world, str(info.device), int(t)


def agreeing(info, values):
    """``agree`` on this rank's value; what it raised (or "ok")."""
    try:
        agree(values[info.rank], "the test value")
    except RankMismatchError as err:
        return f"refused: {err}"
    return "ok"


def failing(info):
    if info.rank == 1:
        raise InputError("rank 1 refuses")
    dist.barrier()  # rank 0 waits in a collective for the rank that failed


def sleeping(info):
    if info.rank == 1:
        time.sleep(600)
    return info.rank


def test_spawned_ranks_reduce_and_report_in_rank_order():
    assert spawn(summed, 2, 10, timeout=120) == [(0, 2, "cpu", 21), (1, 2, "cpu", 21)]
    assert launch(summed, 3, 0, timeout=120) == (0, (0, 3, "cpu", 3))  # rank 0's value, in the parent


def test_agree_refuses_on_every_rank():
    assert spawn(agreeing, 2, ["a", "a"], timeout=120) == ["ok", "ok"]
    refused = spawn(agreeing, 3, ["a", "a", "b"], timeout=120)
    assert all(r.startswith("refused: the test value: rank 2 has b, rank 0 has a") for r in refused), refused


def test_a_rank_error_is_raised_in_the_parent_and_a_hang_is_stopped():
    with pytest.raises(InputError, match="rank 1 refuses"):
        spawn(failing, 2, timeout=120)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not finish within 40 s"):
        spawn(sleeping, 2, timeout=40)  # rank 0 starts in ~5-15 s on a loaded 2-core host; rank 1 sleeps 600 s
    assert time.monotonic() - start < 90


def test_joined_under_an_external_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    assert launch(summed, 1, 5) == (0, (0, 1, "cpu", 5))  # this process is the rank: no child started
    assert not dist.is_initialized()
    with pytest.raises(InputError, match="--tp 2: the external launcher started WORLD_SIZE=1 ranks"):
        launch(summed, 2, 5)


def test_bad_world_and_device_refused_before_any_rank_starts():
    with pytest.raises(InputError, match="positive integer"):
        launch(summed, 0, 1)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="cuda:1 is needed for local rank 1, 0 CUDA devices found"):
            launch(summed, 2, 1, device="cuda")


def test_sharded_options_refused_by_name_before_any_rank_starts(tmp_path, capsys):
    from fxglm5.cli import main
    from fxglm5.runtime.runner import Runner

    with pytest.raises(InputError, match="ep=2: experts are split over the tp ranks; give a tp that 2 divides"):
        Runner(tmp_path, ep=2)
    with pytest.raises(InputError, match="tp=2: no process group; start the ranks with"):
        Runner(tmp_path, tp=2)
    (tmp_path / "config.json").write_text("{}")
    base = ["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert main(base + ["--ep", "2"]) == 2
    assert "--ep 2: experts are split over the --tp ranks; give a --tp that 2 divides" in capsys.readouterr().err
    assert main(base + ["--tp", "8", "--ep", "3"]) == 2  # the expert groups: ep must divide tp
    assert "parallel mapping: ep must divide tp=8 (ep groups of tp/ep ranks" in capsys.readouterr().err
    assert main(base + ["--tp", "2", "--backend", "reference"]) == 2
    assert "--tp 2: only the paged backend runs sharded (--backend reference)" in capsys.readouterr().err
