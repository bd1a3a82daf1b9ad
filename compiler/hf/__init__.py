"""Hugging Face import: config.json -> ModelConfig, safetensors -> kiln weight names."""
