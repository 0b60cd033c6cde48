"""Rotary position embedding for the MLA rope slice (qk_rope_head_dim), computed in fp32.

Frequencies follow HF transformers: plain RoPE, or YaRN from `_compute_yarn_parameters` (truncate=True by
default) whose `attention_factor` scales cos and sin (1.0 for DeepSeek-V3, where mscale == mscale_all_dim).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from mla_jax.config import ModelConfig, yarn_get_mscale


@functools.lru_cache(maxsize=64)
def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [rope/2], attention_factor) for cfg's RoPE."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    # float32 like torch: base ** (arange(0, dim, 2) / dim) evaluated in fp32.
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    rs = cfg.rope_scaling_dict
    if rs is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0

    factor = rs["factor"]
    orig_max = rs["original_max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    truncate = rs.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1) - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (np.float32(1) - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions int [...] -> (cos, sin) float32 [..., rope/2], already scaled by YaRN's attention_factor."""
    inv_freq, attention_factor = rope_inv_freq(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleave: bool) -> jnp.ndarray:
    """Rotate x [..., r] by angles whose cos/sin [..., r/2] broadcast against x[..., :r/2]; math in fp32.

    interleave=True: DeepSeek's layout, pairs (x0,x1),(x2,x3)… rotate by frequency i. The output is written
    de-interleaved, [rotated evens | rotated odds], as HF's `apply_rotary_pos_emb_interleave` does; q and k go
    through the same permutation, so q·k is unchanged. interleave=False: rotate_half, pairs (x_i, x_{i+r/2}).
    Output dtype = x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
