"""Multi-head latent attention (MLA), DeepSeek-V2/V3.

Shapes: D hidden, H heads, N = qk_nope_head_dim, R = qk_rope_head_dim, C = kv_lora_rank (latent), V = v_head_dim.
  q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) without q_lora)  -> [.., H, N+R]
  kv_a     = kv_a_proj_with_mqa(x) -> [.., C+R] = latent C | k_rope R (one rope head shared by all heads)
  latent   = kv_a_layernorm(latent);  kv_b_proj(latent) -> [.., H, N+V] = k_nope | v
  score    = (q_nope·k_nope + q_rope·k_rope) · softmax_scale
The engine's absorbed decode uses `absorbed_weights()`: q_nope·k_nope = (q_nope·W_UK)·latent, o = (P·latent)·W_UVᵀ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.model.layers import RMSNorm, make_linear, matmul_precision
from mla_jax.model.rope import apply_rope, rope_cos_sin


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layer_idx = layer_idx
        D, H = cfg.hidden_size, cfg.num_attention_heads
        N, R, C, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        p = f"model.layers.{layer_idx}.self_attn"
        if cfg.q_lora_rank is None:
            self.q_proj = make_linear(cfg, D, H * (N + R), f"{p}.q_proj", dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = make_linear(cfg, D, cfg.q_lora_rank, f"{p}.q_a_proj", dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = make_linear(cfg, cfg.q_lora_rank, H * (N + R), f"{p}.q_b_proj", dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = make_linear(cfg, D, C + R, f"{p}.kv_a_proj_with_mqa", dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = make_linear(cfg, C, H * (N + V), f"{p}.kv_b_proj", dtype=dtype, rngs=rngs)
        self.o_proj = make_linear(cfg, H * V, D, f"{p}.o_proj", dtype=dtype, rngs=rngs)

    # ---- pieces the engine reuses ------------------------------------------------------------------------------
    def project_q(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., D], positions [...] -> q_nope [..., H, N], q_rope [..., H, R] (roped)."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        cos, sin = rope_cos_sin(cfg, positions)
        q_rope = apply_rope(q_rope, cos[..., None, :], sin[..., None, :], cfg.rope_interleave)
        return q_nope, q_rope

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., D], positions [...] -> latent [..., C] (after kv_a_layernorm), k_rope [..., R] (roped)."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rope = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope_cos_sin(cfg, positions)
        k_rope = apply_rope(k_rope, cos, sin, cfg.rope_interleave)
        return latent, k_rope

    def expand_kv(self, latent: jax.Array) -> tuple[jax.Array, jax.Array]:
        """latent [..., C] -> k_nope [..., H, N], v [..., H, V] through kv_b_proj."""
        cfg = self.cfg
        kv = self.kv_b_proj(latent).reshape(*latent.shape[:-1], cfg.num_attention_heads,
                                            cfg.qk_nope_head_dim + cfg.v_head_dim)
        return kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]

    def kv_b_weight(self) -> jax.Array:
        """kv_b_proj's weight as [C, H*(N+V)] (dequantized when the layer is AWQ)."""
        proj = self.kv_b_proj
        if hasattr(proj, "dequantized_kernel"):  # AWQLinear
            return proj.dequantized_kernel()
        return proj.kernel[...]

    def absorbed_weights(self) -> tuple[jax.Array, jax.Array]:
        """(w_uk [H, N, C], w_uv [H, V, C]) so that q_nope·k_nope = (q_nope @ w_uk)·latent, o = o_lat @ w_uvᵀ."""
        cfg = self.cfg
        w = self.kv_b_weight().reshape(cfg.kv_lora_rank, cfg.num_attention_heads,
                                       cfg.qk_nope_head_dim + cfg.v_head_dim)
        w = jnp.transpose(w, (1, 2, 0))  # [H, N+V, C]
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def output(self, o: jax.Array) -> jax.Array:
        """o [..., H, V] -> [..., D] through o_proj."""
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    # ---- plain full causal forward (non-absorbed), used by model() -------------------------------------------
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, S, D], positions [B, S] -> [B, S, D]; causal over the S axis."""
        cfg = self.cfg
        q_nope, q_rope = self.project_q(x, positions)          # [B,S,H,N], [B,S,H,R]
        latent, k_rope = self.project_kv(x, positions)         # [B,S,C],   [B,S,R]
        k_nope, v = self.expand_kv(latent)                     # [B,S,H,N], [B,S,H,V]
        prec = matmul_precision(x.dtype)
        scores = (
            jnp.einsum("bqhn,bkhn->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32, precision=prec)
            + jnp.einsum("bqhr,bkr->bhqk", q_rope, k_rope, preferred_element_type=jnp.float32, precision=prec)
        ) * cfg.softmax_scale
        S = x.shape[1]
        causal = jnp.tril(jnp.ones((S, S), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o = jnp.einsum("bhqk,bkhv->bqhv", probs, v, preferred_element_type=jnp.float32, precision=prec)
        return self.output(o.astype(x.dtype))
