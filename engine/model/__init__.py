"""The model: the transformer, its files (GGUF, safetensors), loading, the CPU backends, tensor parallelism."""
