"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds, and the logprob of the chosen token.

Every row is handled on its own: its random key is fold_in(key(seed), step) where step counts the tokens the
request has generated so far, and its filters are its own, so a request's tokens do not depend on which other
requests share the batch (or on preemption and recompute). Sampling uses the Gumbel-max trick:
argmax(filtered logits / T + Gumbel noise) is a draw from softmax(filtered logits / T).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [B, V] float32 -> same with tokens outside top-k / top-p set to -inf.

    top_k <= 0 or >= V and top_p >= 1 leave a row exactly unchanged (so a row's result never depends on whether
    another row needed filtering). top-p is applied to the distribution renormalized after top-k (vLLM's order);
    tokens tied with the cut-off value are kept.
    """
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)                                   # [B, V]
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)[:, None]
    in_top_k = rank < k
    masked = jnp.where(in_top_k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    exclusive_cumsum = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = in_top_k & ((exclusive_cumsum < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep_sorted = keep_sorted.at[:, 0].set(True)                                # the best token always stays
    # cut-off = smallest kept value (kept entries are a prefix of the sorted row)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row.

    logits float32 [B, V]; temperature float32 [B] (0 = greedy); top_k int32 [B] (<= 0 = off);
    top_p float32 [B] (1 = off); seeds uint32 [B]; steps int32 [B] (tokens generated so far by the request).
    Returns (tokens int32 [B], logprobs float32 [B]) where logprobs = log_softmax(logits)[token] (the model's
    distribution before temperature and filters).
    """
    logits = logits.astype(jnp.float32)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = temperature <= 0.0

    def sampled_tokens(_):
        safe_t = jnp.where(is_greedy, 1.0, temperature)
        scaled = logits / safe_t[:, None]
        needs_filter = jnp.any(((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0))
        scaled = jax.lax.cond(needs_filter, lambda s: _filter_top_k_top_p(s, top_k, top_p), lambda s: s, scaled)

        def gumbel_row(seed, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.gumbel(key, (logits.shape[-1],), dtype=jnp.float32)

        noise = jax.vmap(gumbel_row)(seeds, steps)
        drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_tokens, drawn)

    tokens = jax.lax.cond(jnp.all(is_greedy), lambda _: greedy_tokens, sampled_tokens, None)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
