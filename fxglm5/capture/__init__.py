"""Stage 2 of the flow: the model captured as an FX graph."""

from fxglm5.capture.export import capture

__all__ = ["capture"]
