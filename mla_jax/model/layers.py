"""Basic layers: Linear (with the AWQ hook), Embed, RMSNorm, gated MLP.

Param names (the sharding rules key on these paths): Linear.kernel [in, out]; Embed.embedding [V, D];
RMSNorm.weight [D]; MLP.{gate_proj, up_proj, down_proj}.kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.quant.awq import AWQLinear

_INIT_STD = 0.02


def matmul_precision(dtype) -> jax.lax.Precision:
    """fp32 models get true fp32 matmuls (no TF32 on GPU) so they match fp32 references; 16-bit ones default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


class Linear(nnx.Module):
    """y = x @ kernel; kernel [in, out] (HF stores [out, in]); fp32 accumulation, output in x.dtype."""

    def __init__(self, in_features: int, out_features: int, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 param_dtype=None):
        self.in_features, self.out_features = in_features, out_features
        pdt = param_dtype or dtype
        self.kernel = nnx.Param(
            (jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32) * _INIT_STD).astype(pdt)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        y = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32, precision=matmul_precision(k.dtype))
        return y.astype(x.dtype)


def make_linear(cfg: ModelConfig, in_features: int, out_features: int, hf_name: str, *, dtype, rngs: nnx.Rngs):
    """Every decoder linear is built here: a plain `Linear`, or an AWQ 4-bit one when cfg.quantization is set
    and `hf_name` (HF module name, e.g. "model.layers.3.self_attn.q_a_proj") is not in modules_to_not_convert."""
    q = cfg.quantization
    if q is None or q.excludes(hf_name):
        return Linear(in_features, out_features, dtype=dtype, rngs=rngs)
    return AWQLinear(q, in_features, out_features, hf_name=hf_name, dtype=dtype, rngs=rngs)


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            (jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32) * _INIT_STD).astype(dtype)
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)


class RMSNorm(nnx.Module):
    """HF DeepseekV3RMSNorm: normalize in fp32, cast back to the input dtype, then × weight."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        return (w * xf.astype(x.dtype)).astype(jnp.promote_types(w.dtype, x.dtype))


class MLP(nnx.Module):
    """Gated SiLU MLP: down(silu(gate x) · up x). Used for dense layers and shared experts; any leading shape."""

    def __init__(self, cfg: ModelConfig, hidden: int, intermediate: int, hf_prefix: str, *, dtype,
                 rngs: nnx.Rngs):
        self.gate_proj = make_linear(cfg, hidden, intermediate, f"{hf_prefix}.gate_proj", dtype=dtype, rngs=rngs)
        self.up_proj = make_linear(cfg, hidden, intermediate, f"{hf_prefix}.up_proj", dtype=dtype, rngs=rngs)
        self.down_proj = make_linear(cfg, intermediate, hidden, f"{hf_prefix}.down_proj", dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
