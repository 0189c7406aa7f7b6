"""Speculation: the token tree, its KV cache, drafters, verification and the decoding loop."""
