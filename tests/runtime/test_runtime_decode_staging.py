"""The decode graphs' host side: each step is written into host staging buffers allocated once and copied into
the static device buffers in one copy per buffer (pinned and asynchronous on a GPU: tests/gpu/
test_gpu_decode_host.py), with the padding rows of a smaller batch rewritten. Checked on a CPU against the
inputs built by hand from the step's fields, with a stub in place of the model's program."""

import torch

from fxglm5.program import Outputs
from fxglm5.runtime.decode_graphs import DecodeGraphs
from fxglm5.runtime.forward_context import ForwardContext

BLOCK, NUM_BLOCKS = 4, 40


class Recorder:
    """Stands in for the compiled program: keeps a copy of the inputs of each call, returns zero logits."""

    def __init__(self):
        self.calls, self.logits = [], torch.zeros(4, 8)

    def __call__(self, step, input_ids, caches, hidden=None):
        self.calls.append([t.clone() for t in (input_ids[None], step.positions[None], step.slot_mapping,
                                               step.block_table, step.req_idx)])
        return Outputs(self.logits[:input_ids.shape[0]], None)


def decode_context(lengths, tables):
    return ForwardContext.build(False, [], lengths, tables, block_size=BLOCK, kernel_block_size=BLOCK,
                                num_blocks=NUM_BLOCKS, max_position_embeddings=256,
                                prompt_lengths=[1] * len(lengths)).validate()


def expected_inputs(tokens, lengths, tables, bucket, width):
    """The static inputs of a step, by hand: live rows then padding (token 0, position 0, slot -1, table 0)."""
    pad = bucket - len(tokens)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p, table in zip(lengths, tables)]
    table = torch.zeros(bucket, width, dtype=torch.int32)
    for b, row in enumerate(tables):
        table[b, :len(row)] = torch.tensor(row)
    return [torch.tensor([tokens + [0] * pad]), torch.tensor([lengths + [0] * pad]),
            torch.tensor(slots + [-1] * pad), table, torch.arange(bucket)]


STEPS = [  # (tokens, sequence lengths, block tables): a batch of 4, then 3 and 2 in the buckets 4 and 2
    ([5, 6, 7, 8], [9, 4, 12, 2], [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]),
    ([11, 12, 13], [10, 5, 13], [[1, 2, 3], [4, 5], [6, 7, 8, 9]]),
    ([14, 15], [11, 6], [[1, 2, 3], [4, 5]]),
]


def test_static_inputs_padding_and_one_copy_per_buffer(monkeypatch):
    graph = Recorder()
    graphs = DecodeGraphs(graph, [], max_batch=4, table_width=8, device="cpu", capture=False)
    made = {"cat": 0, "zeros": 0, "full": 0, "tensor": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            made[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    buffers = None
    for step, (tokens, lengths, tables) in enumerate(STEPS):
        ctx = decode_context(lengths, tables)
        ids = torch.tensor(tokens)
        with monkeypatch.context() as patch:
            if step:  # the width bucket (4 blocks) exists after the first step: nothing is allocated per step
                for name in made:
                    patch.setattr(torch, name, counting(name, getattr(torch, name)))
            graphs.run(ids, ctx)
        bucket = 4 if len(tokens) > 2 else 2
        for got, want in zip(graph.calls[-1], expected_inputs(tokens, lengths, tables, bucket, 4)):
            assert torch.equal(got, want.to(got.dtype)), (step, got, want)
        pointers = {t.data_ptr() for t in (graphs.inputs, graphs.tables[4], *(x for st in graphs._staging
                                                                            for x in (st.inputs, st.tables[4])))}
        assert buffers is None or pointers == buffers  # the same two staging sets and device buffers every step
        buffers = pointers
    assert made == {"cat": 0, "zeros": 0, "full": 0, "tensor": 0}
    assert graphs.steps == 3 and not graphs._staging[0].inputs.is_pinned()  # pinned only with CUDA
