"""fxglm5's op vocabularies; importing this package registers them with torch.library."""

from fxglm5.ops import cached, canonical, collectives, fused  # noqa: F401  (registration)
