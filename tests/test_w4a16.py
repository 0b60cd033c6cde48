"""w4a16 ops (pallas_kernels.w4a16): the Triton kernels in interpret mode and the XLA reference against a float64
NumPy dequantize-and-matmul, on fresh random AWQ weights, odd shapes and routing edge cases."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16 import api, layout, routing

BACKENDS = ("triton", "xla")


def rand_awq(rng, k, n, g, lead=()):
  q = rng.integers(0, 16, (*lead, k, n))
  z = rng.integers(0, 16, (*lead, k // g, n))
  s = (rng.uniform(0.5, 1.5, (*lead, k // g, n)) / (4.6 * np.sqrt(k))).astype(np.float16)
  return q, z, s


def deq64(q, z, s, g):
  return (q.astype(np.float64) - np.repeat(z, g, axis=-2)) * np.repeat(s.astype(np.float64), g, axis=-2)


def to_device(w):
  return jax.tree.map(jnp.asarray, w)


def max_rel(y, ref):
  y = np.asarray(y, np.float64)
  assert np.isfinite(y).all(), "output has NaN/inf"
  return np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_pack_roundtrip_and_layout(g):
  rng = np.random.default_rng(g)
  q, z, s = rand_awq(rng, 3 * g, 200, g, lead=(2,))
  w = layout.pack(q, z, s, g, xp=np)
  assert w.packed.shape == (2, layout.padded_k(3 * g) // 8, 256) and w.k == 3 * g and w.n == 200
  # every documented bit position (format version 3): word (32 c + 2 i + h, n), bits 4 m + 16 u hold
  # q[256 c + 32 (4 h + m) + 2 i + u, n]; rows past K are zero
  words = w.packed.view(np.uint32)
  k_pad = layout.padded_k(3 * g)
  q_pad = np.zeros((2, k_pad, 256), np.int64)
  q_pad[:, :3 * g, :200] = q
  for c in range(k_pad // 256):
    for h in range(2):
      for i in range(16):
        for m in range(4):
          for u in range(2):
            got = (words[:, 32 * c + 2 * i + h, :] >> (4 * m + 16 * u)) & 0xF
            np.testing.assert_array_equal(got, q_pad[:, 256 * c + 32 * (4 * h + m) + 2 * i + u, :])
  # version 2 (bits 4 j of word 32 c + r hold q[256 c + 32 j + r]) is the halves transpose of version 3
  v2 = layout.swap_word_halves(w.packed, xp=np).view(np.uint32)
  for j in range(8):
    got = ((v2.reshape(2, -1, 32, 256) >> (4 * j)) & 0xF).reshape(2, -1, 256)
    np.testing.assert_array_equal(got, q_pad.reshape(2, -1, 8, 32, 256)[:, :, j].reshape(2, -1, 256))
  np.testing.assert_array_equal(layout.swap_word_halves(layout.swap_word_halves(w.packed, xp=np), xp=np),
                                w.packed)
  q2, z2, s2 = layout.unpack(to_device(w))
  np.testing.assert_array_equal(np.asarray(q2), q)
  np.testing.assert_array_equal(np.asarray(z2), z)
  np.testing.assert_array_equal(np.asarray(s2), s)
  # packing on the device gives the same words
  wj = layout.pack(jnp.asarray(q), jnp.asarray(z), jnp.asarray(s), g)
  np.testing.assert_array_equal(np.asarray(wj.packed), w.packed)


def test_pack_rejects_bad_input():
  rng = np.random.default_rng(0)
  q, z, s = rand_awq(rng, 128, 64, 64)
  with pytest.raises(ValueError, match="outside 0..15"):
    layout.pack(q + 1, z, s, 64, xp=np)
  with pytest.raises(ValueError, match="group size 48"):
    layout.pack(q, z, s, 48, xp=np)       # does not divide the 256-row chunk
  with pytest.raises(ValueError, match="zeros and scales"):
    layout.pack(q, z[:1], s, 64, xp=np)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,k,n,g", [(1, 128, 200, 32), (7, 512, 128, 64), (64, 384, 320, 128),
                                     (257, 256, 64, 64), (5, 1024, 192, 64)])
def test_matmul_vs_float64(backend, m, k, n, g):
  rng = np.random.default_rng(m * 1000 + k + n)
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ref = np.asarray(x, np.float64) @ deq64(q, z, s, g)
  y = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend=backend, interpret=True))(x, w)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  # bf16 output rounding (2^-9) plus, for xla, bf16-rounded weights
  assert max_rel(y, ref) < 1e-2


def test_matmul_split_k_matches_unsplit():
  rng = np.random.default_rng(3)
  q, z, s = rand_awq(rng, 1024, 128, 64)
  w = to_device(layout.pack(q, z, s, 64, xp=np))
  x = jnp.asarray(rng.standard_normal((9, 1024)), jnp.bfloat16)
  ys = [api.w4a16_matmul(x, w, backend="triton", interpret=True, config=dict(splits=sp)) for sp in (1, 2, 4)]
  ref = np.asarray(x, np.float64) @ deq64(q, z, s, 64)
  for y in ys:
    assert max_rel(y, ref) < 1e-2


def test_matmul_zero_rows_and_bad_shapes():
  rng = np.random.default_rng(1)
  w = to_device(layout.pack(*rand_awq(rng, 128, 64, 64), 64, xp=np))
  assert api.w4a16_matmul(jnp.zeros((0, 128), jnp.bfloat16), w, backend="triton", interpret=True).shape == (0, 64)
  with pytest.raises(ValueError, match="K=128"):
    api.w4a16_matmul(jnp.zeros((3, 64), jnp.bfloat16), w)


def moe_ref64(x, ids, wts, gate, up, down, g):
  xd = np.asarray(x, np.float64)
  out = np.zeros((x.shape[0], down[0].shape[-1]))
  for t in range(ids.shape[0]):
    for kk in range(ids.shape[1]):
      e = ids[t, kk]
      if not 0 <= e < gate[0].shape[0]:
        continue
      gg = xd[t] @ deq64(*[a[e] for a in gate], g)
      uu = xd[t] @ deq64(*[a[e] for a in up], g)
      out[t] += wts[t, kk] * ((gg / (1 + np.exp(-gg)) * uu) @ deq64(*[a[e] for a in down], g))
  return out


def poison_from(w, first_expert: int):
  """The stack w with NaN scales on experts first_expert.. (which a test's routing never uses)."""
  return layout.W4A16Weight(packed=w.packed, scales=w.scales.at[first_expert:].set(jnp.nan), zeros=w.zeros,
                            k=w.k, n=w.n, group_size=w.group_size)


def make_moe(rng, e, d, i, g):
  gate, up, down = rand_awq(rng, d, i, g, (e,)), rand_awq(rng, d, i, g, (e,)), rand_awq(rng, i, d, g, (e,))
  w13 = to_device(layout.pack_gate_up(gate, up, g, xp=np))
  w2 = to_device(layout.pack(*down, g, xp=np))
  return gate, up, down, w13, w2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["random", "one_expert", "duplicates_and_dropped", "t1"])
def test_moe_vs_float64(backend, case):
  rng = np.random.default_rng(hash(case) % 1000)
  e, d, i, g, t, k = 7, 512, 192, 64, 9, 3          # 7 experts: divides nothing
  if case == "t1":
    t = 1
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  if case == "one_expert":
    ids[:] = 4                                        # every pair on one expert (also repeated within a token)
  if case == "duplicates_and_dropped":
    ids[0] = [2, 2, 9]                                # a repeated expert and an out-of-range id (dropped)
    ids[1] = [-1, 0, 6]
  wts = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
  ref = moe_ref64(x, ids, wts, gate, up, down, g)
  f = jax.jit(lambda *a: api.w4a16_moe(*a, backend=backend, interpret=True))
  y = f(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2)
  assert y.shape == (t, d)
  assert max_rel(y, ref) < 1.5e-2


def test_moe_nan_in_unused_experts_never_reaches_output():
  rng = np.random.default_rng(7)
  e, d, i, g, t, k = 6, 256, 128, 64, 5, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = rng.integers(0, 3, (t, k)).astype(np.int32)   # experts 3..5 unused: poison their scales
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), poison_from(w13, 3), poison_from(w2, 3),
                    backend="triton", interpret=True)
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


def test_routing_blocks():
  ids = jnp.asarray([[0, 3], [3, 3], [1, 5], [9, 0]], jnp.int32)     # 5, 9 out of range for E = 4
  wts = jnp.arange(8, dtype=jnp.float32).reshape(4, 2) + 1
  rt = routing.align(ids, wts, 4, 2)
  be = np.asarray(rt.block_expert)
  assert be.shape[0] == routing.max_blocks(8, 4, 2)
  # expert 0: 2 rows (1 block), expert 1: 1 row (1 block), expert 3: 3 rows (2 blocks); then unused blocks
  np.testing.assert_array_equal(be[:4], [0, 1, 3, 3])
  assert (be[4:] == -1).all()
  pr = np.asarray(rt.pair_row)
  assert pr[2, 1] == -1 and pr[3, 0] == -1
  tok, w = np.asarray(rt.row_token), np.asarray(rt.row_weight)
  for t in range(4):
    for kk in range(2):
      if pr[t, kk] >= 0:
        assert tok[pr[t, kk]] == t and w[pr[t, kk]] == wts[t, kk]
  assert (w[tok < 0] == 0).all()


def routing_case(rng, t, k, e, kind):
  """topk ids [T, K] of one kind of routing: uniform, all on one expert, dropped ids (-1 and >= E: expert-parallel
  shards), repeated experts within a token, or few experts."""
  if kind == "one_expert":
    ids = np.full((t, k), e - 1, np.int32)
  elif kind == "few":
    ids = rng.integers(0, min(e, 3), (t, k)).astype(np.int32)
  else:
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
  if kind == "dropped":
    ids[rng.random((t, k)) < 0.25] = -1
    ids[rng.random((t, k)) < 0.15] = e + rng.integers(0, 5)
  if kind == "repeats":
    ids[:, 1::2] = ids[:, 0::2][:, :ids[:, 1::2].shape[1]]
  return ids, rng.uniform(0.01, 2, (t, k)).astype(np.float32)


@pytest.mark.parametrize("t,k,e,block_m,kind", [
    (2, 1, 1, 1, "uniform"), (16, 8, 256, 8, "uniform"), (64, 8, 256, 8, "uniform"), (64, 8, 256, 16, "dropped"),
    (7, 6, 160, 16, "repeats"), (33, 3, 5, 4, "few"), (128, 8, 256, 64, "one_expert"), (5, 2, 300, 2, "dropped"),
    (3, 8, 4, 16, "uniform"), (9, 7, 64, 32, "repeats")])
def test_align_kernel_matches_align(t, k, e, block_m, kind):
  # the Pallas Triton grouping (interpret mode) against the XLA one, every array to the bit; fresh random routing,
  # pair and expert counts that are not powers of two, several chunks of pairs and of blocks
  from pallas_kernels.w4a16 import routing_triton
  ids, wts = routing_case(np.random.default_rng(t * 1000 + e), t, k, e, kind)
  want = routing.align(jnp.asarray(ids), jnp.asarray(wts), e, block_m)
  got = routing_triton.align_kernel(jnp.asarray(ids), jnp.asarray(wts), e, block_m, interpret=True)
  assert got.block_m == want.block_m
  for field in ("block_expert", "row_token", "row_weight", "pair_row"):
    a, b = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
    assert a.shape == b.shape and a.dtype == b.dtype, field
    np.testing.assert_array_equal(a, b, err_msg=field)


@pytest.mark.parametrize("t,k,e,block_m,pair_chunk", [(64, 8, 256, 8, 32), (33, 3, 5, 4, 8), (16, 8, 256, 16, 256)])
def test_align_kernel_pair_chunk_is_only_a_knob(t, k, e, block_m, pair_chunk):
  # pairs a program takes (more programs, or fewer than the blocks' chunks): the same Routing
  from pallas_kernels.w4a16 import routing_triton
  ids, wts = routing_case(np.random.default_rng(t * 7 + pair_chunk), t, k, e, "dropped")
  want = routing.align(jnp.asarray(ids), jnp.asarray(wts), e, block_m)
  got = routing_triton.align_kernel(jnp.asarray(ids), jnp.asarray(wts), e, block_m, interpret=True,
                                    pair_chunk=pair_chunk)
  for field in ("block_expert", "row_token", "row_weight", "pair_row"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)


def test_align_kernel_refuses_what_it_cannot_take():
  from pallas_kernels.w4a16 import routing_triton
  ids, wts = jnp.zeros((129, 8), jnp.int32), jnp.ones((129, 8), jnp.float32)
  assert not routing_triton.supports(129 * 8, 8) and not routing_triton.supports(16, 12)
  with pytest.raises(ValueError, match="routing.align"):
    routing_triton.align_kernel(ids, wts, 256, 8)
  with pytest.raises(ValueError, match="power-of-two block_m"):
    routing_triton.align_kernel(ids[:2], wts[:2], 256, 12)
  with pytest.raises(ValueError, match="pair_chunk must be a power of two"):
    routing_triton.align_kernel(ids[:2], wts[:2], 256, 8, pair_chunk=48)
  # the op falls back to the XLA grouping there (and for one token), with the same result
  rt = api.align(ids[:2, :3], wts[:2, :3], 256, 12)
  assert rt.block_m == 12 and rt.row_token.shape[0] == routing.max_blocks(6, 256, 12) * 12


def test_max_blocks_is_the_most_any_routing_needs():
  rng = np.random.default_rng(5)
  for p, e, bm in [(128, 256, 8), (512, 256, 8), (24, 4, 16), (7, 3, 2), (1, 256, 8), (40, 40, 1), (2048, 256, 64)]:
    bound = routing.max_blocks(p, e, bm)
    # the worst case: as many one-pair experts as possible, the other pairs in steps of block_m on top of them
    u = min(e, p)
    worst = np.ones(u, int)
    worst[0] += p - u
    assert sum(-(-c // bm) for c in worst) == bound                 # reached: no smaller static bound exists
    for _ in range(200):                           # random routings never need more
      counts = np.bincount(rng.integers(0, rng.integers(1, e + 1), p), minlength=e)
      assert sum(-(-c // bm) for c in counts) <= bound


@pytest.mark.parametrize("block_m", [1, 8])
def test_routing_one_token(block_m):
  # one token: a block per kept pair in k order; out-of-range ids dropped, a repeated expert gets two blocks
  ids = jnp.asarray([[2, -1, 2, 7, 0]], jnp.int32)                  # E = 5: -1 and 7 dropped
  wts = jnp.asarray([[0.5, 0.25, 0.125, 2.0, 1.5]], jnp.float32)
  rt = routing.align(ids, wts, 5, block_m)
  be = np.asarray(rt.block_expert)
  assert be.shape[0] == routing.max_blocks(5, 5, block_m) == 5     # a block per pair fits (E >= K)
  np.testing.assert_array_equal(be[:3], [2, 2, 0])
  assert (be[3:] == -1).all()
  np.testing.assert_array_equal(np.asarray(rt.pair_row), [[0, -1, block_m, -1, 2 * block_m]])
  tok, w = np.asarray(rt.row_token), np.asarray(rt.row_weight)
  used = {0: 0.5, block_m: 0.125, 2 * block_m: 1.5}
  for r in range(tok.shape[0]):
    assert (tok[r], w[r]) == ((0, used[r]) if r in used else (-1, 0.0))


def test_moe_one_token_vs_float64():
  rng = np.random.default_rng(11)
  e, d, i, g = 4, 256, 128, 64
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.asarray([[1, 9, 1, 3]], np.int32)                        # a dropped id and a repeated expert
  wts = np.asarray([[0.4, 0.3, 0.2, 0.1]], np.float32)
  x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="triton", interpret=True)
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


@pytest.mark.parametrize("p", [1, 7, 512, routing.PAIRWISE_RANK_MAX_PAIRS + 3])
def test_pair_ranks_both_methods(p):
  # the pairwise count (decode sizes) and the argsort (past PAIRWISE_RANK_MAX_PAIRS) against a Python loop, with
  # out-of-range ids (dropped later by align, ranked like any id here)
  ids = np.random.default_rng(p).integers(-2, 40, p).astype(np.int32)
  want = [int(np.sum(ids[:i] == ids[i])) for i in range(p)]
  np.testing.assert_array_equal(np.asarray(routing.pair_ranks(jnp.asarray(ids))), want)


def test_backend_rules(caplog):
  with pytest.raises(ValueError, match="unknown"):
    api.resolve_backend("cuda", jnp.bfloat16)
  with pytest.raises(ValueError, match="bfloat16 activations"):
    api.resolve_backend("triton", jnp.float32, interpret=True)
  if jax.devices()[0].platform == "cpu":
    with pytest.raises(ValueError, match="interpret=True"):
      api.resolve_backend("triton", jnp.bfloat16)
    assert api.resolve_backend("auto", jnp.bfloat16)[0] == "xla"
  assert api.resolve_backend("auto", jnp.float32)[0] == "xla"
  assert api.resolve_backend("auto", jnp.bfloat16, interpret=True)[0] == "triton"
  # group sizes the kernels are not built for (the layout holds them): auto takes xla and says why
  name, reason = api.resolve_backend("auto", jnp.bfloat16, interpret=True, group_size=16)
  assert name == "xla" and "group size 16" in reason
  with pytest.raises(ValueError, match="group sizes"):
    api.resolve_backend("triton", jnp.bfloat16, interpret=True, group_size=16)
  api._logged.clear()
  rng = np.random.default_rng(2)
  w = to_device(layout.pack(*rand_awq(rng, 128, 64, 64), 64, xp=np))
  with caplog.at_level(logging.INFO, logger="pallas_kernels"):
    for _ in range(2):
      api.w4a16_matmul(jnp.ones((2, 128), jnp.float32), w)
  lines = [r for r in caplog.records if "w4a16 backend" in r.getMessage()]
  assert len(lines) == 1 and "xla" in lines[0].getMessage()


@pytest.mark.parametrize("orient", ["mk", "swap"])
def test_kernel_orientations_vs_float64(orient):
  """Both product orientations of the Triton kernel (dense with a K split, and the gated MoE) on fresh inputs."""
  rng = np.random.default_rng(11)
  q, z, s = rand_awq(rng, 768, 192, 64)
  w = to_device(layout.pack(q, z, s, 64, xp=np))
  x = jnp.asarray(rng.standard_normal((5, 768)), jnp.bfloat16)
  y = api.w4a16_matmul(x, w, backend="triton", interpret=True, config=dict(orient=orient, splits=2))
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, 64)) < 1e-2
  e, d, i, g, t, k = 5, 256, 128, 64, 6, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  xm = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  ym = api.w4a16_moe(xm, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="triton", interpret=True,
                     config=dict(orient=orient))
  assert max_rel(ym, moe_ref64(xm, ids, wts, gate, up, down, g)) < 1.5e-2


def test_layers_of_one_shape_trace_the_op_once(monkeypatch):
  """Each op body is its own jit, so a model's layers of one shape trace (and lower) it once per program."""
  rng = np.random.default_rng(11)
  e, d, i, g, t, k = 4, 256, 128, 64, 3, 2
  _, _, _, w13, w2 = make_moe(rng, e, d, i, g)
  q, z, s = rand_awq(rng, 256, 192, 64)
  dense = to_device(layout.pack(q, z, s, 64, xp=np))
  traced = {"moe": 0, "matmul": 0}
  moe_ref, matmul_ref = api.reference.moe, api.reference.matmul
  monkeypatch.setattr(api.reference, "moe", lambda *a, **kw: traced.__setitem__("moe", traced["moe"] + 1)
                      or moe_ref(*a, **kw))
  monkeypatch.setattr(api.reference, "matmul", lambda *a, **kw: traced.__setitem__("matmul", traced["matmul"] + 1)
                      or matmul_ref(*a, **kw))
  api._moe.clear_cache()
  api._matmul.clear_cache()
  ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
  wts = jnp.asarray(rng.uniform(0.1, 1, (t, k)), jnp.float32)

  def three_layers(x):
    for _ in range(3):
      x = x + api.w4a16_moe(x, ids, wts, w13, w2, backend="xla")
    return api.w4a16_matmul(x, dense, backend="xla"), api.w4a16_matmul(x * 2, dense, backend="xla")

  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  y1, y2 = jax.jit(three_layers)(x)
  assert traced == {"moe": 1, "matmul": 1}
  # and the cached trace computes what each call asked for
  np.testing.assert_allclose(np.asarray(y2), 2 * np.asarray(y1), rtol=2e-5, atol=1e-5)
