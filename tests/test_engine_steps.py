"""The public step functions: driven from a user's own jax.jit + lax.while_loop (greedy decode) they give what
LLM.generate gives; the LLM compiles nothing new in steady state; teacher-forced logprobs through the triton
kernel (interpret mode) on bf16 / fp8 caches stay close to HF transformers (fp32)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.engine import EngineWeights, allocate_caches, decode_step, prefill_step, split_model
from mla_jax.engine.llm import LLM
from mla_jax.engine.params import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# the engine configuration of test_engine_hf.py's v3_yarn engine: equal shapes share compiled steps in one run
V3_ENGINE = dict(attention_backend="xla", max_model_len=48, page_size=4, num_pages=16, max_num_seqs=4,
                 max_num_batched_tokens=8)


def golden(name):
    with open(os.path.join(FIXTURES, name, "generate_golden.json")) as f:
        return json.load(f)


def layout(prompts, total_len, page_size):
    """Block table giving each sequence its own pages (page 0 left unused), padded prompt tokens."""
    n = len(prompts)
    width = -(-total_len // page_size)
    block_table = (1 + np.arange(n * width, dtype=np.int32)).reshape(n, width)
    c = max(len(p) for p in prompts)
    tokens = np.zeros((n, c), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    return block_table, n * width + 1, tokens, lens


def slots_of(block_table, pos, page_size):
    """Cache slots of positions pos [N, ...] (jnp), -1 where pos < 0."""
    page = jnp.take_along_axis(block_table, (jnp.maximum(pos, 0) // page_size).reshape(pos.shape[0], -1), axis=1)
    slot = page.reshape(pos.shape) * page_size + jnp.maximum(pos, 0) % page_size
    return jnp.where(pos >= 0, slot, -1).astype(jnp.int32)


def test_user_while_loop_greedy_decode_matches_generate():
    name, ps, n_new = "v3_yarn", 4, 12
    g = golden(name)
    prompts = [g["prompts"][1], g["prompts"][2], g["prompts"][0]]             # lengths 6, 13, 1
    model, cfg = mla_jax.load_model(os.path.join(FIXTURES, name), dtype="float32")
    graphdef, weights = split_model(model)
    assert isinstance(weights, EngineWeights)
    block_table, num_pages, tokens, lens = layout(prompts, max(map(len, prompts)) + n_new, ps)
    caches = allocate_caches(cfg, num_pages, page_size=ps, dtype="float32")
    # poison the whole pool: nothing may read a slot that was not written
    caches = tuple(type(c)(latent=jnp.full_like(c.latent, jnp.nan), rope=jnp.full_like(c.rope, jnp.nan),
                           scale=c.scale, page_size=c.page_size) for c in caches)

    @jax.jit
    def greedy(weights, caches, tokens, lens, block_table):
        n, c = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c))
        slots = slots_of(block_table, jnp.where(pos < lens[:, None], pos, -1), ps)
        caches, logits = prefill_step(graphdef, weights, caches, tokens, pos, slots, block_table[:, :0],
                                      jnp.zeros(n, jnp.int32), lens)
        out = jnp.zeros((n, n_new), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1))

        def body(state):
            i, caches, out = state
            pos = lens + i - 1                            # position of the token fed now (out[:, i - 1])
            caches, logits = decode_step(graphdef, weights, caches, out[:, i - 1], pos,
                                         slots_of(block_table, pos[:, None], ps)[:, 0], block_table, pos + 1,
                                         backend="xla")
            return i + 1, caches, out.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32))

        _, caches, out = jax.lax.while_loop(lambda s: s[0] < n_new, body, (1, caches, out))
        return caches, out

    _, out = greedy(weights, caches, tokens, lens, block_table)
    out = np.asarray(out)

    llm = LLM.from_model(model, **V3_ENGINE)
    gen = llm.generate(prompts, SamplingParams(max_tokens=n_new, ignore_eos=True))
    for i, o in enumerate(gen):
        assert o.token_ids == out[i].tolist()
    # and both are HF's greedy continuation
    assert out.tolist() == [g["token_ids"][1][:n_new], g["token_ids"][2][:n_new], g["token_ids"][0][:n_new]]


def test_no_recompilation_in_steady_state():
    """After a warm-up, new requests of the same shape buckets (other tokens, other sampling parameter values,
    other seeds) compile nothing: one compiled variant per bucket. The warm-up runs the same batch sizes, prompt
    lengths and max_tokens as the measured round (chunked prefill splits prompts by those, so they pick the
    prefill buckets)."""
    llm = LLM(os.path.join(FIXTURES, "v3_yarn"), dtype="float32", **V3_ENGINE)
    rng = np.random.default_rng(0)
    vocab = llm.cfg.vocab_size

    def batch(k):
        return [[int(t) for t in rng.integers(2, vocab, size=5)] for _ in range(k)]

    def round_(temperature, top_p, seed):
        # ignore_eos: a sampled eos would change the batch composition, i.e. the buckets, between rounds
        llm.generate(batch(3), SamplingParams(temperature=temperature, top_k=5, max_tokens=6, seed=seed,
                                              ignore_eos=True))
        llm.generate(batch(4), [SamplingParams(max_tokens=k, ignore_eos=True, logprobs=True) for k in (1, 4, 6, 2)])
        llm.generate(batch(1) + batch(1), SamplingParams(temperature=temperature, top_p=top_p, max_tokens=5,
                                                         ignore_eos=True))

    round_(0.7, 0.9, 11)                                     # warm-up
    warm = llm.num_compiles()
    assert warm >= 3
    round_(0.9, 0.5, 1)
    round_(1.3, 0.8, 7)
    assert llm.num_compiles() == warm


# ---- bf16 / fp8 caches through the triton kernel (interpret mode) vs HF fp32 ---------------------------------
def teacher_forced_logprobs(model, cfg, g, *, cache_dtype, backend, interpret, ps=16):
    """log p(HF's token) at every generated position, feeding HF's tokens (prefill the prompt, then one decode
    step per token): measures the engine's numerics without trajectories diverging."""
    graphdef, weights = split_model(model)
    prompts, gen = g["prompts"], g["token_ids"]
    T = g["max_new_tokens"]
    block_table, num_pages, tokens, lens = layout(prompts, max(map(len, prompts)) + T, ps)
    caches = allocate_caches(cfg, num_pages, page_size=ps, dtype=cache_dtype)
    n, c = tokens.shape
    pos = np.broadcast_to(np.arange(c, dtype=np.int32), (n, c))
    slots = slots_of(jnp.asarray(block_table), jnp.asarray(np.where(pos < lens[:, None], pos, -1)), ps)
    caches, logits = jax.jit(prefill_step, static_argnums=0)(graphdef, weights, caches, tokens, pos, slots,
                                                             block_table[:, :0], np.zeros(n, np.int32), lens)
    forced = np.asarray(gen, np.int32)                                          # [N, T]
    lp = [jax.nn.log_softmax(logits)[np.arange(n), forced[:, 0]]]
    step = jax.jit(decode_step, static_argnums=0, static_argnames=("backend", "interpret"), donate_argnums=2)
    for t in range(1, T):
        p = lens + t - 1
        caches, logits = step(graphdef, weights, caches, forced[:, t - 1], p,
                              slots_of(jnp.asarray(block_table), jnp.asarray(p[:, None]), ps)[:, 0], block_table,
                              p + 1, backend=backend, interpret=interpret)
        lp.append(jax.nn.log_softmax(logits)[np.arange(n), forced[:, t]])
    return np.stack([np.asarray(x) for x in lp], 1)                             # [N, T]


@pytest.mark.parametrize("model_dtype, cache_dtype, tol", [
    ("float32", "bfloat16", 0.03),
    ("float32", "fp8_e4m3", 0.15),
    ("bfloat16", "fp8_e4m3", 0.25),
])
def test_triton_kernel_caches_stay_close_to_hf(model_dtype, cache_dtype, tol, record_property):
    g = golden("real_dims")                       # real MLA dims: latent 512 | rope 64, nope 128, v 128
    model, cfg = mla_jax.load_model(os.path.join(FIXTURES, "real_dims"), dtype=model_dtype)
    lp = teacher_forced_logprobs(model, cfg, g, cache_dtype=cache_dtype, backend="triton", interpret=True)
    diff = np.abs(lp - np.asarray(g["logprobs"]))
    assert np.isfinite(lp).all()
    print(f"\nreal_dims {model_dtype} model, {cache_dtype} cache, triton (interpret) vs HF fp32: teacher-forced "
          f"|d logprob| max {diff.max():.4f} mean {diff.mean():.4f} over {diff.size} tokens")
    record_property("max_abs_logprob_diff", float(diff.max()))
    assert diff.max() < tol
