"""Held-out perplexity of a trained checkpoint through the engine's paths (scripts/eval_ppl.py is the command line).

Data: `heldout_windows` reads the held-out files recorded in the model's training.json (see mla_train.corpus),
tokenizes them as in training and cuts windows of seq_len + 1 tokens. Each scorer returns the per-token NLL
[N, seq_len] of the windows by teacher forcing (the true next token is fed, its log-probability is read):
  score_forward  model(ids): full causal forward, no cache (the reference for the weights)
  score_decode   prefill_step on the first token, then decode_step for every later position: absorbed MLA through
                 pallas_kernels.mla_decode on the paged cache, with the chosen backend
  score_prefill  chunked prefill_step (all_logits): each chunk attends to its prefix read back from the paged
                 cache (dequantized), so the cache dtype shows here too; pure XLA
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.engine.steps import allocate_caches, decode_step, prefill_step, split_model
from mla_jax.engine.text import Tokenizer
from mla_train.corpus import load_heldout_files
from mla_train.tokenizer import eval_windows, token_stream
from mla_train.trainer import token_nll


def heldout_windows(model_dir: str, seq_len: int, num_seqs: int, corpus_root=None, select: str = "spread"):
    """num_seqs windows [num_seqs, seq_len + 1] of the test stream of model_dir (its training.json's held-out
    files in sorted path order, tokenized by its tokenizer.json): "spread" takes them evenly over the whole stream,
    "first" the first num_seqs (which cover only the first few files). num_seqs 0: every window.
    Returns (windows, stats of the held-out files as load_heldout_files counts them)."""
    tok = Tokenizer.from_dir(model_dir)
    if tok is None:
        raise ValueError(f"{model_dir} has no tokenizer.json")
    files, stats = load_heldout_files(model_dir, corpus_root)
    stream = token_stream(tok.backend, files)
    windows = eval_windows(stream, seq_len)
    if num_seqs and num_seqs < len(windows):
        if select == "first":
            windows = windows[:num_seqs]
        elif select == "spread":
            windows = windows[np.linspace(0, len(windows) - 1, num_seqs).round().astype(int)]
        else:
            raise ValueError(f"window selection {select!r}: use 'spread' or 'first'")
    return windows, stats


def _slots(block_table: np.ndarray, pos: np.ndarray, page_size: int) -> np.ndarray:
    """Cache slot of position pos[n, ...] of sequence n."""
    page = np.take_along_axis(block_table, (pos // page_size).reshape(len(block_table), -1), axis=1)
    return (page.reshape(pos.shape) * page_size + pos % page_size).astype(np.int32)


def _layout(n: int, s: int, page_size: int):
    pages = -(-s // page_size)
    block_table = (1 + np.arange(n * pages, dtype=np.int32)).reshape(n, pages)  # page 0: unused scratch
    return block_table, n * pages + 1


def score_forward(model, windows: np.ndarray, batch: int) -> np.ndarray:
    """Per-token NLL [N, S] of model(ids), `batch` windows at a time."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, w):
        return token_nll(nnx.merge(graphdef, state)(w[:, :-1]), w[:, 1:])

    return np.concatenate([np.asarray(nll(state, jnp.asarray(windows[i:i + batch])))
                           for i in range(0, len(windows), batch)])


def score_decode(model, windows: np.ndarray, cache_dtype: str, backend: str, interpret: bool,
                 page_size: int = 64) -> np.ndarray:
    """Per-token NLL [N, S]: token 0 by prefill_step, tokens 1..S-1 by one decode_step each."""
    cfg = model.cfg
    n, s = windows.shape[0], windows.shape[1] - 1
    graphdef, weights = split_model(model)
    block_table, num_pages = _layout(n, s, page_size)
    caches = allocate_caches(cfg, num_pages, page_size=page_size, dtype=cache_dtype)
    w = jnp.asarray(windows)

    @jax.jit
    def first(weights, caches, tokens, slots):
        caches, logits = prefill_step(graphdef, weights, caches, tokens, jnp.zeros_like(tokens), slots,
                                      jnp.zeros((n, 0), jnp.int32), jnp.zeros((n,), jnp.int32),
                                      jnp.ones((n,), jnp.int32), all_logits=True)
        return caches, logits[:, 0]

    def step(weights, caches, tokens, positions, slots, block_table, targets):
        caches, logits = decode_step(graphdef, weights, caches, tokens, positions, slots, block_table,
                                     positions + 1, backend=backend, interpret=interpret)
        return caches, token_nll(logits, targets)

    step = jax.jit(step, donate_argnums=(1,))
    caches, logits0 = first(weights, caches, w[:, :1], jnp.asarray(_slots(block_table, np.zeros((n, 1), int),
                                                                           page_size)))
    out = [token_nll(logits0, w[:, 1])]
    bt = jnp.asarray(block_table)
    for t in range(1, s):
        pos = np.full((n,), t, np.int32)
        caches, nll = step(weights, caches, w[:, t], jnp.asarray(pos),
                           jnp.asarray(_slots(block_table, pos, page_size)), bt, w[:, t + 1])
        out.append(nll)
    return np.asarray(jnp.stack(out, axis=1))


def score_prefill(model, windows: np.ndarray, cache_dtype: str, chunk: int, page_size: int = 64) -> np.ndarray:
    """Per-token NLL [N, S] by chunked prefill: chunk c attends to positions < c·chunk read from the cache."""
    cfg = model.cfg
    n, s = windows.shape[0], windows.shape[1] - 1
    if s % chunk:
        raise ValueError(f"--seq-len {s} must be a multiple of --chunk {chunk}")
    graphdef, weights = split_model(model)
    block_table, num_pages = _layout(n, s, page_size)
    caches = allocate_caches(cfg, num_pages, page_size=page_size, dtype=cache_dtype)

    def step(weights, caches, tokens, positions, slots, block_table, prefix_lens, targets):
        caches, logits = prefill_step(graphdef, weights, caches, tokens, positions, slots, block_table,
                                      prefix_lens, jnp.full((n,), chunk, jnp.int32), all_logits=True)
        return caches, token_nll(logits, targets)

    step = jax.jit(step, donate_argnums=(1,))
    out = []
    for c0 in range(0, s, chunk):
        pos = np.broadcast_to(c0 + np.arange(chunk, dtype=np.int32), (n, chunk))
        caches, nll = step(weights, caches, jnp.asarray(windows[:, c0:c0 + chunk]), jnp.asarray(pos),
                           jnp.asarray(_slots(block_table, pos, page_size)), jnp.asarray(block_table),
                           jnp.full((n,), c0, jnp.int32), jnp.asarray(windows[:, c0 + 1:c0 + chunk + 1]))
        out.append(nll)
    return np.asarray(jnp.concatenate(out, axis=1))
