"""DeepSeek-V3/R1-class inference in JAX with an FP8 paged MLA KV cache."""
