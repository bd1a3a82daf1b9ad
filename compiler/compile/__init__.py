"""The compile driver: pass pipeline, lowering to kernels, the step model, quantized checkpoints."""
