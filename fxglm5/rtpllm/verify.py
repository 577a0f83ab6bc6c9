"""RTP-LLM's target-verify step through the plugin (speculative decoding, sp_type "mtp"): the target's verify step
replayed from RTP's CUDA graphs. Read from rtp-llm 4b8d39cd5; the contract, with file:line, is
docs/rtp_speculative.md. The draft model itself is :mod:`fxglm5.rtpllm.speculative`.

The static step inputs of a target-verify graph. RTP builds the target's graph
runner with ``num_tokens_per_bs = gen_num_per_cycle + 1`` (k+1) and ``is_target_verify`` when speculation is on
(``PyWrappedModel.h:320-341``); its capture inputs are a prefill of k+1 tokens per request behind a prefix
(``cuda_graph_runner.cc:896-937``), every row's hidden state is returned and scored. So the graph computes
batch * (k+1) token rows, request ``row // (k+1)`` (``decode_graphs.request_rows``, as the local runtime's verify
graphs), positions ``prefix_lengths[b] + j``. At a replay RTP zeroes the padding rows' ``input_lengths`` and
``prefix_lengths`` but not their host block-table rows (``cuda_graph_runner.cc:509-517, 588-600``): a row is
live where its input length is positive and its table starts with a real block, else it computes padding
tokens that write nothing.
"""

from __future__ import annotations

import torch

from fxglm5.errors import InputError
from fxglm5.rtpllm.context import StepMetadata, _context, _host, _tables
from fxglm5.runtime.decode_graphs import request_rows


class VerifyStepMetadata(StepMetadata):
    """The graph's step inputs for a target-verify CUDA graph of ``input_lengths[0]`` (= k+1) tokens per request:
    static buffers, refilled by :meth:`prepare_cuda_graph` before each replay."""

    static, caches = True, None

    def __init__(self, attn, layout, device):
        lengths = _host(attn, "input_lengths")
        if lengths is None or lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.max()) != int(lengths.min()):
            got = None if lengths is None else lengths.tolist()
            raise InputError(f"input_lengths: a target-verify graph is captured with num_tokens_per_bs tokens for "
                             f"every request, got {got}")
        self.layout, self.device = layout, device
        self.batch, self.tokens_per_request = lengths.shape[0], int(lengths[0])
        rows = self.batch * self.tokens_per_request
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.req_idx, self.logits_indices = request_rows(self.batch, self.tokens_per_request, device)
        self.block_table = attn.kv_cache_kernel_block_id_device  # RTP's static buffer: its address is fixed
        self.prepare_cuda_graph(attn)

    def prepare_cuda_graph(self, attn) -> None:
        """Positions and slots of the live requests' k+1 tokens (validated); padding rows write nothing."""
        if self.layout is None:
            raise InputError("CUDA-graph verify step before initialize() was given RTP's KV cache")
        q = self.tokens_per_request
        lengths = _host(attn, "input_lengths")
        kernel = _tables(attn, self.layout)[1]
        first = kernel[:, 0] if kernel.shape[1] else torch.zeros_like(lengths)
        live = torch.nonzero((lengths > 0) & (first != 0)).flatten()
        wrong = [int(b) for b in live if int(lengths[b]) != q]
        if wrong:
            raise InputError(f"input_lengths: request {wrong[0]} verifies {int(lengths[wrong[0]])} tokens; this graph "
                             f"was captured for {q} per request (RTP's num_tokens_per_bs = gen_num_per_cycle + 1)")
        positions = torch.zeros(self.batch, q, dtype=torch.int64)
        slots = torch.full((self.batch, q), -1, dtype=torch.int64)
        if live.numel():
            ctx = _context(attn, live, self.layout)
            positions[live], slots[live] = ctx.positions.view(-1, q).cpu(), ctx.slot_mapping.view(-1, q).cpu()
        self.positions.copy_(positions.flatten())
        self.slot_mapping.copy_(slots.flatten())


def verify_step(attn, layout, device):
    """A CUDA-graph step's metadata where RTP captures a prefill: only its target-verify graphs (InputError for
    any other prefill graph, which the plugin does not support)."""
    if not bool(getattr(attn, "is_target_verify", False)):
        raise InputError("attention_inputs: the plugin's CUDA graphs are decode and target-verify steps; got a "
                         "prefill batch without is_target_verify")
    return VerifyStepMetadata(attn, layout, device)
