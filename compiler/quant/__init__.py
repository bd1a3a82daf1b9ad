"""Quantization formats and math (int8, int4 groups, round-to-nearest, GPTQ)."""
