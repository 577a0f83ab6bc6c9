import sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, "/work/main")
from tests.runtime.test_speculative import plain_run, spec_run, Rejecting, live_rows
from tests.paged_helpers import prompts
from tests.row_invariant import RowInvariant
from tests.paged_helpers import model_and_graph
model_and_graph("exact")
def run(k, mode):
    batch = prompts(torch.Generator().manual_seed(10 + k), [5, 20, 11])
    with mode:
        plain, ps, script = plain_run("exact", batch, block_size=4)
        r1, s1 = spec_run("exact", batch, k, Rejecting(script, 1), block_size=4)
    assert [s.output for s in s1] == [s.output for s in ps]
    a, want = live_rows(r1, s1), live_rows(plain, ps)
    for name in want:
        bad = [(i, (x != z).any(-1).nonzero().flatten().tolist(), (x - z).abs().max().item()) for i, (x, z) in enumerate(zip(a[name], want[name])) if not torch.equal(x, z)]
        print(k, name, "equal" if not bad else f"differ {bad}")

for k in (2, 3, 4):
    run(k, RowInvariant())
print(sorted(hits.items(), key=lambda t: -t[1])[:30])
