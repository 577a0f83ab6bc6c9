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
  expert shards), which real RTP never looks at.
"""

import importlib
import json
import os
import sys

from rtp_llm.model_factory_register import _register_calls


def requests():
    return json.loads(os.environ.get("RTP_STANDIN_REQUESTS", "[]"))


def inspect(engine):
    """``RTP_STANDIN_INSPECT``'s function applied to ``engine``, or None when it is unset."""
    target = os.environ.get("RTP_STANDIN_INSPECT")
    if not target:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(engine)


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
