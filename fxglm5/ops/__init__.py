"""fxglm5's op vocabularies; importing this package registers them with torch.library."""

from fxglm5.ops.canonical import CANONICAL_OPS

__all__ = ["CANONICAL_OPS"]
