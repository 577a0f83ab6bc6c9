"""Drafts from the checkpoint's MTP layer (``compile_mtp``'s paged graph), chained k times per verify step.

At position i the MTP layer takes the target's hidden state h_i (after the final norm) and token t_{i+1} and
predicts t_{i+2}; its decoder layer keeps its own MLA and index-cache rows at position i, in a second
:class:`PagedCache` that shares the target's block tables (same blocks, same positions), so the target's
rollback (``BlockManager.truncate``) rolls it back too: after every step both caches hold rows 0 .. C-1 of a
request with C tokens cached, and whatever a draft or a rejected token wrote past them is never read.

- ``start`` (after each target prefill step, of n tokens at positions a .. a+n-1 per request, a = R, the reused
  prefix, for a prompt's first chunk): the draft prefill over the same positions, tokens shifted by one
  (``prompt[a+1:a+n+1]``, the first sampled token in place of the one past the prompt), hidden h_a .. h_{a+n-1};
  the last row of a prompt's last chunk predicts d1. Chunked prefill thus gives the MTP cache the rows unchunked
  prefill gives it.
- ``propose``: d1, then k-1 chained steps: d_j at position C+j-1 with the MTP's own last hidden output.
- ``accepted`` (after a verify step that accepted a of the drafts): the draft extend over the step's a+1 emitted
  tokens at positions C_old .. C_old+a with the target's hidden states of those rows, which rewrites the rows
  the chain wrote there from draft hiddens; its last row predicts the next d1.

A reused prefix's last MTP row (position R-1) was written by the earlier request, from its token R, which the
new request may not share: it can only change drafts (so acceptance), never tokens.

At tp > 1 every rank runs its shard of the MTP graph on the same tokens and hidden states (the target's are whole
on every rank) and gets the same gathered logits, so the same drafts: no rank decides alone.
"""

from __future__ import annotations

import torch

from fxglm5.program import PagedProgram
from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.cache import PagedCache
from fxglm5.runtime.forward_context import ForwardContext


# the MTP graph's attributes that are the target's (its embedding; its lm_head, unless the layer has a head of its own)
SHARED_WITH_TARGET = {"mtp.embed_tokens.weight": "model.embed_tokens.weight", "mtp.head.weight": "lm_head.weight"}


class MtpDrafter:
    def __init__(self, model, target: PagedProgram, target_cache: PagedCache, blocks: BlockManager, config, device,
                 program: PagedProgram | None = None, *, max_tokens: int, backend=None, disabled_passes=(),
                 act_quant: bool = False, mapping=None, reader=None):
        """The drafter of a target ``program`` (``target``) over ``target_cache``, whose requests' block tables
        ``blocks`` holds (built with them, before the Runner: ``fxglm5.runtime.parts``). ``program``: another
        MtpDrafter's (reused: it holds no cache), else ``compile_mtp(model)``'s, with the target's compile options
        (``backend``, ``disabled_passes``, ``act_quant``: the draft layer's FP8 GEMMs as the target's). With
        ``mapping`` (tp > 1), ``model`` is the rank's meta model and the MTP graph is sharded as the target's
        (``compile_mtp(mapping=...)``: the layer's heads, its experts, the head's vocabulary rows with the logits
        gathered, so every rank drafts the same tokens) and filled like it (``shard_loader.load_rank`` from
        ``reader``), its embedding and lm_head shard the target graph's tensors, not read again."""
        if program is None:
            from fxglm5.compiler import compile_mtp

            program = compile_mtp(model, max_tokens=max_tokens, device=device, backend=backend,
                                  disabled_passes=disabled_passes, act_quant=act_quant, inputs_validated=True,
                                  **({} if mapping is None else {"mapping": mapping})).program
        self.load_report = None
        if mapping is not None:
            from fxglm5.runtime.shard_loader import load_rank, shared_attributes

            pairs = {k: v for k, v in SHARED_WITH_TARGET.items() if k != "mtp.head.weight" or model.mtp.head is
                     model.lm_head}
            given = shared_attributes(target.graph, program.graph, pairs)
            self.load_report = load_rank(program.graph, mapping, reader, model, device, given)
        c = target_cache
        self.program, self.blocks, self.config, self.device = program, blocks, config, device
        self.cache = PagedCache(program.cache_spec(c.kv_cache, c.index_cache, c.dtype), c.num_blocks, c.block_size,
                                c.kernel_block_size, device)
        self.next: dict[int, tuple[int, torch.Tensor]] = {}  # request id -> (d1, the MTP's hidden output for it)

    def _forward(self, seqs, tokens: list[list[int]], starts: list[int], hidden: torch.Tensor):
        """One MTP step: ``tokens[b]`` at positions ``starts[b]`` .. with ``hidden`` [T, H]; per request its last
        row's argmax token and hidden output."""
        c = self.cache
        ctx = ForwardContext.build(True, [len(t) for t in tokens], starts, [self.blocks.tables[s.id] for s in seqs],
                                   block_size=c.block_size, kernel_block_size=c.kernel_block_size,
                                   num_blocks=c.num_blocks, max_position_embeddings=self.config.max_position_embeddings,
                                   device=self.device).validate()
        ids = torch.tensor([t for row in tokens for t in row], device=self.device)
        out = self.program(ctx.step_inputs(), ids, c.graph_inputs(), hidden=hidden)
        return out.logits.float().argmax(-1).tolist(), out.hidden

    def _update(self, seqs, tokens, starts, hidden) -> None:
        drafts, out = self._forward(seqs, tokens, starts, hidden)
        for b, seq in enumerate(seqs):
            self.next[seq.id] = (drafts[b], out[b])

    def start(self, chunks, hidden) -> None:
        seqs = [s for s, _, _ in chunks]
        self._update(seqs, [s.tokens[a + 1:a + n + 1] for s, a, n in chunks], [a for _, a, _ in chunks], hidden)

    def propose(self, seqs, counts):
        drafts = [[self.next[s.id][0]] if n else [] for s, n in zip(seqs, counts)]
        hidden = {s.id: self.next[s.id][1] for s in seqs}
        for j in range(1, max(counts)):
            live = [b for b, n in enumerate(counts) if n > j]
            chain = [seqs[b] for b in live]
            tokens, out = self._forward(chain, [[drafts[b][-1]] for b in live],
                                        [seqs[b].cached + j - 1 for b in live],
                                        torch.stack([hidden[s.id] for s in chain]))
            for i, b in enumerate(live):
                drafts[b].append(tokens[i])
                hidden[seqs[b].id] = out[i]
        return drafts

    def accepted(self, seqs, counts, accepted, hidden) -> None:
        rows, start = [], 0
        for n, a in zip(counts, accepted):
            rows.extend(range(start, start + a + 1))
            start += n + 1
        emitted = [s.output[len(s.output) - a - 1:] for s, a in zip(seqs, accepted)]
        self._update(seqs, emitted, [s.cached - a - 1 for s, a in zip(seqs, accepted)],
                     hidden[torch.tensor(rows, device=hidden.device)])

    def release(self, seq) -> None:
        self.next.pop(seq.id, None)
