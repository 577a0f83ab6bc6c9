"""Stage 4 of the flow: kernels per backend (reference torch, Triton, aiter) and the registry that picks one per call."""
