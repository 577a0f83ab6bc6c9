import sys, torch, torch.fx
sys.path.insert(0, "/work/main")
exec(open("/work/main/.diag/bi2.py").read().split("def run(k, mode):")[0])
from fxglm5.runtime.runner import Runner
POS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
records = {}
cur = []

class Rec(torch.fx.Interpreter):
    def __init__(self, gm, row):
        super().__init__(gm); self.row = row; self.out = {}
    def run_node(self, n):
        v = super().run_node(n)
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == self.T:
            self.out[n.name] = v[0, self.row].clone()
        elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.T:
            self.out[n.name] = v[self.row].clone()
        return v

orig = Runner.step
def step(self, ctx, input_ids, rows=None):
    real = self.graph
    class W:
        def __call__(s, *a):
            pos, req = a[1][0], a[4]
            hits = ((pos == POS) & (req == 0)).nonzero().flatten()
            if not len(hits):
                return real(*a)
            it = Rec(real, int(hits[0])); it.T = pos.shape[0]
            out = it.run(*a)
            cur.append(it.out)
            return out
    self.graph = W()
    try:
        return orig(self, ctx, input_ids, rows)
    finally:
        self.graph = real
Runner.step = step

k = 4
batch = prompts(torch.Generator().manual_seed(10 + k), [5, 20, 11])
with RowInvariant():
    plain, ps, script = plain_run("exact", batch, block_size=4)
    n_plain = len(cur)
    r1, s1 = spec_run("exact", batch, k, Rejecting(script, 1), block_size=4)
print("records", len(cur), "plain", n_plain)
a = cur[0]; b = cur[-1]  # plain's step at POS, the verify step whose first token is POS (last record)
for name in a:
    if name in b and a[name].shape == b[name].shape and not torch.equal(a[name], b[name]):
        print("first differing node:", name, (a[name] - b[name]).abs().max().item()); break
else:
    print("no difference")
g = plain.graph.graph if hasattr(plain.graph, "graph") else None
for n in g.nodes:
    if n.name == name:
        print(n.format_node()); 
        for x in n.all_input_nodes:
            print("  in:", x.format_node()[:300])
            for y in x.all_input_nodes: print("     in:", y.format_node()[:300], "equal" if y.name in a and y.name in b and torch.equal(a[y.name], b[y.name]) else "?")
