"""Shared test set-up: hypothesis profiles, the GPU marker, the run-wide export cache and the number of workers.

The export cache (tests/export_cache.py) makes each distinct tiny model's torch.export run once per test run;
``FXGLM5_TEST_EXPORT_CACHE=0`` turns it off (every export traced, as before it existed).

Workers (pytest-xdist, in the test extra): the whole suite (``python -m pytest -q``, no paths: what .ci/run runs)
on a CPU host runs one worker per core, each test file's tests in one worker (its module fixtures built once) and
each directory of SHARED_CACHE_DIRS in one worker (its process-wide caches filled once), the files of
SLOW_FILES_FIRST handed out first and those directories next (xdist's own order, by descending test count, started
the longest file last); a run that names its tests (``pytest tests/x.py -k y``), a run on a CUDA host (the GPU
tests share one device and time it) and a run without pytest-xdist installed stay in this one process. ``-n N`` /
``-n 0`` choose explicitly.

Profiles: ``ci`` (derandomized, few examples: the default, what .ci/run uses) and ``local`` (random,
many examples). Pick one with ``HYPOTHESIS_PROFILE=local pytest``.
"""

import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines (CI); on a GPU host they compile.
# Set here, once, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread here and in the processes the tests start (OMP_NUM_THREADS is inherited): the tiny
    # models' ops gain nothing from more, and where the cores are shared (test workers, spawned ranks, a busy
    # host) OpenMP's barriers wait on descheduled threads: an index_add_ + an FP8 dequantize of tiny tensors took
    # 56-83 ms with 2 threads against 5 ms with 1 on this 2-core machine under load.
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
from hypothesis import HealthCheck, settings

from tests import export_cache

if os.environ.get("FXGLM5_TEST_EXPORT_CACHE", "1") != "0":
    export_cache.install()

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=4,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "local",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Before xdist reads its options: the whole suite on a CPU host spreads its files over one worker per core."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput") and whole_suite
            and config.getoption("numprocesses") is None and not torch.cuda.is_available()):
        config.option.numprocesses, config.option.dist = len(os.sched_getaffinity(0)), "loadfile"
        # xdist's default hands out files by descending test count (scheduler/loadscope.py), so a long file of few
        # tests (the 2-test spawned-rank plugin file) starts last and ends the run alone: keep the order set below.
        config.option.loadscopereorder = False


# The files that keep a worker longest (the spawned-rank plugin pair: ~5 min of one worker), started first so that the
# workers' remaining files fill in around them (longest-first keeps one long file from ending the run alone).
# A file missing here only starts later; a renamed file simply loses its head start.
SLOW_FILES_FIRST = (  # the longest single tests (a 40 s hang timeout, multi-process launches), by measured time
    "tests/multirank/test_launch.py",
    "tests/multirank/test_sharded_runner.py",
    "tests/frontdoors/test_rtpllm_plugin_tp.py",
)


# Directories whose files fill one process-wide cache that costs seconds per entry and that most of their files read:
# the run's export cache (tests/export_cache.py: the front doors serve the same tiny checkpoints, ~5 s an export) and
# the pass template's pipelines (tests/passes/template.py: ~4 s per tiny model, every pass file reads the same four).
# Each is one work unit of the whole-suite run (a file of SLOW_FILES_FIRST stays its own), so one worker fills its
# caches instead of both (measured: the front doors' tests took 154 s over two workers, 139 s in one process; the
# pass files 74 s in two processes, 61 s in one, a start-up of ~3 s included); handed out right after the slow
# files, largest first, so that a unit this long (1-2 minutes) does not start last and end the run alone.
# (tests/runtime gained nothing this way: 60 s in two processes, 57 s in one.)
SHARED_CACHE_DIRS = ("tests/frontdoors/", "tests/passes/")


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    if path in SLOW_FILES_FIRST:
        return path
    return next((d for d in SHARED_CACHE_DIRS if path.startswith(d)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The whole-suite run's work units: a file each (xdist's loadfile), a directory of SHARED_CACHE_DIRS each."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCacheScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return SharedCacheScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate((*SLOW_FILES_FIRST, *SHARED_CACHE_DIRS))}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(rank)))  # stable: others keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def all_decode_joins(monkeypatch):
    """Every one-launch join of a decode step on (``FXGLM5_DECODE_JOINS=all``; the default runs none of them: they
    are opt-in until a GPU run shows them faster, fxglm5.settings): for the tests of the joined kernels."""
    monkeypatch.setenv("FXGLM5_DECODE_JOINS", "all")
