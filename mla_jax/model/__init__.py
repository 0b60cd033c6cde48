"""The DeepSeek-V3/V2 model in Flax NNX."""

from mla_jax.model.attention import MLAttention
from mla_jax.model.layers import MLP, Embed, Linear, RMSNorm, make_linear
from mla_jax.model.moe import Experts, MoE, Router, make_experts
from mla_jax.model.rope import apply_rope, rope_cos_sin
from mla_jax.model.transformer import DecoderLayer, DeepseekV3

__all__ = [
    "DeepseekV3", "DecoderLayer", "MLAttention", "MoE", "Router", "Experts", "MLP", "Linear", "Embed", "RMSNorm",
    "make_linear", "make_experts", "rope_cos_sin", "apply_rope",
]
