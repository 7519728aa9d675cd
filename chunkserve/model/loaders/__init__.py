"""Checkpoint readers: a model name to a path (source.py), and GGUF, safetensors or random
(dummy) weights to a config and HF-named tensors."""
