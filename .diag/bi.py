import sys, torch
from torch.overrides import TorchFunctionMode
sys.path.insert(0, "/work/main")
from tests.runtime.test_speculative import plain_run, spec_run, Rejecting, live_rows, LENGTHS
from tests.paged_helpers import prompts

seen = {}
class Count(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        seen[name] = seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

def run(k=2, mode=None):
    batch = prompts(torch.Generator().manual_seed(10 + k), LENGTHS)
    import contextlib
    with (mode or contextlib.nullcontext()):
        plain, ps, script = plain_run("exact", batch, block_size=4)
        r1, s1 = spec_run("exact", batch, k, Rejecting(script, 1), block_size=4)
    a, want = live_rows(r1, s1), live_rows(plain, ps)
    for name in want:
        bad = [(x - z).abs().max().item() for x, z in zip(a[name], want[name]) if not torch.equal(x, z)]
        print(name, "equal" if not bad else f"differ {bad}")

run()
run(mode=Count())
print(sorted(seen.items(), key=lambda t: -t[1])[:40])
