"""What each process of the stand-in's server resolved and generated, for tests (stand-in only, no RTP
counterpart: real RTP serves HTTP). This is not RTP-LLM code.

- ``RTP_STANDIN_RESULT_DIR``: each process writes ``<role>.json`` there. The roles are ``server`` (the parent),
  ``frontend`` and ``rank<world_rank>``. The record holds the process id, the name and spec of its ``__main__``
  module (a spawned child's is ``__mp_main__``, re-run from the parent's main module), the model class the
  launch's model type resolves to, how many times ``fxglm5_glm5`` was registered in the process, and the ranks'
  tokens or error.
- ``RTP_STANDIN_REQUESTS``: JSON ``[[prompts, max_new_tokens, reuse_prefix], ...]``. Each rank runs these
  requests through its engine, then returns instead of serving.
- ``RTP_STANDIN_INSPECT``: ``module:function``, called in each rank with its started engine; what it returns
  (JSON) is recorded as ``inspected``. Tests use it to read what the model holds on each rank (the plugin's
  expert shards, the draft's aliased weights), which real RTP never looks at.
- ``RTP_STANDIN_FORCED_DRAFTS``: JSON ``[[prompt, continuation], ...]``, handed to an MTP launch's
  ``standin_speculative.MtpEngine`` as ``forced_drafts`` (tests only: a request with one verifies its continuation
  in place of the draft model's proposals, so that the accepted counts vary).
- After the requests, each rank records what its engine ran as ``served`` (:func:`served`): the graphs each
  wrapper captured and how often each replayed, and for MTP the verify steps, the drafts proposed and accepted, and
  the names of the weights the draft borrowed from the target.
"""

import importlib
import json
import os
import sys

from rtp_llm.model_factory_register import _register_calls


def requests():
    return json.loads(os.environ.get("RTP_STANDIN_REQUESTS", "[]"))


def forced_drafts():
    return {tuple(p): c for p, c in json.loads(os.environ.get("RTP_STANDIN_FORCED_DRAFTS", "[]"))}


def inspect(engine):
    """``RTP_STANDIN_INSPECT``'s function applied to ``engine``, or None when it is unset."""
    target = os.environ.get("RTP_STANDIN_INSPECT")
    if not target:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(engine)


def _graph(runner):
    if runner is None:
        return None
    return dict(captured=list(runner.captured_sizes), replays={str(k): v for k, v in runner.replays_by_size.items()},
                emulated=all(i.graph is None for i in runner.instances.values()))  # a CPU captures no CUDA graph


def served(engine):
    """What ``engine`` (the stand-in's ``Engine``, or ``standin_speculative.MtpEngine``) ran: its graphs (None where
    it has none) and, with a draft, its MTP counters."""
    target = getattr(engine, "target", engine)
    out = dict(prefill_steps=target.prefill_steps, eager_decode_steps=target.eager_decode_steps,
               graph_replays=target.graph_replays, graphs=dict(target=_graph(target.graph_runner)))
    if target is not engine:
        out["graphs"].update(draft_decode=_graph(engine.draft_graph), draft_prefill=_graph(engine.draft_prefill_graph))
        out.update(k=engine.k, verify_steps=engine.verify_steps, drafted=engine.drafted, accepted=engine.accepted,
                   draft_decode_replays=engine.draft_graph_replays, draft_prefill_replays=engine.draft_prefill_replays,
                   extend_lengths=engine.extend_lengths, proposals=engine.proposals,
                   alias_names=list(engine.alias_names))
    return out


def qualname(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def write(role, **fields):
    """Write this process's record, merged over what it wrote before under ``role``."""
    out = os.environ.get("RTP_STANDIN_RESULT_DIR")
    if not out:
        return
    path = os.path.join(out, f"{role}.json")
    record = {}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    main = sys.modules["__main__"]
    record.update(pid=os.getpid(), main=main.__name__, main_spec=getattr(main.__spec__, "name", None),
                  fxglm5_registrations=_register_calls["fxglm5_glm5"], **fields)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
