"""The engine's pure step functions over a paged MLA KV cache.

    prefill_step: chunks of prompts -> write their latents to the cache, logits of each chunk's last token
    decode_step:  one new token per sequence -> write its latent, absorbed MLA through pallas_kernels.mla_decode

Both take the model as (graphdef, weights) from `split_model(model)` and the per-layer caches as a tuple of
`pallas_kernels.MLAKVCache` (one per decoder layer; all layers share one page numbering), and return
(new caches, float32 logits). They have no side effects, so users can jit them (donating the caches) and call
them inside their own jax.jit / lax.while_loop (tests/test_engine_steps.py drives a greedy decode that way). The
LLM class jits them once per shape bucket. `plan` (a mla_jax.sharding.ShardingPlan) runs them over several
devices; None = one device.

The cache stores FlashMLA's 576 = latent 512 | rope 64 per token; a model with a smaller kv_lora_rank or
qk_rope_head_dim (tests, small checkpoints) is stored zero-padded, which leaves every dot product unchanged.
Padding rows / tokens use slot -1 (MLAKVCache.write skips it) and seq_len 0 / chunk_len 0.

Shapes: B sequences (decode), N sequences × C chunk tokens (prefill), D hidden, H heads, Nn nope, R rope,
Cl kv_lora (latent), V v_head, P block-table width (pages), ps page size.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from mla_jax import sharding
from mla_jax.config import ModelConfig
from mla_jax.model.layers import matmul_precision
from pallas_kernels.mla_decode.cache import LATENT_DIM, ROPE_DIM


class EngineWeights(NamedTuple):
    """The model's parameters (nnx.State) plus, per layer, the absorbed MLA weights (w_uk [H, Nn, Cl],
    w_uv [H, V, Cl]) computed once (for AWQ models this dequantizes kv_b_proj once instead of every step)."""
    model: nnx.State
    absorbed: tuple[tuple[jax.Array, jax.Array], ...]


def split_model(model) -> tuple[nnx.GraphDef, EngineWeights]:
    """(graphdef, EngineWeights) for the step functions. graphdef is hashable: pass it as a static argument."""
    absorbed = tuple(tuple(layer.self_attn.absorbed_weights()) for layer in model.layers)
    graphdef, state = nnx.split(model)
    return graphdef, EngineWeights(state, absorbed)


def allocate_caches(cfg: ModelConfig, num_pages: int, *, page_size: int = 64, dtype="bfloat16"):
    """One empty `pallas_kernels.MLAKVCache` per decoder layer, as a tuple (the step functions' cache state).
    dtype: "bfloat16" | "fp8_e4m3" | "float32" (float32: xla backend only)."""
    check_cache_fits(cfg)
    return tuple(pallas_kernels.MLAKVCache.allocate(num_pages, page_size=page_size, dtype=dtype)
                 for _ in range(cfg.num_hidden_layers))


def decode_query_dtype(cache) -> jnp.dtype:
    """dtype of the absorbed query handed to mla_decode: float32 for a float32 cache (xla exactness path), else
    bfloat16 (the kernels' query dtype, docs/architecture.md §3)."""
    return jnp.float32 if cache.dtype == "float32" else jnp.bfloat16


# ---------------------------------------------------------------------------------------------------------------
def decode_step(graphdef: nnx.GraphDef, weights: EngineWeights, caches: Sequence, tokens: jax.Array,
                positions: jax.Array, slots: jax.Array, block_table: jax.Array, seq_lens: jax.Array, *,
                backend: str = "xla", interpret: bool = False, plan=None) -> tuple[tuple, jax.Array]:
    """One decode step for B sequences, absorbed MLA (docs/architecture.md §5).

    tokens int32 [B]: each sequence's newest token; positions int32 [B]: its position; slots int32 [B]: the cache
    slot it is written to (block_table[b, pos // ps] * ps + pos % ps); block_table int32 [B, P]; seq_lens int32 [B]
    = positions + 1 (padding rows: seq_len 0 and slot -1, which the cache write skips).
    backend: a pallas_kernels.mla_decode backend ("xla", "triton", "mosaic_sm90"; resolve "auto" once outside, so
    the choice is logged once). plan: a mla_jax.sharding.ShardingPlan to run over several devices (None: one).
    Returns (caches, logits float32 [B, vocab]).
    """
    ops = sharding.ops(plan)
    model = nnx.merge(graphdef, weights.model)
    cfg: ModelConfig = model.cfg
    prec = matmul_precision(model.dtype)
    h = ops.decode_rows(model.embed(tokens))                                        # [B, D]
    # the split-KV schedule depends only on seq_lens and the shapes: once per step, shared by every layer (one
    # device; under a sharding plan each island computes its own)
    shared = {}
    if plan is None:
        schedule = pallas_kernels.mla_decode_schedule(
            seq_lens, block_table, num_heads=cfg.num_attention_heads, cache_dtype=caches[0].dtype,
            backend=backend, interpret=interpret)
        if schedule is not None:
            shared = dict(schedule=schedule)
    new_caches = []
    for layer, cache, (w_uk, w_uv) in zip(model.layers, caches, weights.absorbed):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_nope, q_rope = attn.project_q(x, positions)                               # [B,H,Nn], [B,H,R]
        latent, k_rope = attn.project_kv(x, positions)                              # [B,Cl],   [B,R]
        cache = ops.write_cache(cache, slots, _pad_to(latent, LATENT_DIM), _pad_to(k_rope, ROPE_DIM))
        # q_lat is rounded to the model dtype here and to the kernel's bf16 query next, so a model-dtype result
        # loses nothing (and XLA:CPU has no batched bf16 x bf16 -> f32 dot for this layout).
        qdt = decode_query_dtype(cache)
        q_lat = jnp.einsum("bhn,hnc->bhc", q_nope, w_uk, preferred_element_type=h.dtype,
                           precision=prec)                                          # [B,H,Cl]
        # q's two parts apart (mla_decode's q_rope): the mosaic kernels read each where it is, so q = [q_lat |
        # q_rope] is never written; the other backends concatenate them
        q_lat = _pad_to(q_lat.astype(qdt), LATENT_DIM)[:, None]                   # [B,1,H,512]
        q_rope = _pad_to(q_rope.astype(qdt), ROPE_DIM)[:, None]                   # [B,1,H,64]
        o_lat, _ = ops.mla_decode(q_lat, cache, block_table, seq_lens, q_rope=q_rope,
                                  softmax_scale=cfg.softmax_scale, causal=False, backend=backend,
                                  interpret=interpret, **shared)
        o_lat = o_lat[:, 0, :, : cfg.kv_lora_rank]                                  # [B,H,Cl]
        o = jnp.einsum("bhc,hvc->bhv", o_lat.astype(w_uv.dtype), w_uv, preferred_element_type=h.dtype,
                       precision=prec)                                              # [B,H,V]
        h = h + attn.output(o)
        h = h + ops.mlp(layer.mlp, layer.post_attention_layernorm(h), decode=True)
        new_caches.append(cache)
    return ops.caches(tuple(new_caches)), model.logits(h)


# ---------------------------------------------------------------------------------------------------------------
def prefill_step(graphdef: nnx.GraphDef, weights: EngineWeights, caches: Sequence, tokens: jax.Array,
                 positions: jax.Array, slots: jax.Array, block_table: jax.Array, prefix_lens: jax.Array,
                 chunk_lens: jax.Array, *, all_logits: bool = False, plan=None) -> tuple[tuple, jax.Array]:
    """One chunked-prefill step for N sequences, each with a chunk of up to C tokens.

    tokens int32 [N, C], positions int32 [N, C] (= prefix_lens[n] + c), slots int32 [N, C] (-1 for padding tokens
    c >= chunk_lens[n]: the cache write skips them), block_table int32 [N, P] (pages holding each sequence's first
    P·ps tokens; P may be 0 when no row has a cached prefix), prefix_lens int32 [N] (tokens already cached),
    chunk_lens int32 [N] (valid tokens in the chunk; 0 for padding rows).
    Attention is non-absorbed: the cached prefix is read back (dequantized) and expanded through kv_b_proj, the
    chunk's own keys/values come from its fresh latents; each chunk token sees the prefix and the chunk tokens up
    to itself. The chunk's latents are written to the cache.
    plan: a mla_jax.sharding.ShardingPlan to run over several devices (None: one); attention runs head-parallel.
    Returns (caches, logits float32 [N, vocab] of each row's last valid token), or [N, C, vocab] with all_logits.
    """
    ops = sharding.ops(plan)
    model = nnx.merge(graphdef, weights.model)
    cfg: ModelConfig = model.cfg
    prec = matmul_precision(model.dtype)
    N, C = tokens.shape
    P = block_table.shape[1]
    h = model.embed(tokens)                                                          # [N,C,D]

    q_idx = jnp.arange(C, dtype=jnp.int32)
    chunk_mask = (q_idx[None, :, None] >= q_idx[None, None, :]) & (q_idx[None, None, :] < chunk_lens[:, None, None])
    if P:
        ps = caches[0].page_size
        key_pos = jnp.arange(P * ps, dtype=jnp.int32)
        prefix_valid = key_pos[None, :] < prefix_lens[:, None]                      # [N, P·ps]
        mask = jnp.concatenate(
            [jnp.broadcast_to(prefix_valid[:, None, :], (N, C, P * ps)), chunk_mask], axis=-1)  # [N,C,P·ps+C]
    else:
        mask = chunk_mask                                                            # [N,C,C]

    new_caches = []
    for layer, cache in zip(model.layers, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_nope, q_rope = attn.project_q(x, positions)                               # [N,C,H,Nn], [N,C,H,R]
        q_nope, q_rope = ops.heads(q_nope, -2), ops.heads(q_rope, -2)
        latent, k_rope = attn.project_kv(x, positions)                              # [N,C,Cl],   [N,C,R]
        if P:
            pre_lat, pre_rope = ops.read_pages(cache, block_table)               # [N,P·ps,576 split]
            pre_lat, pre_rope = pre_lat[..., : cfg.kv_lora_rank], pre_rope[..., : cfg.qk_rope_head_dim]
            # free / stale pages may hold anything (even NaN): zero what the mask will drop, so 0·NaN never occurs
            pre_lat = jnp.where(prefix_valid[..., None], pre_lat, 0).astype(latent.dtype)
            pre_rope = jnp.where(prefix_valid[..., None], pre_rope, 0).astype(k_rope.dtype)
            all_lat = jnp.concatenate([pre_lat, latent], axis=1)
            all_rope = jnp.concatenate([pre_rope, k_rope], axis=1)
        else:
            all_lat, all_rope = latent, k_rope
        cache = ops.write_cache(cache, slots.reshape(-1), _pad_to(latent.reshape(N * C, -1), LATENT_DIM),
                                _pad_to(k_rope.reshape(N * C, -1), ROPE_DIM))
        k_nope, v = attn.expand_kv(all_lat)                                          # [N,K,H,Nn], [N,K,H,V]
        k_nope, v = ops.heads(k_nope, -2), ops.heads(v, -2)
        scores = (
            jnp.einsum("nqhd,nkhd->nhqk", q_nope, k_nope, preferred_element_type=jnp.float32, precision=prec)
            + jnp.einsum("nqhr,nkr->nhqk", q_rope, all_rope, preferred_element_type=jnp.float32, precision=prec)
        ) * cfg.softmax_scale
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[:, None], probs, 0.0)   # rows of padding tokens (all masked) become 0, not NaN
        o = jnp.einsum("nhqk,nkhv->nqhv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                       precision=prec)
        h = h + attn.output(o.astype(h.dtype))
        h = h + ops.mlp(layer.mlp, layer.post_attention_layernorm(h), decode=False)
        new_caches.append(cache)
    if all_logits:
        return ops.caches(tuple(new_caches)), model.logits(h)
    last = jnp.clip(chunk_lens - 1, 0, C - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]              # [N, D]
    return ops.caches(tuple(new_caches)), model.logits(h_last)


# ---- cache format (owned by pallas_kernels, docs/architecture.md §2) -------------------------------------------
def check_cache_fits(cfg: ModelConfig) -> None:
    """The cache format is FlashMLA's (latent 512 | rope 64). Smaller models (tests, small checkpoints) are stored
    zero-padded, which leaves every dot product unchanged (and, for fp8, every tile's amax); larger ones cannot
    be stored."""
    if cfg.kv_lora_rank > LATENT_DIM or cfg.qk_rope_head_dim > ROPE_DIM:
        raise ValueError(f"the paged MLA cache stores latents of <= {LATENT_DIM} and rope keys of <= {ROPE_DIM} "
                         f"dims; this model has kv_lora_rank={cfg.kv_lora_rank}, qk_rope_head_dim="
                         f"{cfg.qk_rope_head_dim}")


def _pad_to(x: jax.Array, n: int) -> jax.Array:
    """Zero-pads the last axis of x to n (see check_cache_fits)."""
    if x.shape[-1] == n:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
