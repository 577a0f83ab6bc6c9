"""Test stand-in of RTP-LLM's target verify step (MTP speculative decoding) around a plugin target. NOT RTP-LLM code.

Written from rtp-llm 4b8d39cd5 (``cpp/normal_engine/speculative/MtpExecutor.cc``, ``MtpBatchStreamProcessor.cc``):
the target verify of ``MtpExecutor::decodeStep`` (from line 1182) is a prefill of [last token, d1..dk] per request
behind ``prefix_lengths`` = the tokens already cached, with ``is_target_verify`` set
(``prepareOneStepSpecDecodeModelInput`` / ``draftModelDecode``, lines 2174-2372), every row scored greedily. The
drafts are the caller's (the stand-in runs no draft model: docs/rtp_speculative.md says what serving GLM-5's MTP
layer as RTP's draft still needs).
"""

def verify_step(target, reqs, cached, drafts, *, graphs=True):
    """The target's verify step: each request's last token and its k drafts at positions ``cached[b]`` .. behind
    its cached prefix, replayed from a target-verify graph where one fits (``graphs``), else eager. Returns (the
    hidden rows, each request's k+1 greedy tokens)."""
    q = len(drafts[0]) + 1
    inputs = target._prefill_inputs([[r.tokens[-1]] + d for r, d in zip(reqs, drafts)], cached,
                                    [r.blocks for r in reqs])
    inputs.attention_inputs.is_target_verify = True
    if graphs and target.graph_runner is not None and target.graph_runner.can_run(len(reqs)):
        hidden = target._check_hidden(target.graph_runner.forward(inputs), len(reqs) * q)
        target.graph_replays += 1
    else:
        hidden = target._eager(inputs)
    flat = target._post_layers(hidden)
    return hidden, [flat[b * q:(b + 1) * q] for b in range(len(reqs))]
