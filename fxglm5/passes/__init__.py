"""Stage 3 of the flow: FX passes over the captured graph, registered by stage (see registry.STAGES).

Importing this package registers every pass; the order of the imports is the order within a stage.
"""

import fxglm5.ops  # noqa: F401  (the passes emit these ops)
from fxglm5.passes import match_sparse_mla, match_mla, match_rms_norm, match_rope  # noqa: F401  (registration)
from fxglm5.passes import fuse_fp8_linear, fuse_fp8_moe  # noqa: F401  (registration)
from fxglm5.passes import insert_paged_cache, select_sampled_rows, fuse_norm_rope_into_cache_writes  # noqa: F401
from fxglm5.passes import lower  # noqa: F401  (registration)
from fxglm5.passes.manager import PassContext, PassManager, PassResult, op_histogram, run_pipeline
from fxglm5.passes.registry import REGISTRY, STAGES, register_pass

__all__ = ["PassContext", "PassManager", "PassResult", "REGISTRY", "STAGES", "op_histogram", "register_pass", "run_pipeline"]
