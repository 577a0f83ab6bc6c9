"""Stage 1 of the flow: GLM-5 config, the generic PyTorch model, checkpoint load / save / quantize."""
