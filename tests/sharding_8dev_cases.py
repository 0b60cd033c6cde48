"""Multi-device tests of mla_jax.sharding on 8 simulated CPU devices.

Not collected by the main pytest run (the name does not start with test_): XLA_FLAGS must be set before jax
creates its CPU client, so tests/test_sharding.py runs this file in a fresh process. Run it directly with
    python -m pytest -q tests/sharding_8dev_cases.py
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_kernels  # noqa: E402
from mla_jax import sharding  # noqa: E402
from mla_jax.checkpoint.sharded import load_sharded  # noqa: E402
from mla_jax.config import AWQConfig, ModelConfig  # noqa: E402
from mla_jax.sharding import AXIS, ShardingPlan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "v3_yarn")


def setup_module():
    if jax.device_count() < 8:
        pytest.fail(f"needs 8 CPU devices, got {jax.device_count()}: XLA_FLAGS was set too late (another import "
                    "initialized jax first); run this file on its own")


def tiny_cfg(**over):
    d = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=8, q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=16,
             qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
             n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
             topk_method="noaux_tc", first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1)
    d.update(over)
    return ModelConfig.from_hf_dict(d)


def plan(n, dp=False, cfg=None):
    return ShardingPlan.create(cfg or tiny_cfg(), n, dp)


def spec_of(x):
    return tuple(x.sharding.spec) if hasattr(x.sharding, "spec") else None


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


# ---------------------------------------------------------------------------------------------------------------
# mla_decode island
# ---------------------------------------------------------------------------------------------------------------

def random_cache(key, num_pages, page_size, dtype, poison_free=()):
    """A cache with random contents; pages in poison_free hold NaN (they must never be read)."""
    k1, k2 = jax.random.split(key)
    T = num_pages * page_size
    cache = pallas_kernels.MLAKVCache.allocate(num_pages, page_size=page_size, dtype=dtype)
    lat = jax.random.normal(k1, (T, 512), jnp.float32)
    rope = jax.random.normal(k2, (T, 64), jnp.float32)
    cache = cache.write(jnp.arange(T, dtype=jnp.int32), lat, rope)
    if poison_free:
        idx = jnp.asarray(poison_free)
        cache = type(cache)(latent=cache.latent.at[idx].set(jnp.nan), rope=cache.rope.at[idx].set(jnp.nan),
                            scale=cache.scale, page_size=cache.page_size)
    return cache


def dp_block_table(rng, n_dev, rows_per_dev, pages_per_dev, max_pages, page_size):
    """Each row takes random pages of its own device's range (global ids) and a random length; padding entries
    point at global page 0 (owned by device 0). Returns block_table, seq_lens, used pages."""
    B = n_dev * rows_per_dev
    bt = np.zeros((B, max_pages), np.int32)
    lens = np.zeros(B, np.int32)
    used = set()
    for d in range(n_dev):
        free = list(range(d * pages_per_dev + 1, (d + 1) * pages_per_dev))   # local page 0 stays scratch
        rng.shuffle(free)
        for r in range(rows_per_dev):
            b = d * rows_per_dev + r
            L = int(rng.integers(0, max_pages * page_size + 1)) if r else 0 if d == 1 else max_pages * page_size
            n = -(-L // page_size)
            pages = [free.pop() for _ in range(n)]
            bt[b, :n] = pages
            used.update(pages)
            lens[b] = L
    return bt, lens, used


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3"])   # float32: through the engine tests below
def test_mla_decode_dp_attention_island_matches_one_device(cache_dtype):
    n, rows, ppd, ps, maxp, H = 8, 2, 7, 16, 3, 4
    rng = np.random.default_rng(0)
    bt, lens, used = dp_block_table(rng, n, rows, ppd, maxp, ps)
    free = [p for p in range(n * ppd) if p not in used and p % ppd]          # keep the scratch pages finite
    cache = random_cache(jax.random.key(1), n * ppd, ps, cache_dtype, poison_free=free)
    qdt = jnp.float32 if cache_dtype == "float32" else jnp.bfloat16
    q = jax.random.normal(jax.random.key(2), (n * rows, 1, H, 576), jnp.float32).astype(qdt)
    kw = dict(softmax_scale=0.1, causal=False, backend="xla")
    want_o, want_lse = pallas_kernels.mla_decode(q, cache, jnp.asarray(bt), jnp.asarray(lens), **kw)

    pl = plan(n, dp=True)
    cache_s = jax.device_put(cache, pl.cache_shardings(cache))
    assert shard_shapes(cache_s.latent) == {(ppd, ps, 512)}          # each device holds 1/8 of the pages
    rows_s = pl.sharding(P(AXIS))
    fn = jax.jit(lambda q, c, bt, sl: pl.mla_decode(q, c, bt, sl, **kw))
    o, lse = fn(jax.device_put(q, rows_s), cache_s, jax.device_put(bt, rows_s), jax.device_put(lens, rows_s))
    assert spec_of(o)[0] == AXIS and spec_of(lse)[0] == AXIS
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o, np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    assert np.isinf(np.asarray(lse)[lens == 0]).all()                 # the length-0 row
    # q's two parts apart (the engine's call), split over rows as q is: the same bits
    fn = jax.jit(lambda a, r, c, bt, sl: pl.mla_decode(a, c, bt, sl, q_rope=r, **kw))
    o2, lse2 = fn(jax.device_put(q[..., :512], rows_s), jax.device_put(q[..., 512:], rows_s), cache_s,
                  jax.device_put(bt, rows_s), jax.device_put(lens, rows_s))
    assert spec_of(o2)[0] == AXIS
    np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@pytest.mark.parametrize("n", [4])
def test_mla_decode_tp_island_matches_one_device(n):
    B, ps, num_pages, maxp, H = 3, 16, 10, 3, 8
    rng = np.random.default_rng(n)
    perm = rng.permutation(np.arange(1, num_pages))[: B * maxp].reshape(B, maxp).astype(np.int32)
    lens = np.array([5, 0, maxp * ps], np.int32)
    free = [int(p) for p in perm[0, 1:]] + [int(p) for p in perm[1]]      # beyond each row's length: poison
    cache = random_cache(jax.random.key(3), num_pages, ps, "float32", poison_free=free)
    q = jax.random.normal(jax.random.key(4), (B, 1, H, 576), jnp.float32)
    kw = dict(softmax_scale=0.1, causal=False, backend="xla")
    want_o, want_lse = pallas_kernels.mla_decode(q, cache, jnp.asarray(perm), jnp.asarray(lens), **kw)

    pl = plan(n)
    cache_s = jax.device_put(cache, pl.cache_shardings(cache))
    assert cache_s.latent.sharding.is_fully_replicated
    o, lse = jax.jit(lambda q, c, bt, sl: pl.mla_decode(q, c, bt, sl, **kw))(
        jax.device_put(q, pl.sharding(P(None, None, AXIS))), cache_s, perm, lens)
    assert spec_of(o)[2] == AXIS and spec_of(lse)[1] == AXIS        # heads split
    # fp32 on both sides; XLA's CPU dot blocks differently for H/n heads, hence not bitwise
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    # q's two parts apart, split over heads as q is: the same bits
    heads = pl.sharding(P(None, None, AXIS))
    o2, lse2 = jax.jit(lambda a, r, c, bt, sl: pl.mla_decode(a, c, bt, sl, q_rope=r, **kw))(
        jax.device_put(q[..., :512], heads), jax.device_put(q[..., 512:], heads), cache_s, perm, lens)
    assert spec_of(o2)[2] == AXIS
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_mla_decode_dp_island_is_loud_when_a_live_page_belongs_to_another_device():
    n, ps = 8, 16
    cache = random_cache(jax.random.key(5), n * 2, ps, "float32")
    pl = plan(n, dp=True)
    bt = np.zeros((n, 1), np.int32)
    bt[:, 0] = [2 * d + 1 for d in range(n)]
    bt[3, 0] = 1                                   # row 3 lives on device 3 but names device 0's page
    lens = np.full(n, 4, np.int32)
    q = jnp.ones((n, 1, 2, 576), jnp.float32)
    o, lse = jax.jit(lambda q, c, bt, sl: pl.mla_decode(q, c, bt, sl, softmax_scale=0.1, backend="xla"))(
        q, jax.device_put(cache, pl.cache_shardings(cache)), bt, lens)
    lse = np.asarray(lse)
    assert np.isnan(lse[3]).all() and np.isfinite(np.delete(lse, 3, axis=0)).all()


# ---------------------------------------------------------------------------------------------------------------
# cache write / read with data-parallel attention
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3"])
def test_dp_cache_write_and_read_match_one_device(cache_dtype):
    n, ppd, ps = 8, 3, 4
    num_pages = n * ppd
    rng = np.random.default_rng(7)
    T = 20
    slots = rng.choice(num_pages * ps, size=T, replace=False).astype(np.int32)
    slots[:3] = -1                                                     # padding tokens write nothing
    lat = jax.random.normal(jax.random.key(8), (T, 512), jnp.float32)
    rope = jax.random.normal(jax.random.key(9), (T, 64), jnp.float32)
    base = random_cache(jax.random.key(10), num_pages, ps, cache_dtype)
    want = base.write(jnp.asarray(slots), lat, rope)

    pl = plan(n, dp=True)
    got = jax.jit(lambda c, s, l, r: pl.write_cache(c, s, l, r))(
        jax.device_put(base, pl.cache_shardings(base)), slots, lat, rope)
    for leaf, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert shard_shapes(leaf) == {(ppd, ps, ref.shape[-1])}
        assert spec_of(leaf)[0] == AXIS
        np.testing.assert_array_equal(np.asarray(leaf.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))

    bt = rng.permutation(num_pages)[:10].reshape(5, 2).astype(np.int32)
    lat_all, rope_all = want.dequantize()                               # reference: index the whole pool
    want_l = lat_all[bt].reshape(5, 2 * ps, 512)
    want_r = rope_all[bt].reshape(5, 2 * ps, 64)
    got_l, got_r = jax.jit(lambda c, bt: pl.read_pages(c, bt))(got, bt)
    np.testing.assert_array_equal(np.asarray(got_l), np.asarray(want_l))
    np.testing.assert_array_equal(np.asarray(got_r), np.asarray(want_r))


# ---------------------------------------------------------------------------------------------------------------
# expert parallel
# ---------------------------------------------------------------------------------------------------------------

def experts_module(kind, E=8, D=32, I=16):
    if kind == "dense":
        from mla_jax.model.moe import Experts
        return Experts(E, D, I, dtype=jnp.float32, rngs=nnx.Rngs(0))
    from mla_jax.quant.awq import AWQExperts
    return AWQExperts(AWQConfig(bits=4, group_size=16), E, D, I, dtype=jnp.float32, rngs=nnx.Rngs(0))


# plain Experts under EP (psum combine): through the engine tests (TP2 / TP4 MoE layers)
@pytest.mark.parametrize("kind,n,scatter_rows", [("awq", 8, True)])
def test_expert_parallel_matches_one_device(kind, n, scatter_rows):
    T, K, E = 16, 3, 8
    mod = experts_module(kind, E)
    x = jax.random.normal(jax.random.key(11), (T, 32), jnp.float32)
    idx = jax.random.randint(jax.random.key(12), (T, K), 0, E).astype(jnp.int32)
    idx = idx.at[:, 1].set((idx[:, 0] + 1) % E).at[:, 2].set((idx[:, 0] + 2) % E)   # distinct experts per token
    w = jax.random.uniform(jax.random.key(13), (T, K), jnp.float32)
    graphdef, state = nnx.split(mod)
    want = jax.jit(lambda st, x, i, w: nnx.merge(graphdef, st)(x, i, w))(state, x, idx, w)

    pl = plan(n, dp=scatter_rows)
    state = jax.device_put(state, jax.tree.map(lambda a: pl.sharding(P(AXIS)), state))   # the EXPERTS rule
    for leaf in jax.tree.leaves(state):
        assert shard_shapes(leaf) == {(E // n, *leaf.shape[1:])}

    def f(state, x, idx, w):
        return pl.experts(nnx.merge(graphdef, state), x, idx, w, scatter_rows=scatter_rows)

    got = jax.jit(f)(state, x, idx, w)
    if scatter_rows:
        assert spec_of(got)[0] == AXIS and shard_shapes(got) == {(T // n, 32)}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# expert parallel through all-to-all (mla_jax.expert_parallel)
# ---------------------------------------------------------------------------------------------------------------

def routing(kind, T, K, E, seed):
    """topk_idx [T, K] (distinct experts per token) and random weights. uniform: random experts; skewed: every
    token to experts 0..K-1 (all on device 0 with E/N >= K); strided: token t to t, t+1, .. (mod E)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    elif kind == "skewed":
        idx = np.tile(np.arange(K), (T, 1))
    else:
        idx = (np.arange(T)[:, None] + np.arange(K)[None, :]) % E
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    return jnp.asarray(idx, jnp.int32), jnp.asarray(w)


def sharded_experts(kind, E, n, D=32):
    mod = experts_module(kind, E, D)
    graphdef, state = nnx.split(mod)
    pl = plan(n)
    state = jax.device_put(state, jax.tree.map(lambda a: pl.sharding(P(AXIS)), state))
    return mod, graphdef, state, pl.mesh


@pytest.mark.parametrize("kind", ["dense", "awq"])
@pytest.mark.parametrize("T,route,scatter_rows", [(16, "uniform", True), (16, "uniform", False),
                                                  (13, "uniform", False), (1, "uniform", False),
                                                  (24, "skewed", True), (11, "skewed", False)])
def test_all_to_all_experts_match_one_device_and_the_all_gather_path(kind, T, route, scatter_rows):
    """T not divisible by 8 and T=1 (replicated tokens are padded with rows that send nothing), all tokens routed
    to one device's experts (that device receives 8x its rows; the worst-case capacity holds them)."""
    from mla_jax import expert_parallel
    n, E, K, D = 8, 16, 2, 32
    mod, graphdef, state, mesh = sharded_experts(kind, E, n, D)
    x = jax.random.normal(jax.random.key(T), (T, D), jnp.float32)
    idx, w = routing(route, T, K, E, seed=T)
    want = mod(x, idx, w)

    def a2a(st, x, i, w):
        return expert_parallel.experts_all_to_all(mesh, AXIS, nnx.merge(graphdef, st), x, i, w,
                                                  scatter_rows=scatter_rows, with_overflow=True)

    def ag(st, x, i, w):
        return expert_parallel.experts_all_gather(mesh, AXIS, nnx.merge(graphdef, st), x, i, w,
                                                  scatter_rows=scatter_rows)

    got, overflowed = jax.jit(a2a)(state, x, idx, w)
    ref = jax.jit(ag)(state, x, idx, w)
    assert not bool(overflowed)
    assert got.shape == (T, D) and got.dtype == x.dtype
    if scatter_rows:
        assert spec_of(got)[0] == AXIS and shard_shapes(got) == {(T // n, D)}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(want)).max() > 1e-3                    # the experts did produce something


@pytest.mark.parametrize("route,overflows", [("skewed", True), ("strided", False)])
def test_all_to_all_capacity_overflow_takes_the_all_gather_path_and_drops_nothing(route, overflows):
    """capacity_factor 0.5: 4 of a device's 8 rows fit per peer. Skewed routing sends all 8 of every device's rows
    to device 0 (overflow -> every device takes the all-gather path); strided routing (token t to experts t, t+1,
    t+2 of 8, one expert per device) sends 3 rows to each peer (fits: the all-to-all runs)."""
    from mla_jax import expert_parallel
    n, E, K, T, D = 8, 8, 3, 64, 32
    mod, graphdef, state, mesh = sharded_experts("dense", E, n, D)
    x = jax.random.normal(jax.random.key(5), (T, D), jnp.float32)
    idx, w = routing(route, T, K, E, seed=6)
    want = mod(x, idx, w)
    fn = jax.jit(lambda st, x, i, w: expert_parallel.experts_all_to_all(
        mesh, AXIS, nnx.merge(graphdef, st), x, i, w, scatter_rows=True, capacity_factor=0.5, with_overflow=True))
    got, overflowed = fn(state, x, idx, w)
    assert bool(overflowed) is overflows
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    hlo = fn.lower(state, x, idx, w).compile().as_text()
    assert "all-to-all" in hlo and "all-gather" in hlo and "conditional" in hlo.lower()


def test_all_to_all_path_moves_rows_by_all_to_all_only():
    """With split rows and the worst-case capacity the compiled island has all-to-alls and no all-gather /
    all-reduce / reduce-scatter (the reference path has the reduction): the dispatch really is different."""
    from mla_jax import expert_parallel
    n, E, K, T, D = 8, 16, 2, 16, 32
    mod, graphdef, state, mesh = sharded_experts("dense", E, n, D)
    x = jax.random.normal(jax.random.key(7), (T, D), jnp.float32)
    idx, w = routing("uniform", T, K, E, seed=8)
    rows = plan(n).sharding(P(AXIS))
    args = (state, jax.device_put(x, rows), jax.device_put(idx, rows), jax.device_put(w, rows))
    a2a = jax.jit(lambda st, x, i, w: expert_parallel.experts_all_to_all(mesh, AXIS, nnx.merge(graphdef, st), x, i,
                                                                         w, scatter_rows=True))
    ag = jax.jit(lambda st, x, i, w: expert_parallel.experts_all_gather(mesh, AXIS, nnx.merge(graphdef, st), x, i,
                                                                        w, scatter_rows=True))
    a2a_hlo, ag_hlo = a2a.lower(*args).compile().as_text(), ag.lower(*args).compile().as_text()
    assert a2a_hlo.count("all-to-all-start") + a2a_hlo.count("all-to-all(") >= 4     # x, idx, w out; partials back
    for op in ("all-gather", "all-reduce", "reduce-scatter"):
        assert op not in a2a_hlo, op
    assert "all-to-all" not in ag_hlo and ("reduce-scatter" in ag_hlo or "all-reduce" in ag_hlo)
    np.testing.assert_allclose(np.asarray(a2a(*args)), np.asarray(mod(x, idx, w)), rtol=1e-5, atol=1e-6)


def test_all_to_all_rejects_split_rows_that_do_not_divide_and_bad_options():
    from mla_jax import expert_parallel
    mod, graphdef, state, mesh = sharded_experts("dense", 8, 8)
    x = jnp.ones((12, 32), jnp.float32)
    idx, w = routing("uniform", 12, 2, 8, seed=0)
    with pytest.raises(ValueError, match="12 token rows do not split evenly over 8 devices"):
        expert_parallel.experts_all_to_all(mesh, AXIS, mod, x, idx, w, scatter_rows=True)
    with pytest.raises(ValueError, match="expert_dispatch='ragged'"):
        ShardingPlan.create(tiny_cfg(), 8, expert_dispatch="ragged")
    with pytest.raises(ValueError, match=r"expert_capacity_factor=1.5 must be in \(0, 1\]"):
        ShardingPlan.create(tiny_cfg(), 8, expert_dispatch="all_to_all", expert_capacity_factor=1.5)


# ---------------------------------------------------------------------------------------------------------------
# sharded loading
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,dp", [(8, True)])   # TP loading: through the engine tests
def test_load_sharded_places_every_parameter_by_the_rules_and_matches_load_model(n, dp):
    import mla_jax
    ref, cfg = mla_jax.load_model(FIXTURE, dtype="float32")
    pl = ShardingPlan.create(cfg, n, dp)
    model, cfg2 = load_sharded(FIXTURE, pl, dtype="float32")
    assert cfg2 == cfg
    ref_flat = dict(nnx.to_flat_state(nnx.state(ref)))
    got_flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert ref_flat.keys() == got_flat.keys()
    split = 0
    for path, v in got_flat.items():
        arr = v.get_value()
        want_spec = pl.param_spec(sharding.path_str(path), arr.shape)
        assert arr.sharding.spec == want_spec, path
        assert shard_shapes(arr) == {tuple(arr.sharding.shard_shape(arr.shape))}
        split += want_spec != P()
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(ref_flat[path].get_value()), err_msg=str(path))
    assert split > 10


SHARDING_FIXTURE = os.path.join(HERE, "fixtures", "sharding_dims")


@pytest.fixture(scope="module")
def awq_fixture(tmp_path_factory):
    """sharding_dims quantized to AWQ (group 16) by our packer, and its converted (orbax) directory."""
    from mla_jax.checkpoint.converted import convert_checkpoint
    from mla_jax.quant import pack
    root = tmp_path_factory.mktemp("awq")
    awq_dir = str(root / "awq")
    pack.quantize_checkpoint(SHARDING_FIXTURE, awq_dir, group_size=16)
    conv_dir = str(root / "converted")
    convert_checkpoint(awq_dir, conv_dir, progress=False)
    # a directory as the version 2 converter wrote it (the packed layout's version 2 word order): repacked at load
    from test_convert import convert_as_version_2
    v2_dir = str(root / "converted_v2")
    convert_as_version_2(awq_dir, v2_dir)
    return {"awq_safetensors": awq_dir, "converted_orbax": conv_dir, "converted_orbax_v2": v2_dir}


@pytest.mark.parametrize("which", ["awq_safetensors", "converted_orbax", "converted_orbax_v2"])
def test_awq_checkpoints_load_sharded_tp4(awq_fixture, which):
    import mla_jax
    path = awq_fixture[which]
    # the version 2 directory against the version 3 one: its words must come out repacked, not just equal to a
    # second load of themselves
    ref, cfg = mla_jax.load_model(awq_fixture["converted_orbax" if which.endswith("v2") else which], dtype="float32")
    pl = ShardingPlan.create(cfg, 4, False)
    model, _ = load_sharded(path, pl, dtype="float32")
    ref_flat = dict(nnx.to_flat_state(nnx.state(ref)))
    n_packed = 0
    for path_, v in nnx.to_flat_state(nnx.state(model)):
        arr = v.get_value()
        assert arr.sharding.spec == pl.param_spec(sharding.path_str(path_), arr.shape), path_
        want = ref_flat[path_].get_value()
        assert arr.dtype == want.dtype, path_
        n_packed += str(path_[-1]).endswith("packed") and arr.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(arr.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert n_packed > 10
    q_b = model.layers[0].self_attn.q_b_proj.packed[...]
    # [K_pad/8 words = 256/8, N = 8 heads x 80], 2 of the 8 heads per device
    assert shard_shapes(q_b) == {(32, 8 * 80 // 4)}


# ---------------------------------------------------------------------------------------------------------------
# The engine: LLM(tensor_parallel_size=N, data_parallel_attention=...) vs one device
# ---------------------------------------------------------------------------------------------------------------

PROMPTS = [[3, 17, 5, 9, 22], [7, 1, 2], [5, 9, 14, 2, 77, 101, 6, 3, 3, 8, 12, 40], [30, 31, 32, 33, 34, 35, 36]]
LONG_PROMPTS = [list(range(2, 40)), [9, 8, 7] * 7, list(range(60, 77)), [4]]


def make_llm(**kw):
    import mla_jax
    base = dict(dtype="float32", attention_backend="xla", max_model_len=128, max_num_seqs=8, num_pages=24)
    base.update(kw)
    return mla_jax.LLM(SHARDING_FIXTURE, **base)


def greedy(n=6):
    import mla_jax
    return mla_jax.SamplingParams(temperature=0.0, max_tokens=n, logprobs=True, ignore_eos=True)


@pytest.fixture(scope="module")
def one_device_outputs():
    llm = make_llm()
    return llm.generate(PROMPTS, greedy()), llm.generate(LONG_PROMPTS, greedy(4))


def assert_same(outs, ref):
    for got, want in zip(outs, ref):
        assert got.finish_reason == want.finish_reason == "length"
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tp,dp,dispatch,fused", [(2, False, "all_gather", True), (4, False, "all_gather", True),
                                                  (8, True, "all_gather", True), (2, False, "all_to_all", True),
                                                  (8, True, "all_to_all", True), (2, False, "all_gather", False),
                                                  (8, True, "all_gather", False)])
def test_llm_sharded_greedy_tokens_and_logprobs_match_one_device(one_device_outputs, tp, dp, dispatch, fused):
    """fused: the decode fast path (multi-step while loop, overlap) over the mesh; else the plain path."""
    ref, _ = one_device_outputs
    llm = make_llm(tensor_parallel_size=tp, data_parallel_attention=dp, num_pages=24 if not dp else 32,
                   expert_dispatch=dispatch, fused_decode=fused)
    assert llm.sharding_plan.expert_dispatch == dispatch
    assert (llm._fast is not None) == fused
    decode_before = llm._programs.count("decode")
    assert_same(llm.generate(PROMPTS, greedy()), ref)
    # all prompts prefill in one step, then every decode step has the same batch: one plain decode compilation,
    # or none when every decode step ran in the fast path's loop
    assert llm._programs.count("decode") - decode_before == (0 if fused else 1)
    compiles = llm.num_compiles()
    assert_same(llm.generate(PROMPTS, greedy()), ref)
    assert llm.num_compiles() == compiles

    latent = llm.caches[0].latent
    q_b = llm.weights.model["layers"][0]["self_attn"]["q_b_proj"]["kernel"].get_value()
    w_gate = llm.weights.model["layers"][1]["mlp"]["experts"]["w_gate"].get_value()
    assert shard_shapes(w_gate) == {(8 // tp, *w_gate.shape[1:])}                  # experts split (EP)
    if dp:   # every device holds 1/8 of the cache pages and all heads
        assert spec_of(latent) == (AXIS,) and shard_shapes(latent) == {(32 // 8, 64, 512)}
        assert q_b.sharding.is_fully_replicated
    else:    # cache replicated, heads split
        assert latent.sharding.is_fully_replicated and shard_shapes(latent) == {(24, 64, 512)}
        assert shard_shapes(q_b) == {(32, 8 * 80 // tp)}


@pytest.mark.parametrize("tp,dp", [(2, False), (8, True)])
def test_llm_sharded_fast_path_continuations_reuse_the_first_calls_variant(tp, dp):
    """Over a mesh the first decode call's 'previous tokens' are placed as the call's outputs are, so the calls
    that continue it on the device (overlap) run the same compiled variant."""
    import mla_jax
    llm = make_llm(tensor_parallel_size=tp, data_parallel_attention=dp, num_pages=32, multi_step=4)
    fd, continued = llm._fast, []
    dispatch = fd._dispatch

    def spy(rows, k, *, base, prev):
        continued.append(prev is not None)
        return dispatch(rows, k, base=base, prev=prev)

    fd._dispatch = spy
    out = llm.generate([list(range(3, 23))], mla_jax.SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    assert continued == [False, True, True]
    assert fd.num_compiles() == 1


@pytest.mark.parametrize("dp", [False, True])
def test_llm_sharded_fp8_cache_second_generate_compiles_nothing(dp):
    """A sharded fp8 cache starts in the engine's stored form (uint8 bits), as every step leaves it: allocated as
    float8 it made the first call of every shape compile twice, the second time inside a later generate."""
    one = make_llm(kv_cache_dtype="fp8_e4m3", num_pages=32)
    ref = one.generate(PROMPTS, greedy())
    llm = make_llm(kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2 if not dp else 8, data_parallel_attention=dp,
                   num_pages=32)
    assert llm.caches[0].latent.dtype == np.uint8
    first = llm.generate(PROMPTS, greedy())
    compiles = llm.num_compiles()
    second = llm.generate(PROMPTS, greedy())
    assert llm.num_compiles() == compiles
    for got in (first, second):
        for g, w in zip(got, ref):
            assert g.token_ids == w.token_ids
            # a latent computed in another summation order can round to a neighbouring fp8 value: 1e-3, not 2e-5
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-3)


def test_llm_dp_attention_chunked_prefill_reads_prefixes_across_devices(one_device_outputs):
    """Prompts longer than the prefill chunk: later chunks read their cached prefix from the owning device."""
    _, ref_long = one_device_outputs
    llm = make_llm(tensor_parallel_size=8, data_parallel_attention=True, num_pages=32, max_num_batched_tokens=16)
    assert_same(llm.generate(LONG_PROMPTS, greedy(4)), ref_long)


def test_llm_dp_attention_rejects_sizes_it_cannot_split():
    with pytest.raises(ValueError, match="num_pages=20 is not a multiple of 8"):
        make_llm(tensor_parallel_size=8, data_parallel_attention=True, num_pages=20)
    with pytest.raises(ValueError, match="max_num_seqs=4 is not a multiple of 8"):
        make_llm(tensor_parallel_size=8, data_parallel_attention=True, num_pages=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=8"):
        make_llm(tensor_parallel_size=3)


def test_awq_experts_routing_leaves_out_out_of_range_expert_indices():
    """The expert-parallel island gives AWQExperts the index E for pairs of other devices (that they then add
    nothing is test_expert_parallel_matches_one_device[awq]): w4a16_moe's routing must give them no row and no
    block, i.e. they cost nothing."""
    from pallas_kernels.w4a16 import routing
    E = 4
    idx = jnp.array([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], jnp.int32)
    w = jnp.ones(idx.shape, jnp.float32)
    drop = jnp.array([[False, True], [True, True], [False, False], [True, False], [False, True], [False, False]])
    align = jax.jit(routing.align, static_argnums=(2, 3))
    rt = align(jnp.where(drop, E, idx), w, E, 2)
    # 7 kept pairs, per expert 3, 2, 1, 1, in blocks of 2 rows: 2 + 1 + 1 + 1 blocks
    assert int((rt.block_expert >= 0).sum()) == 5 and int((rt.row_token >= 0).sum()) == int((~drop).sum()) == 7
    assert bool(((rt.pair_row < 0) == drop).all())
    rt_all = align(idx, w, E, 2)
    assert int((rt_all.block_expert >= 0).sum()) == 8 and int((rt_all.row_token >= 0).sum()) == 12

@pytest.mark.parametrize("module_path,n,dp,backend", [
    ("layers/0/self_attn/q_b_proj", 4, False, "auto"),      # column split
    ("layers/0/self_attn/o_proj", 2, False, "auto"),        # row split: K ranges, float32 partial sums
    ("layers/0/self_attn/q_b_proj", 4, True, "auto"),       # replicated (data-parallel attention)
    ("layers/0/mlp/down_proj", 2, False, "triton"),         # row split through the Pallas kernel (interpret)
    ("layers/0/mlp/up_proj", 2, True, "triton"),            # column split through the Pallas kernel
])
def test_awq_linear_island_matches_one_device(module_path, n, dp, backend):
    """A dense AWQ linear whose weights are split by its partition rule runs w4a16_matmul inside a shard_map
    island on each device's shard and gives the one-device result."""
    from mla_jax.quant import awq
    plan = ShardingPlan.create(tiny_cfg(), n, dp)
    K, N = 512, 512
    lin = awq.AWQLinear(AWQConfig(bits=4, group_size=64), K, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (5, K), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(jax.jit(lambda x: lin(x))(x), np.float32)
    lin.backend, lin.interpret = backend, backend == "triton"
    lin.island = awq.island_for(plan, module_path, lin)
    assert lin.island is not None and lin.island[1] == sharding.layout_for(f"{module_path}/packed", dp)
    graphdef, state = nnx.split(lin)
    placed = jax.tree_util.tree_map_with_path(
        lambda kp, a: jax.device_put(a, plan.sharding(plan.param_spec(f"{module_path}/{sharding.path_str(kp)}",
                                                                      a.shape))), state)
    got = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(placed, x), np.float32)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert got.shape == (5, N) and err < 1e-2, err
    # shapes that are not whole kernel tiles per device take the XLA path instead of an island
    odd = awq.AWQLinear(AWQConfig(bits=4, group_size=64), 256, 192, dtype=jnp.bfloat16, rngs=nnx.Rngs(5))
    assert awq.island_for(plan, "layers/0/self_attn/o_proj", odd) is None or dp
