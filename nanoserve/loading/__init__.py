"""Checkpoints to weights: safetensors folders and GGUF files, hub ids, the default model,
and the Hugging Face tensor names every loader maps from."""
