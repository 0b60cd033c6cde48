"""MLA decode kernels on a real GPU (marked `gpu`; skipped without one): what interpret mode cannot show (races
between the TMA ring, the warpgroups and the wgmmas; register hazards; the compiled inline PTX). Every GPU backend
through the public api.mla_decode, on NaN-poisoned caches, zero / odd / page-boundary / multi-page lengths,
against the float64 reference on the dequantized cache with docs/architecture.md §3's tolerances (the bound for
kernels that round P to bf16, which the Hopper kernels may do). Run on the device with
`python -m pytest -m gpu tests/test_gpu_mla.py`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_decode import api
from pallas_kernels.mla_decode.reference import mla_decode_numpy
from pallas_kernels.testing import compare, random_problem
from test_gpu_w4a16 import gpu_backends

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")]
SCALE = 192 ** -0.5
LENS = [0, 1, 63, 64, 65, 777, 4097]


def assert_matches_float64(out, lse, q, cache, table, lens, causal):
  """§3's tolerances (with the bf16-P widening) against the float64 reference on the dequantized cache."""
  lat, rope = cache.dequantize()
  ref_out, ref_lse, ref_abs = mla_decode_numpy(np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope),
                                               np.asarray(table), np.asarray(lens), softmax_scale=SCALE,
                                               causal=causal, page_size=64, return_abs=True)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(16, 1, False), (128, 1, False), (16, 2, True), (128, 2, True)])
def test_mla_decode_vs_float64(backend, dtype, heads, sq, causal):
  q, cache, table, lens = random_problem(heads + sq + len(dtype), lens=LENS, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: api.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal,
                                                       backend=backend))(q, cache, table, lens)
  assert_matches_float64(out, lse, q, cache, table, lens, causal)
  assert out.dtype == jnp.bfloat16 and out.shape == (len(LENS), sq, heads, 512)


@pytest.mark.parametrize("rebase", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 2, True)])
def test_rows_kernel_rebase_vs_float64(rebase, dtype, heads, sq, causal):
  """The rows kernel with and without loop-variant operand addresses (mosaic_sm90_rows.Plan.rebase_per_page):
  the compiled code differs, the results must not."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens = random_problem(heads + sq + len(dtype) + 7, lens=LENS, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal,
                                                               kernel="rows", rebase_per_page=rebase))(
                                                                   q, cache, table, lens)
  assert_matches_float64(out, lse, q, cache, table, lens, causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 1, False), (64, 2, True), (128, 2, True)])
def test_seesaw_kernel_vs_float64(dtype, heads, sq, causal):
  """The opt-in seesaw kernel: register A operands, the whole-segment accumulator and the register split (fp8: the
  producer's conversion at 72 registers) run only here."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens = random_problem(heads + sq + 11, lens=LENS, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw"), c, t, n))(
          q, cache, table, lens)
  assert_matches_float64(out, lse, q, cache, table, lens, causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 2, True)])
def test_seesaw_kernel_other_p0_order_vs_float64(dtype, heads, sq, causal):
  """The seesaw kernel with the P0 hand-off order its cache does not take by default (early_p0: warpgroup 0's
  P0 V0_L in flight while it rescales and hands over P0; on for bf16, off for fp8): the register A operand and the
  accumulator must not be touched until the wait, which interpret mode does not run."""
  from pallas_kernels.mla_decode import mosaic_sm90
  early = dtype == "fp8_e4m3"
  q, cache, table, lens = random_problem(heads + sq + 23, lens=LENS, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw", early_p0=early),
      c, t, n))(q, cache, table, lens)
  assert_matches_float64(out, lse, q, cache, table, lens, causal)


@pytest.mark.parametrize("dtype,ahead", [("fp8_e4m3", 2), ("fp8_e4m3", 4), ("bfloat16", 1)])
@pytest.mark.parametrize("heads,sq,causal,lens", [
    (128, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129]),   # many short sequences a share: reads past each end
    (128, 2, True, LENS),
])
def test_seesaw_l2_prefetch_vs_float64(dtype, ahead, heads, sq, causal, lens):
  """The seesaw producer's L2 prefetch (TMA prefetches of the pages `ahead` pairs on): a hint that must not change
  a result or fault, on zero / odd / page-boundary lengths and a NaN-poisoned cache."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + ahead, lens=lens, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw", l2_prefetch=ahead),
      c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("ahead", [0, 4])
@pytest.mark.parametrize("heads,sq,causal,lens", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129]),    # many short sequences a share: reads past each end
    (16, 2, True, LENS),
    (20, 2, True, LENS),                                    # 40 rows: two groups of 32 (the page loaded by halves)
])
def test_swapped_producer_dequant_vs_float64(ahead, heads, sq, causal, lens):
  """The swapped kernel with producer_dequant (one producer converts each fp8 page into a 2-slot f16 ring) and an
  L2 prefetch: zero / odd / page-boundary lengths on a NaN-poisoned cache."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + ahead, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped",
                              producer_dequant=True, producers=1, l2_prefetch=ahead), c, t, n))(q, cache, table,
                                                                                                 lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("ahead", [0, 2])
@pytest.mark.parametrize("heads,sq,causal,lens,rows_per_cta", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129], None),   # many short sequences a share
    (16, 1, False, LENS, None),
    (16, 2, True, LENS, 16),                                     # Sq 2 at 16 rows a CTA: two head groups
    (8, 1, False, LENS, None),
])
def test_swapped_two_producers_vs_float64(ahead, heads, sq, causal, lens, rows_per_cta):
  """producer_dequant with two producer warpgroups (4 in the CTA; each converts one latent half of every page)."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + ahead + 3, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped",
                              producer_dequant=True, producers=2, l2_prefetch=ahead, rows_per_cta=rows_per_cta),
      c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("producers", [1, 2])
@pytest.mark.parametrize("heads,sq,causal,lens,rows_per_cta", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129], None),   # many short sequences a share: 1-page segments
    (16, 1, False, LENS, None),
    (16, 2, True, LENS, 16),                                     # Sq 2 at 16 rows a CTA: two head groups
    (8, 1, False, LENS, None),
])
def test_swapped_alternate_vs_float64(producers, heads, sq, causal, lens, rows_per_cta):
  """The compute warpgroups take alternate pages (alternate), with one or two producers: each warpgroup's own
  reductions (its SMEM scratch region), the hand-over at each segment's end, odd and empty shares of a segment."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + producers + 5, lens=lens, sq=sq, heads=heads,
                                           dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped",
                              producer_dequant=True, producers=producers, alternate=True,
                              rows_per_cta=rows_per_cta), c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("heads,sq,causal,lens,rows_per_cta", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129], None),   # many short sequences a share: 1-page segments
    (16, 1, False, LENS, None),
    (16, 2, True, LENS, 16),                                     # Sq 2 at 16 rows a CTA: two head groups
    (8, 1, False, LENS, None),
])
@pytest.mark.parametrize("loads_first,stages", [(False, None), (True, None), (False, 2)])
def test_swapped_register_dequant_vs_float64(loads_first, stages, heads, sq, causal, lens, rows_per_cta):
  """register_dequant: each page's e4m3 bytes converted into the wgmma A registers of both products (no f16 page),
  Q's dims and O's rows permuted to match; partial pages masked in the P.V operand. The two compute warpgroups take
  two ring slots each by default (4 stages); 2 stages: one each. Each compute warpgroup traces its own copy of the
  code here (shared_loop=False; the shared copy, the default, is test_swapped_shared_loop's)."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + 29, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped",
                              register_dequant=True, shared_loop=False, loads_first=loads_first,
                              rows_per_cta=rows_per_cta, num_stages=stages),
      c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("kw", [dict(producer_dequant=True), dict(register_dequant=True),
                                dict(register_dequant=True, scale_on_s=False),
                                dict(register_dequant=True, loads_first=True)],
                         ids=["producers", "register_dequant", "no_scale_on_s", "loads_first"])
@pytest.mark.parametrize("heads,sq,causal,lens,rows_per_cta", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129], None),   # many short sequences a share: 1-page segments
    (16, 1, False, LENS, None),
    (16, 2, True, LENS, 16),                                     # Sq 2 at 16 rows a CTA: two head groups
])
def test_swapped_shared_loop_vs_float64(kw, heads, sq, causal, lens, rows_per_cta):
  """shared_loop: the compute warpgroups of alternate pages run one traced copy of their code (the warpgroup index
  at run time), each reducing through its own SMEM region: the converting producers' plan and register_dequant (with
  two compute warpgroups the default fp8 plan at 16 rows a CTA, QK's scales applied to S), also with the scales
  on QK's operands instead (scale_on_s off) and with a product's shared-memory loads first (loads_first)."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + 41, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped", shared_loop=True,
                              rows_per_cta=rows_per_cta, **kw), c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("alternate", [False, True])
@pytest.mark.parametrize("heads,sq,causal,lens,rows_per_cta", [
    (16, 1, False, [5, 0, 130, 64, 1, 333, 2, 70, 129], None),   # many short sequences a share
    (16, 2, True, LENS, 16),                                     # Sq 2 at 16 rows a CTA: two head groups
])
def test_swapped_lookahead_vs_float64(alternate, heads, sq, causal, lens, rows_per_cta):
  """The converting producers load the next page while converting this one (lookahead), two producers."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + 17, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="swapped",
                              producer_dequant=True, producers=2, lookahead=True, alternate=alternate,
                              rows_per_cta=rows_per_cta), c, t, n))(q, cache, table, lens_a)
  assert_matches_float64(out, lse, q, cache, table, lens_a, causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 2, True)])
def test_seesaw_p0_first_vs_float64(dtype, heads, sq, causal):
  """The seesaw kernel with warpgroup 1's P0 V0_R before its P1 V1_R (p0_first) against float64."""
  from pallas_kernels.mla_decode import mosaic_sm90, mosaic_sm90_seesaw
  first = not mosaic_sm90_seesaw.P0_FIRST[dtype == "fp8_e4m3"]
  q, cache, table, lens = random_problem(heads + sq + 31, lens=LENS, sq=sq, heads=heads, dtype=dtype)
  out, lse = jax.jit(lambda q, c, t, n: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw", p0_first=first),
      c, t, n))(q, cache, table, lens)
  assert_matches_float64(out, lse, q, cache, table, lens, causal)


@pytest.mark.parametrize("option", ["b0_before_a1", "tile_release b0", "tile_release a1 b0"])
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 2, True)])
def test_seesaw_producer_option_vs_float64(option, dtype, heads, sq, causal):
  """The seesaw kernel with the producer option set the other way from its cache's default (b0_before_a1: slot
  0's part B filled before slot 1's part A; tile_release, fp8: page parts released to their QK tile by tile): the
  bits of the default, and within §3 of float64."""
  from pallas_kernels.mla_decode import mosaic_sm90, mosaic_sm90_seesaw as mss
  fp8 = dtype == "fp8_e4m3"
  if option.startswith("tile_release") and not fp8:
    pytest.skip("tile_release is the fp8 producer's")
  if option == "b0_before_a1":
    values = (not mss.B0_BEFORE_A1[fp8], mss.B0_BEFORE_A1[fp8])
  else:
    option, parts = option.split()[0], tuple(option.split()[1:])
    values = (parts, mss.TILE_RELEASE)
  q, cache, table, lens = random_problem(heads + sq + 29, lens=LENS, sq=sq, heads=heads, dtype=dtype)
  runs = [jax.jit(lambda q, c, t, n, o=o: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw", **{option: o}),
      c, t, n))(q, cache, table, lens) for o in values]
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert_matches_float64(*runs[0], q, cache, table, lens, causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,sq,causal,lens", [
    (128, 1, False, LENS),                                  # short sequences whole in a share, long ones split
    (64, 2, True, LENS),
    (128, 1, False, [640] * 12 + [0, 1]),                   # every sequence with pages whole in its share
])
def test_seesaw_direct_write_vs_float64(dtype, heads, sq, causal, lens):
  """The seesaw kernel writing the output of each sequence one share holds whole (bf16 stores from the
  accumulator's registers; the merge skipping those sequences) gives the bits of merging every partial, on the
  schedule the direct call computes (cuts charged: the merging call alone would pick its own payload)."""
  from pallas_kernels.mla_decode import mosaic_sm90
  q, cache, table, lens_a = random_problem(heads + sq + len(lens) + 41, lens=lens, sq=sq, heads=heads, dtype=dtype)
  schedule = mosaic_sm90.make_schedule(lens_a, table.shape[1], rows=sq * heads, fp8=dtype == "fp8_e4m3",
                                       kernel="seesaw")
  runs = [jax.jit(lambda q, c, t, n, s, d=d: api.apply_output_contract(
      *mosaic_sm90.mla_decode(q, c, t, n, softmax_scale=SCALE, causal=causal, kernel="seesaw", direct_write=d,
                              schedule=s),
      c, t, n))(q, cache, table, lens_a, schedule) for d in (True, False)]
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert_matches_float64(*runs[0], q, cache, table, lens_a, causal)


@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("batch,num_parts,cut", [(1, 1, 0), (13, 40, 5), (128, 132, 0), (130, 66, 5),
                                               (1100, 264, 5)])
def test_schedule_kernel_matches_xla_on_gpu(batch, num_parts, cut, num_warps):
  """The compiled split-KV schedule kernel (several programs of shares, one or two chunks of sequences) gives the
  XLA reference's prefix sums, payload and shares, with zero-length sequences and any warp count."""
  from pallas_kernels.mla_decode import mosaic_sm90, split_kv
  rng = np.random.default_rng(batch + num_parts)
  lens = rng.integers(0, 700, batch).astype(np.int32)
  lens[rng.random(batch) < 0.3] = 0
  cu_ref, sched_ref = (np.asarray(x) for x in mosaic_sm90.schedule(jnp.asarray((lens + 63) // 64), num_parts, cut))
  cu, sched, payload = (np.asarray(x) for x in split_kv.schedule_kernel(
      jnp.asarray(lens), num_parts, page=64, cut_pages=cut, num_warps=num_warps))
  np.testing.assert_array_equal(cu[:batch + 1], cu_ref)
  np.testing.assert_array_equal(sched[:, :num_parts].T, sched_ref)
  assert payload[0] == np.asarray(mosaic_sm90.share_pages(jnp.asarray(cu_ref), num_parts, cut))
