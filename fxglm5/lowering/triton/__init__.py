"""Triton kernels (CUDA; CPU under TRITON_INTERPRET=1). Imported only by the lowering stage, never at package import."""
