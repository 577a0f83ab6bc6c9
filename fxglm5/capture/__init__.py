"""Stage 2 of the flow: the model captured as an FX graph."""

from fxglm5.capture.export import capture, export_graph

__all__ = ["capture", "export_graph"]
