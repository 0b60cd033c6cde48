"""w4a16 backend mosaic_sm90 (pallas_kernels/w4a16/mosaic_sm90.py) without a GPU.

1. The register layout the decode relies on (word (r, n) on the thread and register slot of A element (n, r)),
   derived in NumPy from Mosaic's tiling and checked against the WGMMA layout's documented lane assignment.
2. The GPU code path (register-A wgmma, inline-PTX decode, TMA, transposed stores) lowered for CUDA on this CPU
   machine: Mosaic GPU builds the kernel module, running its layout / SMEM / wgmma checks, at lowering time.
3. The kernel in GPU interpret mode (its documented fallback: jnp decode, A staged through SMEM) against the
   float64 NumPy reference: dense (M = 1, 7, 64; G = 32, 64, 128; K split on / off) and the MoE (empty and
   duplicated experts, NaN scales on unused experts). Interpret mode is slow on 2 cores: shapes are small.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import jax.experimental.mosaic.gpu as mgpu
from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401  (registers the CUDA lowering)

from pallas_kernels.w4a16 import api, gather_sm90, layout, mosaic_sm90 as ms, routing
from test_w4a16 import deq64, make_moe, max_rel, moe_ref64, poison_from, rand_awq, to_device


def test_register_owners_match_documented_wgmma_layout():
  owners = ms.register_owners(mgpu.WGMMA_LAYOUT, (64, 32))
  assert len(owners) == 64 * 32
  for (warp, lane, _reg, vec), (row, col) in owners.items():
    assert warp == row // 16 and lane == 4 * (row % 8) + (col % 8) // 2 and vec == col % 2


def test_words_layout_is_the_transposed_a_operand():
  m = ms.words_register_map()
  # every A register (8 of them: [64, 32] bf16 over 128 threads, 2 per register) gets exactly two words
  fed = {}
  for widx, (aidx, e) in m.items():
    fed.setdefault(aidx, set()).add(e)
  assert len(fed) == int(np.prod(mgpu.WGMMA_LAYOUT.registers_shape((64, 32)))) == 8
  assert all(v == {0, 1} for v in fed.values())
  words = ms.register_owners(ms.WORDS_LAYOUT.to_mgpu(), (32, 64))
  a = ms.register_owners(mgpu.WGMMA_LAYOUT, (64, 32))
  for (warp, lane, reg, _), (r, n) in words.items():
    aidx, e = m[reg]
    assert tuple(a[(warp, lane, aidx, e)]) == (n, r)


@pytest.mark.parametrize("planes", [2, 4, 8])
def test_multi_plane_operand_is_the_planes_registers_side_by_side(planes):
  """_decode_planes_gpu(P) concatenates P planes' register arrays along axis 1: that must be the WGMMA layout of
  the [64, 32 P] operand whose columns 32 i .. 32 i + 31 are plane i."""
  one = ms.register_owners(mgpu.WGMMA_LAYOUT, (64, 32))
  wide = ms.register_owners(mgpu.WGMMA_LAYOUT, (64, 32 * planes))
  assert mgpu.WGMMA_LAYOUT.registers_shape((64, 32 * planes))[1] == 4 * planes
  for (warp, lane, reg, e), (n, k) in wide.items():
    tile = reg[1]
    n1, k1 = one[(warp, lane, (reg[0], tile % 4, *reg[2:]), e)]
    assert (int(n), int(k)) == (int(n1), int(k1) + 32 * (tile // 4))


def lower_for_cuda(f, *args):
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m,g,splits,overlap,persistent", [(1, 64, 1, False, False), (7, 128, 2, False, False),
                                                           (64, 32, 1, False, False), (7, 32, 2, True, False),
                                                           (16, 64, 1, True, False), (16, 64, 2, True, True)])
def test_dense_kernel_lowers_for_sm90(m, g, splits, overlap, persistent):
  rng = np.random.default_rng(m)
  w = to_device(layout.pack(*rand_awq(rng, 512, 320, g), g, xp=np))
  x = jax.ShapeDtypeStruct((m, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(splits=splits, overlap=overlap, persistent=persistent,
                                                                       num_ctas=132)), x, w)
  assert "mosaic_gpu" in text
  for needle in ("shr.u32", "lop3.b32", "wgmma", "setmaxnreg"):      # the GPU path, not the interpret one
    assert needle in text, needle
  assert "prmt" not in text        # format version 3 decodes with a shift and a lop3 per register


@pytest.mark.parametrize("g,planes", [(64, 2), (128, 4)])
def test_multi_plane_wgmma_lowers_for_sm90(g, planes):
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(g), 512, 320, g), g, xp=np))
  x = jax.ShapeDtypeStruct((16, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(planes_per_wgmma=planes, num_ctas=132)), x, w)
  assert "wgmma" in text and "lop3.b32" in text


def test_planes_per_wgmma_must_divide_the_group():
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(0), 256, 128, 64), 64, xp=np))
  with pytest.raises(ValueError, match="planes_per_wgmma 4"):
    ms.matmul(jnp.zeros((1, 256), jnp.bfloat16), w, config=dict(planes_per_wgmma=4), interpret=True)


def test_unknown_config_key_is_refused():
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(0), 256, 128, 64), 64, xp=np))
  for cfg in (dict(num_warps=8), dict(x_reuse=2)):          # a triton key; a removed option (NOTES v20)
    with pytest.raises(ValueError, match="unknown config keys"):
      ms.matmul(jnp.zeros((1, 256), jnp.bfloat16), w, config=cfg, interpret=True)


def test_register_split_over_the_launch_is_refused():
  """The producer's and two consumers' registers must fit the 3 x 168 a thread-slot the CTA launches with: a larger
  split would wait forever in the consumers' setmaxnreg increase (pallas_kernels.sm90_registers)."""
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(0), 256, 128, 64), 64, xp=np))
  for cfg, match in ((dict(consumer_registers=240), "wait forever"), (dict(producer_registers=44), "multiples of 8")):
    with pytest.raises(ValueError, match=match):
      ms.matmul(jnp.zeros((1, 256), jnp.bfloat16), w, config=cfg, interpret=True)


@pytest.mark.parametrize("persistent,extra", [(False, {}), (True, {}),
                                              (True, dict(gather_kernel=True, convert_in_producer=True, fold="fma"))])
def test_moe_lowers_for_sm90(persistent, extra):
  rng = np.random.default_rng(5)
  *_, w13, w2 = make_moe(rng, 4, 512, 128, 64)
  x = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((5, 2), jnp.int32)
  wts = jax.ShapeDtypeStruct((5, 2), jnp.float32)
  # the backend module directly (the api's rule refuses mosaic_sm90 on a CPU without interpret mode)
  fn = lambda x, i, t, a, b: ms.moe(x, routing.align(i, t, 4, 16), a, b, busy_blocks=8,
                                    config=dict(extra, persistent=persistent, num_ctas=132))
  text = lower_for_cuda(fn, x, ids, wts, w13, w2)
  # the two grouped kernels (and with gather_kernel the two row-copy kernels: x and X, the down projection's X)
  assert text.count("custom_call @mosaic_gpu") == (4 if extra else 2) and "wgmma" in text


@pytest.mark.parametrize("m,k,n,g,splits,overlap,persistent,planes",
                         [(1, 512, 192, 64, 1, False, False, 1), (7, 768, 128, 128, 3, False, False, 1),
                          (64, 256, 64, 32, 1, False, False, 1), (7, 1280, 128, 64, 1, True, False, 1),
                          (16, 768, 192, 32, 3, True, False, 1),
                          # persistent: 3 CTAs walk 1 block x 3 column tiles x 2 splits (one ring across units),
                          # and 2 blocks of 64 rows (no overlap: ms.OVERLAP_MAX_BLOCK_M)
                          (24, 1024, 320, 64, 2, True, True, 1), (72, 512, 320, 64, 2, False, True, 1),
                          (7, 512, 192, 128, 1, False, True, 1),
                          # planes_per_wgmma: two (g64) and four (g128) planes per wgmma operand
                          (16, 768, 192, 64, 1, True, True, 2), (7, 768, 128, 128, 3, True, True, 4)])
def test_dense_interpret_vs_float64(m, k, n, g, splits, overlap, persistent, planes):
  rng = np.random.default_rng(100 + m)
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  y = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True,
                                            config=dict(splits=splits, overlap=overlap, persistent=persistent,
                                                        num_ctas=3, planes_per_wgmma=planes)))(x, w)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  # bf16-rounded (q - z) s in the products and a bf16 output, as the xla path
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2


def test_moe_interpret_vs_float64_with_edge_cases():
  rng = np.random.default_rng(21)
  e, d, i, g, t, k = 6, 256, 128, 64, 5, 3
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.stack([rng.choice(3, k, replace=False) for _ in range(t)]).astype(np.int32)   # experts 3..5 unused
  ids[0] = [1, 1, 7]                       # a duplicated expert and an out-of-range (dropped) id
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), poison_from(w13, 3), poison_from(w2, 3),
                    backend="mosaic_sm90", interpret=True)
  assert y.shape == (t, d)
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


def test_moe_interpret_one_token_vs_float64():
  """T = 1 takes the one-token routing (a block per kept pair) and unsplit K: a repeated expert, a dropped id and
  NaN-poisoned unused experts."""
  rng = np.random.default_rng(23)
  e, d, i, g = 6, 256, 128, 64
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.asarray([[2, 0, 9, 2]], np.int32)                           # experts 3..5 unused, 9 dropped
  wts = np.asarray([[0.5, 0.25, 0.75, 0.125]], np.float32)
  x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), poison_from(w13, 3), poison_from(w2, 3),
                    backend="mosaic_sm90", interpret=True)
  assert y.shape == (1, d)
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


def test_balanced_k_splits():
  """The busiest CTA's chunks plus the partials' cost, minimised; fewer splits on ties."""
  # the DeepSeek-V3 down projection at T = 1: 8 x 56 units of 8 chunks on 132 CTAs -> 2 splits of 4 (28 < 32)
  assert routing.balanced_k_splits(8, 8 * 56, 132, 0.85) == 2
  # thousands of units (T = 64): the grid is balanced already and partials are expensive
  assert routing.balanced_k_splits(8, 229 * 56, 132, 30.0) == 1
  # units that fill the CTAs exactly never split; free partials take the best balance with the fewest splits
  assert routing.balanced_k_splits(28, 264, 132, 0.0) == 1
  assert routing.balanced_k_splits(28, 144, 132, 0.0) == 28     # 4,032 chunks: 31 per CTA at one chunk per unit
  assert routing.balanced_k_splits(1, 5, 132, 0.0) == 1


def test_moe_interpret_one_token_split_down_vs_float64():
  """One token on 3 experts, 4 CTAs: the down projection's 3 x 2 units of 4 chunks balance as 2 K splits, whose
  float32 partials the combine sums in its gather; NaN-poisoned unused experts."""
  rng = np.random.default_rng(29)
  e, d, i, g = 6, 256, 512, 64
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.asarray([[2, 0, 1]], np.int32)                              # experts 3..5 unused
  wts = np.asarray([[0.5, 0.25, 0.75]], np.float32)
  x = jnp.asarray(rng.standard_normal((1, d)), jnp.bfloat16)
  rt = routing.align(jnp.asarray(ids), jnp.asarray(wts), e, 8)
  w13, w2 = poison_from(w13, 3), poison_from(w2, 3)
  h = ms.grouped_matmul(x, w13, rt.block_expert, rt.row_token, rt.row_weight, block_m=8, gated=True,
                        weighted=False, out_dtype=jnp.bfloat16, busy_blocks=3, interpret=True)
  parts = ms.grouped_matmul(h, w2, rt.block_expert, routing.in_place_rows(rt), rt.row_weight, block_m=8,
                            gated=False, weighted=False, out_dtype=jnp.float32, busy_blocks=3, interpret=True,
                            x_in_block_order=True, keep_splits=True)
  assert parts.shape == (2, rt.num_blocks * 8, d)                      # the balanced split was taken
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="mosaic_sm90", interpret=True)
  assert y.shape == (1, d)
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2
  with pytest.raises(ValueError, match="keep_splits"):
    ms.grouped_matmul(x, w13, rt.block_expert, rt.row_token, rt.row_weight, block_m=8, gated=True, weighted=False,
                      out_dtype=jnp.bfloat16, busy_blocks=3, interpret=True, keep_splits=True)


def test_backend_rules_for_mosaic():
  with pytest.raises(ValueError, match="bfloat16 activations"):
    api.resolve_backend("mosaic_sm90", jnp.float32, interpret=True)
  with pytest.raises(ValueError, match="group sizes"):
    api.resolve_backend("mosaic_sm90", jnp.bfloat16, interpret=True, group_size=16)
  assert api.resolve_backend("mosaic_sm90", jnp.bfloat16, interpret=True)[0] == "mosaic_sm90"
  if jax.devices()[0].platform == "cpu":
    with pytest.raises(ValueError, match="compute capability 9.x"):
      api.resolve_backend("mosaic_sm90", jnp.bfloat16)
  # auto: mosaic_sm90 on Hopper only; triton on other GPUs >= 8.0 and in interpret mode
  assert api.resolve_backend("auto", jnp.bfloat16, interpret=True)[0] == "triton"
  for cc, want in (("9.0", "mosaic_sm90"), ("8.0", "triton"), ("8.9", "triton"), ("10.0", "triton"),
                   ("7.5", "xla")):
    gpu = types.SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=f"GPU {cc}")
    assert api.resolve_backend("auto", jnp.bfloat16, device=gpu)[0] == want, cc
    assert api.resolve_backend("auto", jnp.float32, device=gpu)[0] == "xla"
  # small weights stay on triton on Hopper (mosaic_sm90's lowering per process does not pay for them)
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H200")
  for kn in (7168 * 576, 2048 * 7168 // 8):        # V3's kv_a; an expert's down projection under 8-way TP
    assert api.resolve_backend("auto", jnp.bfloat16, device=hopper, weight_elems=kn)[0] == "mosaic_sm90"
  name, reason = api.resolve_backend("auto", jnp.bfloat16, device=hopper, weight_elems=256 * 1024)
  assert name == "triton" and "small weight" in reason
  assert api.resolve_backend("mosaic_sm90", jnp.bfloat16, device=hopper, weight_elems=256)[0] == "mosaic_sm90"


@pytest.mark.parametrize("splits,overlap,persistent", [(1, False, False), (2, False, False), (1, True, False),
                                                       (1, True, True), (2, True, True)])
def test_moe_interpret_gated_k_split(splits, overlap, persistent):
  """Gate|up over two chunks, gated in the kernel (1 split) or after the summed float32 partials (2 splits); I =
  192 is not a multiple of the 128-column tile of the down projection."""
  rng = np.random.default_rng(3)
  e, d, i, g, t, k = 4, 512, 192, 64, 4, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="mosaic_sm90", interpret=True,
                    config=dict(splits=splits, overlap=overlap, persistent=persistent, num_ctas=3))
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


@pytest.mark.parametrize("m,k,n,g,splits", [(1, 512, 192, 64, 1), (7, 768, 128, 128, 3), (13, 512, 192, 32, 1)])
def test_dense_interpret_block_m_8_vs_float64(m, k, n, g, splits):
  """min_block_m 8: M = 1 and 7 run one 8-row block (wgmma N = 8), M = 13 two of them."""
  rng = np.random.default_rng(200 + m)
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  y = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True,
                       config=dict(min_block_m=8, splits=splits, num_ctas=3))
  assert y.shape == (m, n)
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2


def test_moe_interpret_block_m_8_vs_float64():
  rng = np.random.default_rng(8)
  e, d, i, g, t, k = 5, 512, 128, 64, 9, 3
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  # expert 0 in every token: 9 rows, two 8-row blocks
  ids = np.stack([[0, *rng.choice(np.arange(1, e), k - 1, replace=False)] for _ in range(t)]).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="mosaic_sm90", interpret=True,
                    block_m=8, config=dict(num_ctas=3))
  assert max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)) < 1.5e-2


@pytest.mark.parametrize("config", [dict(min_block_m=8), dict(min_block_m=8, num_stages=6),
                                    *(dict(ablate=a) for a in ms.ABLATIONS if a),
                                    dict(ablate="compute_only+fold+decode"),
                                    dict(ablate="compute_only+fold+decode+words", planes_per_wgmma=2),
                                    dict(ablate="load_only+nosz"),
                                    dict(ablate="nox+nosz", convert_in_producer=True, fold="fma"),
                                    dict(ablate="compute_only+scales+corr", convert_in_producer=True,
                                         fold="fma", planes_per_wgmma=2),
                                    dict(ablate="fold", convert_in_producer=True, fold="fma")])
def test_block_m_8_and_ablations_lower_for_sm90(config):
  """The configs the GPU sweep times build for CUDA (the ablations give wrong outputs by design: timing only)."""
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(1), 512, 320, 64), 64, xp=np))
  x = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(config, num_ctas=132)), x, w)
  assert "wgmma" in text or config.get("ablate") == "load_only"


def test_unknown_ablation_is_refused():
  w = to_device(layout.pack(*rand_awq(np.random.default_rng(0), 256, 128, 64), 64, xp=np))
  with pytest.raises(ValueError, match="ablate"):
    ms.matmul(jnp.zeros((1, 256), jnp.bfloat16), w, config=dict(ablate="everything"), interpret=True)
  with pytest.raises(ValueError, match="ablate"):
    ms.matmul(jnp.zeros((1, 256), jnp.bfloat16), w, config=dict(ablate="fold+everything"), interpret=True)


@pytest.mark.parametrize("g,m,persistent,splits", [(64, 7, True, 1), (128, 16, True, 2), (32, 9, False, 1)])
def test_convert_in_producer_gives_the_same_bits(g, m, persistent, splits):
  """Scales and zeros converted once per stage by the producer: the same bf16 s and 128 + z, so the same output
  bits as the consumers converting them (across units and K splits: the conversion runs one chunk behind)."""
  rng = np.random.default_rng(300 + g)
  q, z, s = rand_awq(rng, 1024, 320, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
  base = dict(persistent=persistent, splits=splits, num_ctas=3)
  y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=base)
  y1 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, convert_in_producer=True))
  assert max_rel(y1, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))


def small_moe_vs_float64(seed, config):
  """Max relative error of mosaic_sm90's MoE under `config` (5 experts, D 512, I 128, g64, 6 tokens, top-2)
  against the float64 reference; also returns the gate|up stack."""
  rng = np.random.default_rng(seed)
  e, d, i, g, t, k = 5, 512, 128, 64, 6, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  y = api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend="mosaic_sm90", interpret=True,
                    config=dict(config, num_ctas=2))
  return max_rel(y, moe_ref64(x, ids, wts, gate, up, down, g)), w13


def first_expert(stack):
  """Expert 0 of a stack as one weight."""
  return jax.tree.map(lambda a: a[0], stack)


def test_convert_in_producer_moe_and_lowering():
  err, w13 = small_moe_vs_float64(31, dict(convert_in_producer=True))
  assert err < 1.5e-2
  xs = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
  for cfg in (dict(convert_in_producer=True), dict(convert_in_producer=True, ablate="compute_only")):
    text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(cfg, num_ctas=132)), xs, first_expert(w13))
    assert "wgmma" in text
  with pytest.raises(ValueError, match="num_stages >= 3"):
    ms.matmul(jnp.zeros((6, 512), jnp.bfloat16), first_expert(w13),
              config=dict(convert_in_producer=True, num_stages=2), interpret=True)


def _record_kernel_args(monkeypatch, *names):
  """The argument `name` of every kernel built from here on, or the tuple of several names' (per-unit scales,
  stream-K and the x options are taken only where they apply)."""
  taken = []
  real = ms._kernel_call

  def spy(**kw):
    taken.append(kw[names[0]] if len(names) == 1 else tuple(kw[n] for n in names))
    return real(**kw)
  monkeypatch.setattr(ms, "_kernel_call", spy)
  return taken


@pytest.mark.parametrize("g,m,persistent,splits,extra",
                         [(64, 7, True, 2, dict(num_stages=2)),                   # 2 x 2 chunks, 3 CTAs, 2 slots
                          (128, 16, False, 1, {}),                                 # one unit per CTA
                          (64, 9, True, 4, dict(convert_in_producer=True)),        # the producer converts
                          (128, 16, True, 2, dict(convert_in_producer=True, fold="fma"))])
def test_unit_scales_give_the_same_bits(g, m, persistent, splits, extra, monkeypatch):
  """unit_scales: each unit's scales and zeros in one copy per array and consumer, in one of two slots that the
  ring runs across (units walked 3 per CTA, K splits). The same values reach the fold, so the same output bits."""
  rng = np.random.default_rng(500 + g + m)
  q, z, s = rand_awq(rng, 1024, 320, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
  base = dict(persistent=persistent, splits=splits, num_ctas=3, **extra)
  taken = _record_kernel_args(monkeypatch, "unit_scales")
  y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, unit_scales=False))
  y1 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, unit_scales=True))
  assert taken == [False, True]
  assert max_rel(y1, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))


def test_unit_scales_only_where_the_ring_is_not_held_back(monkeypatch):
  """Without the producer's conversion the consumers free a unit's slot at its end, so units shorter than the ring
  keep the per-chunk copies; units that do not divide K, too."""
  rng = np.random.default_rng(7)
  w = to_device(layout.pack(*rand_awq(rng, 1024, 128, 64), 64, xp=np))           # 4 chunks
  x = jnp.asarray(rng.standard_normal((3, 1024)), jnp.bfloat16)
  taken = _record_kernel_args(monkeypatch, "unit_scales")
  for cfg in (dict(splits=2), dict(splits=2, num_stages=2), dict(splits=3), dict(splits=2, convert_in_producer=True)):
    api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(cfg, num_ctas=2))
  assert taken == [False, True, False, True]


@pytest.mark.parametrize("cfg", [dict(unit_scales=True, num_stages=2, splits=1),
                                 dict(unit_scales=True, convert_in_producer=True, fold="fma"),
                                 dict(unit_scales=False)])
def test_unit_scales_moe_and_lowering(cfg, monkeypatch):
  taken = _record_kernel_args(monkeypatch, "unit_scales")
  err, w13 = small_moe_vs_float64(51, cfg)
  assert err < 1.5e-2
  assert taken[0] == cfg["unit_scales"]                  # the gated gate|up kernel took the path asked for
  xs = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
  for c in (cfg, dict(cfg, ablate="compute_only"), dict(cfg, ablate="load_only"), dict(cfg, splits=2)):
    text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(c, num_ctas=132)), xs, first_expert(w13))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("m,sub,extra", [(7, 2, dict(stream_k=False, splits=2)),          # 8-row blocks, K splits
                                          (40, 2, dict(stream_k=False, splits=1)),         # one 64-row block
                                          (70, 2, {}),                                      # stream-K, 2 blocks
                                          (9, 2, dict(convert_in_producer=True, fold="fma", stream_k=False)),
                                          (9, 4, dict(stream_k=False))])
def test_sub_tiles_give_the_same_bits(m, sub, extra, monkeypatch):
  """sub_tiles: each consumer owns `sub` 64-column sub-tiles of a unit (one accumulator each, one x tile for all).
  Each output column sees the same products in the same order: the same bits as one sub-tile per consumer. N =
  640 is 5 tiles of 128 columns, so with 256- / 512-column units the last unit's sub-tiles past N are not stored.
  Stream-K is the exception: it lays the units' chunks end to end over the CTAs, so wider units move the cuts
  (here 10 units of 8 chunks on 3 CTAs cut two units, 6 units cut none), and a cut unit's f32 sum is grouped
  differently; there the two differ by at most one bf16 rounding step (and the bits are checked against a
  schedule with the same cuts: stream-K off, one split, which cuts no unit either)."""
  rng = np.random.default_rng(800 + m + sub)
  q, z, s = rand_awq(rng, 1024, 640, 64)
  w = to_device(layout.pack(q, z, s, 64, xp=np))
  x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
  base = dict(num_ctas=3, **extra)
  taken = _record_kernel_args(monkeypatch, "sub_tiles")
  y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=base)
  y1 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, sub_tiles=sub))
  assert taken == [1, sub]
  assert max_rel(y1, np.asarray(x, np.float64) @ deq64(q, z, s, 64)) < 1e-2
  if not extra:                                          # stream-K (the dense default)
    np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y0, np.float32), rtol=2 ** -7, atol=0)
    y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True,
                          config=dict(base, stream_k=False, splits=1, sub_tiles=1))
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))


@pytest.mark.parametrize("m,k,extra", [(7, 1024, dict(stream_k=False, splits=1)),     # 4 chunks a unit: pairs only
                                        (16, 1280, dict(stream_k=False, splits=1)),    # 5 chunks: an odd last one
                                        (24, 1024, {}),                                # stream-K: runs of any length
                                        (64, 768, dict(overlap=True, stream_k=False))])   # 64-row block, 3 chunks
def test_unroll_2_gives_the_same_bits(m, k, extra, monkeypatch):
  """unroll=2 (two chunks a consumer loop body, each with its own A registers) runs the same products in the same
  order as one chunk a body: the same bits, including odd chunk counts and the overlap at a 64-row block, which it
  alone allows."""
  rng = np.random.default_rng(900 + m)
  q, z, s = rand_awq(rng, k, 384, 64)
  w = to_device(layout.pack(q, z, s, 64, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  base = dict(num_ctas=3, **extra)
  taken = _record_kernel_args(monkeypatch, "unroll")
  y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, overlap=m <= 32))
  y1 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, unroll=2))
  assert taken == [1, 2]
  assert max_rel(y1, np.asarray(x, np.float64) @ deq64(q, z, s, 64)) < 1e-2
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))


def test_unroll_2_moe_and_rejects():
  err, w13 = small_moe_vs_float64(73, dict(unroll=2))
  assert err < 1.5e-2
  xs = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(unroll=2, num_ctas=132)), xs, first_expert(w13))
  assert "wgmma" in text
  x = jnp.zeros((5, 512), jnp.bfloat16)
  for cfg, match in ((dict(unroll=3), "unroll must be 1 or 2"), (dict(unroll=2, overlap=False), "needs the overlap"),
                     (dict(unroll=2, sub_tiles=2), "needs the overlap on and sub_tiles 1")):
    with pytest.raises(ValueError, match=match):
      ms.matmul(x, first_expert(w13), config=dict(cfg, num_ctas=2), interpret=True)
  with pytest.raises(ValueError, match="or at any block_m with unroll=2"):
    ms.matmul(jnp.zeros((64, 512), jnp.bfloat16), first_expert(w13), config=dict(overlap=True, num_ctas=2),
              interpret=True)


def test_sub_tiles_moe_vs_float64_and_lowering(monkeypatch):
  """Both MoE kernels with 2 sub-tiles per consumer (gate|up's gated epilogue hands 2 up accumulators over), also
  unsplit with the producer's conversion and the fma fold; the GPU path lowers at 8- and 64-row blocks."""
  taken = _record_kernel_args(monkeypatch, "sub_tiles")
  err, w13 = small_moe_vs_float64(71, dict(sub_tiles=2))
  assert err < 1.5e-2 and taken == [2, 2]            # gate|up: I = 128 is one tile of 2 gate (and up) sub-tiles
  err, _ = small_moe_vs_float64(71, dict(sub_tiles=2, splits=1, convert_in_producer=True, fold="fma"))
  assert err < 1.5e-2
  for rows in (5, 64):
    xs = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16)
    text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(sub_tiles=2, num_ctas=132)), xs,
                          first_expert(w13))
    assert "wgmma" in text
  assert taken[-2:] == [2, 2]


def test_v3_shapes_lower_with_sub_tiles(monkeypatch):
  """At DeepSeek-V3's shapes (E 256, D 7168, I 2048, top-8; o_proj-sized dense) the kernels with 1 and 2 sub-tiles
  pass Mosaic's SMEM, layout and wgmma checks, with the ring depths and options the rules pick: sub_tiles trading
  gate|up's unit_scales for its second sub-tile, and 2 sub-tiles at 64-row blocks in 2 stages (4 asked for: halved
  to fit)."""
  e, d, i, k = 256, 7168, 2048, 8
  abstract = lambda *a, **kw: jax.eval_shape(lambda: layout.random_weight(jax.random.key(0), *a, **kw))
  w13, w2 = abstract((e,), d, i, 128, gate_up=True), abstract((e,), i, d, 128)
  taken = _record_kernel_args(monkeypatch, "num_stages", "sub_tiles", "unit_scales")
  t = 64
  bm = api.default_block_m(t, k, e, "mosaic_sm90")
  args = (jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.int32),
          jax.ShapeDtypeStruct((t, k), jnp.float32), w13, w2)
  for cfg in (dict(sub_tiles=1), dict(sub_tiles=2)):    # (sub_tiles 2 is the default at these shapes)
    text = lower_for_cuda(lambda x, ids, wts, a, b: ms.moe(x, routing.align(ids, wts, e, bm), a, b, busy_blocks=e,
                                                           config=dict(cfg, num_ctas=132)), *args)
    assert "wgmma" in text
  assert taken == [(4, 1, True), (4, 1, True), (4, 2, False), (4, 2, True)]
  taken.clear()
  w = abstract((), 7168, 7168, 128)
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(sub_tiles=4, num_ctas=132)),
                        jax.ShapeDtypeStruct((64, 7168), jnp.bfloat16), w)
  assert "wgmma" in text and taken == [(2, 2, False)]


def test_stream_k_plan():
  """Each CTA at most one chunk above the mean; every unit's chunks covered once by its segments' slots."""
  for units, n, ctas in [(144, 28, 132), (56, 72, 132), (6, 4, 4), (3, 5, 7), (1, 1, 3)]:
    per_cta, slots, valid = routing.stream_k_plan(units, n, ctas)
    assert per_cta == -(-units * n // ctas) and valid.shape == (slots, units)
    covered = np.zeros((slots, units), int)
    for c in range(ctas):
      for g in range(c * per_cta, min((c + 1) * per_cta, units * n)):
        t = g // n
        covered[c - (t * n) // per_cta, t] += 1
    assert (covered.sum(axis=0) == n).all() and ((covered > 0) == valid).all()
  assert routing.stream_k_plan(144, 28, 132)[:2] == (31, 2)        # 7168 -> 18432 at one row block


@pytest.mark.parametrize("m,k,n,g,ctas", [(1, 1024, 320, 64, 3),    # 3 tiles (the last half past N) of 4 chunks
                                          (70, 768, 192, 128, 5),   # 2 blocks of 64 rows x 2 tiles x 3 chunks
                                          (7, 512, 128, 32, 4)])     # one unit of 2 chunks over 4 CTAs
def test_stream_k_vs_float64(m, k, n, g, ctas, monkeypatch):
  """stream_k: the dense matmul's chunks split evenly over the CTAs; the partials of each unit's segments add to
  the product."""
  rng = np.random.default_rng(600 + m)
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  cfg = dict(num_ctas=ctas, stream_k=True)
  slots = _record_kernel_args(monkeypatch, "stream_k")
  y = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=cfg)
  units = routing.dense_blocks(m, 8).num_blocks * -(-n // 128)
  assert slots[0] == routing.stream_k_plan(units, k // 256, ctas)[1] > 0
  y0 = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(num_ctas=ctas))
  assert y.shape == (m, n)
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2
  assert max_rel(y, np.asarray(y0, np.float64)) < 1e-2
  text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(stream_k=True, num_ctas=132)),
                        jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w)
  assert "wgmma" in text


def test_stream_k_sum_never_reads_unwritten_slots():
  """sum_stream_k adds exactly the slots stream_k_plan marks written: NaN in every other slot never reaches it."""
  nb, bm, n_pad = 2, 8, 192                                             # 2 blocks x 2 tiles (the last half past N)
  per_cta, slots, valid = routing.stream_k_plan(nb * 2, 3, 3)         # units 1, 2 span two CTAs; 0, 3 one
  rng = np.random.default_rng(1)
  parts = rng.standard_normal((slots, nb * bm, n_pad)).astype(np.float32)
  unit = (np.arange(nb * bm)[:, None] // bm) * 2 + np.arange(n_pad)[None, :] // 128     # [rows, cols] -> unit
  written = valid[:, unit]                                              # [S, rows, cols]
  poisoned = np.where(written, parts, np.nan)
  got = np.asarray(ms.sum_stream_k(jnp.asarray(poisoned), valid, bm))
  np.testing.assert_allclose(got, np.where(written, parts, 0).sum(axis=0), rtol=1e-6)
  assert not np.isnan(got).any() and (~valid).any()                   # some slot was unwritten, and masked


def test_padding_rows_are_never_written():
  """Only a block's valid rows are stored (interpret mode's fresh outputs are NaN, so unwritten rows show): M = 3 in
  an 8-row block, unsplit and K-split; the MoE's down projection then reads the gate|up output's NaN padding rows
  in place, and no NaN reaches the tokens' outputs (test_moe_* compare those against float64)."""
  rng = np.random.default_rng(8)
  q, z, s = rand_awq(rng, 512, 128, 64)
  w = to_device(layout.pack(q, z, s, 64, xp=np))
  x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
  blocks = routing.dense_blocks(3, 8)
  for splits in (1, 2):
    y = np.asarray(ms.grouped_matmul(x, layout.as_stack(w), blocks.block_expert, blocks.row_token, blocks.row_weight,
                                     block_m=8, gated=False, weighted=False, out_dtype=jnp.float32, busy_blocks=1,
                                     interpret=True, config=dict(num_ctas=2, splits=splits)))
    assert y.shape == (8, 128) and np.isnan(y[3:]).all()
    assert max_rel(y[:3], np.asarray(x, np.float64) @ deq64(q, z, s, 64)) < 1e-2


def test_overlap_only_up_to_32_row_blocks(monkeypatch):
  """overlap (chunk i's wgmmas in flight while chunk i + 1 decodes) gave wrong outputs at block_m 64 on an H200:
  unset it runs only up to OVERLAP_MAX_BLOCK_M rows per block, and asking for it on larger blocks is refused.
  Unset, it is also off with one sub-tile a consumer (the next chunk's decode would write the A registers of
  wgmmas in flight) and on with two sub-tiles or two chunks a loop body."""
  block_ms = _record_kernel_args(monkeypatch, "block_m")
  overlaps = _record_kernel_args(monkeypatch, "overlap")
  w = layout.random_weight(jax.random.PRNGKey(0), (), 512, 512, 64)
  for m in (16, 32, 33, 64, 128):
    jax.eval_shape(lambda x: ms.matmul(x, w), jax.ShapeDtypeStruct((m, 512), jnp.bfloat16))
  seen = list(zip(block_ms, overlaps))
  assert seen == [(16, False), (32, False), (64, False), (64, False), (64, False)]
  for cfg in (dict(sub_tiles=2), dict(unroll=2)):
    for m in (16, 32, 64):
      if m == 64 and "unroll" in cfg:
        continue
      jax.eval_shape(lambda x: ms.matmul(x, w, config=cfg), jax.ShapeDtypeStruct((m, 512), jnp.bfloat16))
  seen = list(zip(block_ms, overlaps))[5:]
  assert seen == [(16, True), (32, True), (64, False), (16, True), (32, True)]
  with pytest.raises(ValueError, match="overlap=True at block_m 64"):
    jax.eval_shape(lambda x: ms.matmul(x, w, config=dict(overlap=True)), jax.ShapeDtypeStruct((64, 512), jnp.bfloat16))
  jax.eval_shape(lambda x: ms.matmul(x, w, config=dict(overlap=False)), jax.ShapeDtypeStruct((16, 512), jnp.bfloat16))
  seen = list(zip(block_ms, overlaps))
  assert seen[-1] == (16, False)


def test_dense_runs_stream_k_unless_splits_are_given(monkeypatch):
  stream_k = _record_kernel_args(monkeypatch, "stream_k")
  splits = _record_kernel_args(monkeypatch, "splits")
  w = layout.random_weight(jax.random.PRNGKey(0), (), 1024, 256, 64)
  x = jax.ShapeDtypeStruct((5, 1024), jnp.bfloat16)
  for cfg in ({}, dict(splits=2), dict(stream_k=False, splits=None), dict(persistent=False)):
    jax.eval_shape(lambda x: ms.matmul(x, w, config=cfg), x)
  seen = list(zip(stream_k, splits))
  assert seen[0][0] > 0 and seen[1] == (0, 2) and seen[2][0] == 0 and seen[3][0] == 0


def test_unit_scales_need_equal_units():
  with pytest.raises(ValueError, match="unit_scales"):
    ms._kernel_call(num_blocks=1, block_m=8, tiles=1, splits=2, chunks_per_split=2, n_chunks=3, group=64, n_pad=128,
                    gated=False, up_offset=64, out_dtype=jnp.bfloat16, num_stages=4, consumer_registers=232,
                    producer_registers=40, overlap=True, num_ctas=2, interpret=True, unit_scales=True)


def test_correction_operand_layout_formula():
  """_corr_operand_gpu's thread arithmetic: in the WGMMA layout of a [64, 16] bf16 array, lane l of warp v holds,
  at register index idx and vector element e, element (16 v + l // 4 + 8 idx[4], 2 (l % 4) + e + 8 idx[1])."""
  owners = ms.register_owners(mgpu.WGMMA_LAYOUT, (ms.SUB_N, ms.CORR_K))
  assert len(owners) == ms.SUB_N * ms.CORR_K
  for (warp, lane, idx, e), (n, k) in owners.items():
    assert (int(n), int(k)) == (16 * warp + lane // 4 + 8 * idx[4], 2 * (lane % 4) + e + 8 * idx[1])


@pytest.mark.parametrize("g,m,splits", [(64, 7, 1), (128, 9, 2), (32, 16, 1)])
def test_fold_fma_vs_float64(g, m, splits):
  """fold='fma': one fma per register with a rounded bias, the bias error taken out by the correction wgmma. As
  close to the float64 product as the two-instruction fold, and far closer than the uncorrected fma."""
  rng = np.random.default_rng(400 + g)
  k, n = 1280, 192
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.5, jnp.bfloat16)     # a mean: X sums far from 0
  ref = np.asarray(x, np.float64) @ deq64(q, z, s, g)
  base = dict(splits=splits, num_ctas=3, convert_in_producer=True)
  y_fma = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=dict(base, fold="fma"))
  y_sub = api.w4a16_matmul(x, w, backend="mosaic_sm90", interpret=True, config=base)
  err_fma, err_sub = max_rel(y_fma, ref), max_rel(y_sub, ref)
  assert err_fma < 1e-2 and err_fma < 2 * err_sub + 1e-3, (err_fma, err_sub)


def test_fold_fma_moe_vs_float64_and_lowering():
  cfg = dict(convert_in_producer=True, fold="fma")
  err, w13 = small_moe_vs_float64(41, cfg)
  assert err < 1.5e-2
  for group in (32, 64, 128):
    wg = to_device(layout.pack(*rand_awq(np.random.default_rng(group), 512, 320, group), group, xp=np))
    text = lower_for_cuda(lambda x, w: ms.matmul(x, w, config=dict(cfg, num_ctas=132)),
                          jax.ShapeDtypeStruct((5, 512), jnp.bfloat16), wg)
    assert "wgmma" in text
  with pytest.raises(ValueError, match="convert_in_producer"):
    ms.matmul(jnp.zeros((6, 512), jnp.bfloat16), first_expert(w13), config=dict(fold="fma"), interpret=True)


@pytest.mark.parametrize("cfg", [{}, dict(convert_in_producer=True, fold="fma")])
def test_gather_kernel_gives_the_same_bits(cfg):
  """gather_kernel: x rows (and the fma fold's X rows; the down projection's X sums of the valid rows) put in
  block order by gather_sm90's copies, one per (token, expert) pair (the padding rows stay NaN in interpret mode):
  the MoE's output bits are those of the XLA path, on 8-row blocks with several tokens per expert, an expert with
  none and a dropped pair."""
  rng = np.random.default_rng(61)
  e, d, i, g, t, k = 5, 512, 128, 64, 9, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.stack([rng.choice(e - 1, k, replace=False) for _ in range(t)]).astype(np.int32)
  ids[2, 1] = -1                                                            # a dropped pair: nothing copied
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = jnp.asarray(rng.uniform(0.1, 1, (t, k)), jnp.float32)
  run = lambda gk: np.asarray(api.w4a16_moe(x, jnp.asarray(ids), wts, w13, w2, backend="mosaic_sm90",
                                            interpret=True, block_m=8,
                                            config=dict(cfg, num_ctas=2, gather_kernel=gk)), np.float32)
  got, want = run(True), run(False)
  assert np.isfinite(got).all()
  np.testing.assert_array_equal(got, want)
  assert max_rel(got, moe_ref64(x, ids, np.asarray(wts), gate, up, down, g)) < 1.5e-2


def test_gather_rows_writes_only_valid_rows_and_lowers():
  rng = np.random.default_rng(62)
  x = jnp.asarray(rng.standard_normal((5, 768)), jnp.bfloat16)
  xs = jnp.asarray(rng.standard_normal((5, 48)), jnp.bfloat16)
  tok = np.array([3, -1, 0, 4, -1, -1, 2, 2], np.int32)
  a, b = (np.asarray(o, np.float32) for o in gather_sm90.gather_rows([x, xs], jnp.asarray(tok), interpret=True))
  valid = tok >= 0
  np.testing.assert_array_equal(a[valid], np.asarray(x, np.float32)[tok[valid]])
  np.testing.assert_array_equal(b[valid], np.asarray(xs, np.float32)[tok[valid]])
  assert np.isnan(a[~valid]).all() and np.isnan(b[~valid]).all()            # never written (interpret: NaN)
  text = lower_for_cuda(lambda x, xs, t: gather_sm90.gather_rows([x, xs], t), jax.ShapeDtypeStruct((16, 7168),
                        jnp.bfloat16), jax.ShapeDtypeStruct((16, 448), jnp.bfloat16),
                        jax.ShapeDtypeStruct((1024,), jnp.int32))
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="multiple of 16 bytes"):
    gather_sm90.gather_rows([jnp.zeros((2, 12), jnp.bfloat16)], jnp.zeros((4,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="TMA box"):
    gather_sm90.gather_rows([jnp.zeros((2, 256 * 264), jnp.bfloat16)], jnp.zeros((4,), jnp.int32), interpret=True)


def test_moe_defaults_rule():
  """The MoE's measured defaults: from 16 tokens on, producer conversion + fma fold (+ 2 planes per wgmma where a
  group has two planes) + the row-copy kernel, and two sub-tiles a consumer with 8-row blocks; below that the plain
  kernel. K splits aim at one unit per SM at every size."""
  one_wave = dict(target_programs=ms.MOE_TARGET_PROGRAMS)
  assert ms.moe_config(64, 1) == one_wave and ms.moe_config(128, 15) == one_wave
  assert ms.moe_config(64, 16) == dict(one_wave, convert_in_producer=True, fold="fma", planes_per_wgmma=2,
                                       gather_kernel=True, sub_tiles=2)
  assert ms.moe_config(64, 512, block_m=16)["sub_tiles"] == 1 and ms.moe_config(128, 64, block_m=8)["sub_tiles"] == 2
  assert ms.moe_config(128, 64)["planes_per_wgmma"] == 2 and ms.moe_config(32, 64)["planes_per_wgmma"] == 1
  assert set(ms.moe_config(64, 64)) <= set(ms.DEFAULT_CONFIG)


@pytest.mark.parametrize("n, k, wgs, regs", [(8, 32, 2, True), (8, 64, 3, False), (128, 128, 4, True)])
def test_wgmma_probe_lowers_for_sm90(n, k, wgs, regs):
  """The tensor-core timing probe (scripts/bench_wgmma.py) builds for CUDA and issues its wgmmas."""
  from pallas_kernels.w4a16 import wgmma_probe
  f = wgmma_probe.wgmma_steps(n=n, k_per_call=k, calls=256 // k, iters=3, warpgroups=wgs, a_in_registers=regs,
                              num_ctas=132)
  text = f.trace().lower(lowering_platforms=("cuda",)).as_text()
  assert "wgmma" in text
  assert wgmma_probe.k16_steps(n=n, k_per_call=k, calls=256 // k, iters=3, warpgroups=wgs, num_ctas=132) == \
      132 * wgs * 3 * 16
  with pytest.raises(ValueError, match="k_per_call"):
    wgmma_probe.wgmma_steps(n=n, k_per_call=24, calls=1, iters=1, warpgroups=1, a_in_registers=regs, num_ctas=1)


@pytest.mark.parametrize("wgs", [2, 4])
def test_wgmma_probe_with_decode_lowers_for_sm90(wgs):
  from pallas_kernels.w4a16 import wgmma_probe
  f = wgmma_probe.wgmma_steps(n=8, k_per_call=64, calls=4, iters=3, warpgroups=wgs, a_in_registers=True,
                              num_ctas=132, decode=True)
  assert "wgmma" in f.trace().lower(lowering_platforms=("cuda",)).as_text()
  with pytest.raises(ValueError, match="decode"):
    wgmma_probe.wgmma_steps(n=8, k_per_call=64, calls=2, iters=1, warpgroups=1, a_in_registers=True, num_ctas=1,
                            decode=True)


@pytest.mark.parametrize("m,k,n,g,cfg", [
    (16, 512, 192, 64, dict(num_ctas=3)),                          # one 16-row block, stream-K (the default)
    (64, 768, 128, 128, dict(splits=3, num_ctas=2)),               # one 64-row block, explicit K splits
    (8, 512, 192, 32, dict(min_block_m=8, fold="fma", convert_in_producer=True)),   # 8 rows, the fma fold
    (128, 512, 128, 64, dict(num_ctas=3)),                         # two 64-row blocks
])
def test_dense_reads_x_in_place_where_it_fills_its_blocks(monkeypatch, m, k, n, g, cfg):
  """Dense M that fills its row blocks: the kernel reads x where it is (x_in_block_order), bit-identical to the
  copy into block order; other M keep the copy."""
  rng = np.random.default_rng(300 + m)
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  seen = []
  real = ms.grouped_matmul

  def spy(*args, **kw):
    seen.append(kw.get("x_in_block_order", False))
    return real(*args, **kw)

  monkeypatch.setattr(ms, "grouped_matmul", spy)
  # under jit, as the public op calls it: an eager interpret-mode call dispatches its ops asynchronously, and ops
  # queued behind a running kernel can take the XLA:CPU pool threads its warpgroups need (a deadlock seen in CI)
  y = jax.jit(lambda x, w: ms.matmul(x, w, interpret=True, config=cfg))(x, w)
  full = {**ms.DENSE_CONFIG, **cfg}
  copied = jax.jit(lambda x, w: routing.dense_matmul(
      real, x, w, config=full, interpret=True, out_dtype=None,
      min_block_m=int(full.get("min_block_m", ms.DEFAULT_CONFIG["min_block_m"]))))(x, w)
  assert seen == [True]
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(copied, np.float32))
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2
  jax.jit(lambda x, w: ms.matmul(x, w, interpret=True, config=cfg))(x[: m - 1], w)   # one row short: copied
  assert seen == [True, False]
