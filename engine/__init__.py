"""The inference engine: model code, loading, token tree, tree KV cache, verification, workers."""
