"""GGUF files (llama.cpp's format): config, weights (kept quantized where kiln has the format), tokenizer."""
