"""DeepSeek-V3 / V2 decoder-only transformer (Flax NNX), HF transformers semantics (docs/architecture.md §5).

    h = embed_tokens(ids)
    for layer in layers:  h = h + self_attn(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))      (fp32)
Layers < first_k_dense_replace (and those off moe_layer_freq) use a dense MLP; the rest use MoE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.model.attention import MLAttention
from mla_jax.model.layers import MLP, Embed, Linear, RMSNorm, matmul_precision
from mla_jax.model.moe import MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, layer_idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, layer_idx, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer_idx}.mlp",
                           dtype=dtype, rngs=rngs)

    def __call__(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """h [B, S, D], positions [B, S] -> [B, S, D] (full causal attention over S)."""
        h = h + self.self_attn(self.input_layernorm(h), positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3(nnx.Module):
    """embed_tokens, layers (nnx.List of DecoderLayer), norm, lm_head (None when tie_word_embeddings)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # lm_head is never quantized (docs/architecture.md §6), so it is a plain Linear.
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                   rngs=rngs)

    def embed(self, ids: jax.Array) -> jax.Array:
        """ids int [...] -> hidden [..., D] in the model dtype."""
        return self.embed_tokens(ids)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + lm_head: h [..., D] -> float32 logits [..., V]."""
        h = self.norm(h)
        w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32,
                       precision=matmul_precision(w.dtype))

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """input_ids int32 [B, S] -> float32 logits [B, S, V]; positions 0..S-1, full causal, no cache.

        Compiled (nnx.jit, cached per model structure and input shape); `forward` is the same math un-jitted."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integer [batch, seq], got {input_ids.dtype} {input_ids.shape}")
        return _forward_jit(self, input_ids.astype(jnp.int32))

    def forward(self, input_ids: jax.Array) -> jax.Array:
        """Un-jitted full causal forward: input_ids int [B, S] -> float32 logits [B, S, V]."""
        B, S = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions)
        return self.logits(h)


_forward_jit = nnx.jit(DeepseekV3.forward)
