"""mosaic_sm90 backend: split-KV schedule, combine and plan as plain JAX; the kernel in GPU interpret mode (CPU).

The interpret-mode cases run the real kernel body (TMA ring, barriers, wgmma, the score swap between the two compute
warpgroups) on NaN-poisoned caches against the float64 NumPy reference on the dequantized cache, with the tolerances
of docs/architecture.md §3. Interpret mode is slow (~20 s a case on 2 cores), so the cases are a chosen cover: bf16 +
ragged + zero length (one head group), fp8 + Sq=2 causal + two head groups + partial pages, and one small fp8 case
under the race detector with a 2-slot ring that wraps.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from pallas_kernels.mla_decode import api
from pallas_kernels.mla_decode import mosaic_sm90 as ms
from pallas_kernels.mla_decode.cache import MLAKVCache
from pallas_kernels.mla_decode.split_kv import CUT_PAGES_DIRECT, schedule_kernel
from pallas_kernels.testing import compare, random_problem
from pallas_kernels.mla_decode.reference import mla_decode_numpy

SCALE = 192 ** -0.5


def f64_reference(q, cache, table, lens, causal):
  lat, rope = cache.dequantize()
  return mla_decode_numpy(np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), np.asarray(table),
                          np.asarray(lens), softmax_scale=SCALE, causal=causal, page_size=64)


def run_kernel(q, cache, table, lens, causal, **kw):
  out, lse = ms.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=causal, **kw)
  return api.apply_output_contract(out, lse, cache, table, lens)


# ---- schedule, combine, plan (plain JAX, fast) ---------------------------------------------------------------
@pytest.mark.parametrize("num_parts", [1, 3, 7, 40])
def test_schedule_covers_every_page_once(num_parts):
  rng = np.random.default_rng(num_parts)
  pages = rng.integers(0, 6, 13).astype(np.int32)
  pages[[0, 5, 12]] = 0                                           # zero-length sequences, also at the ends
  cu, sched = (np.asarray(x) for x in ms.schedule(jnp.asarray(pages), num_parts))
  assert cu[0] == 0 and np.array_equal(np.diff(cu), pages)
  seen = np.zeros(cu[-1], int)
  entries = set()
  for p, (begin, end, b_first, b_last) in enumerate(sched):
    seen[begin:end] += 1
    if end == begin:
      assert b_last < b_first
      continue
    covered = [b for b in range(b_first, b_last + 1) if min(end, cu[b + 1]) > max(begin, cu[b])]
    assert covered[0] == b_first and covered[-1] == b_last          # the share starts and ends inside pages
    assert all(cu[b] <= begin < cu[b + 1] for b in [b_first])
    for b in range(b_first, b_last + 1):
      assert p + b not in entries                                  # partial entry p + b is unique
      entries.add(p + b)
  assert np.all(seen == 1)
  assert max(entries, default=0) < num_parts + len(pages)


def test_combine_matches_one_softmax():
  """Partials cut by the schedule, merged by _combine, equal one softmax over each whole sequence."""
  rng = np.random.default_rng(0)
  lens_pages = np.array([3, 0, 1, 5, 2], np.int32)
  parts, g, n, d = 4, 2, 8, 512
  cu, sched = ms.schedule(jnp.asarray(lens_pages), parts)
  cu, sched_np = np.asarray(cu), np.asarray(sched)
  tokens = cu[-1] * 4                                              # 4 "tokens" per page is enough here
  s = rng.standard_normal((tokens, g, n)) * 3                      # log2-domain scores
  v = rng.standard_normal((tokens, d))
  e_total = parts + len(lens_pages)
  o_part = np.full((e_total, g, d, n), np.nan, np.float32)          # unwritten entries must not be read
  lse_part = np.full((e_total, g, n), np.nan, np.float32)
  for p, (begin, end, b0, b1) in enumerate(sched_np):
    for b in range(b0, b1 + 1):
      lo, hi = max(begin, cu[b]) * 4, min(end, cu[b + 1]) * 4
      if hi <= lo:
        continue
      m = s[lo:hi].max(0)
      w = np.exp2(s[lo:hi] - m)
      o_part[p + b] = np.einsum("tgn,td->gdn", w, v[lo:hi]) / w.sum(0)[:, None, :]
      lse_part[p + b] = m + np.log2(w.sum(0))
  out, lse = ms._combine(jnp.asarray(o_part), jnp.asarray(lse_part), sched, len(lens_pages))
  out, lse = np.asarray(out), np.asarray(lse)
  for b in range(len(lens_pages)):
    lo, hi = cu[b] * 4, cu[b + 1] * 4
    if hi == lo:
      assert np.all(out[b] == 0) and np.all(np.isposinf(lse[b]))
      continue
    m = s[lo:hi].max(0)
    w = np.exp2(s[lo:hi] - m)
    np.testing.assert_allclose(out[b], np.einsum("tgn,td->gdn", w, v[lo:hi]) / w.sum(0)[:, None, :],
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse[b], (m + np.log2(w.sum(0))) * np.log(2), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("batch,num_parts,cut", [(1, 1, 0), (7, 3, 0), (13, 40, 0), (130, 132, 0), (5, 33, 0),
                                               (13, 40, 5), (130, 66, 5), (1023, 7, 0), (1100, 264, 5)])
def test_schedule_kernel_matches_xla(batch, num_parts, cut):
  """split_kv.schedule_kernel (Pallas, interpret mode) == schedule (XLA): prefix sums, payload, every share's
  (begin, end, b_first, b_last), with zero-length sequences (also at both ends), lengths past a page boundary,
  more shares than pages, several programs of shares, a batch that fills one chunk of sequences exactly (1023 and
  cu[B]) and one over a chunk (1100: two chunks, each loaded up front), and cuts charged (cut_pages) or not."""
  rng = np.random.default_rng(batch * 1000 + num_parts)
  lens = rng.integers(0, 700, batch).astype(np.int32)
  lens[rng.random(batch) < 0.3] = 0
  lens[[0, -1]] = 0 if batch > 2 else lens[[0, -1]]
  cu_ref, sched_ref = (np.asarray(x) for x in ms.schedule(jnp.asarray((lens + 63) // 64), num_parts, cut))
  cu, sched, payload = (np.asarray(x) for x in ms.schedule_kernel(jnp.asarray(lens), num_parts, page=64,
                                                                  interpret=True, cut_pages=cut))
  np.testing.assert_array_equal(cu[:batch + 1], cu_ref)
  np.testing.assert_array_equal(sched[:, :num_parts].T, sched_ref)
  assert payload[0] == np.asarray(ms.share_pages(jnp.asarray(cu_ref), num_parts, cut))


def test_schedule_kernel_refuses_an_empty_batch_or_no_shares():
  with pytest.raises(ValueError, match="at least one sequence and one share"):
    ms.schedule_kernel(jnp.zeros((0,), jnp.int32), 4, page=64, interpret=True)
  with pytest.raises(ValueError, match="at least one sequence and one share"):
    ms.schedule_kernel(jnp.ones((3,), jnp.int32), 0, page=64, interpret=True)


def _snapped_payload(pages, num_parts, cut=0):
  """share_pages' rule, written out with exact fractions: the first payload in base .. base + 7 of the lowest
  payload + (2 * segments + cut * cut sequences) / shares, counting a sequence's cuts one by one."""
  from fractions import Fraction
  cu = np.concatenate([[0], np.cumsum(pages)])
  total = int(cu[-1])
  base = max(1, -(-total // num_parts))
  def time(c):
    shares_of = [int((cu[b + 1] - 1) // c - cu[b] // c + 1) for b in range(len(pages)) if pages[b] > 0]
    cuts = sum(n - 1 for n in shares_of)
    return c + Fraction(2 * sum(shares_of) + cut * cuts, max(1, -(-total // c)))
  return min(range(base, base + 8), key=lambda c: (time(c), c))


@pytest.mark.parametrize("pages,num_parts,cut,want", [
    ([64] * 64, 66, 0, 64),          # batch 64 at L4096: one sequence a share instead of 63-page shares
    ([65] * 64, 66, 0, 65),          # L4097..4160
    ([64] * 128, 66, 0, 125),        # batch 128: 2-sequence shares (128) would idle 2 SMs a group for less
    ([64] * 128, 66, 5, 128),        # ... unless every cut sequence costs a merge (direct write)
    ([64] * 64, 66, 5, 64),
    ([64] * 128, 132, 0, 64),        # one head group (h16): one sequence a share
    ([3, 0, 1, 5, 2], 4, 0, None), ([3, 0, 1, 5, 2], 4, 5, None), ([0] * 5, 7, 5, 1), ([1], 1, 0, 1)])
def test_split_payload_snaps_to_sequence_ends(pages, num_parts, cut, want):
  """The payload (XLA reference and schedule kernel) follows share_pages' rule, and for uniform batches takes whole
  sequences where that is cheaper."""
  pages = np.asarray(pages, np.int32)
  expect = _snapped_payload(pages, num_parts, cut)
  if want is not None:
    assert expect == want
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(jnp.asarray(pages))])
  assert int(ms.share_pages(cu, num_parts, cut)) == expect
  _, _, payload = ms.schedule_kernel(jnp.asarray(pages * 64 - 5).clip(0), num_parts, page=64, interpret=True,
                                     cut_pages=cut)
  assert int(payload[0]) == expect


@pytest.mark.parametrize("seed", range(4))
def test_split_payload_rule_on_random_batches(seed):
  rng = np.random.default_rng(seed)
  for _ in range(10):
    pages = rng.integers(0, 200, int(rng.integers(1, 70))).astype(np.int32)
    pages[rng.random(len(pages)) < 0.2] = 0
    num_parts = int(rng.integers(1, 133))
    cut = int(rng.integers(0, 9))
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(jnp.asarray(pages))])
    assert int(ms.share_pages(cu, num_parts, cut)) == _snapped_payload(pages, num_parts, cut)


@pytest.mark.parametrize("n,groups", [(8, 1), (32, 3)])
def test_merge_kernel_matches_xla_combine(n, groups):
  """split_kv.merge_partials (Pallas, interpret mode) == _combine (XLA) on random partials, including
  zero-page sequences, rows without any key (lse2 = -inf) and NaN in entries no sequence owns."""
  rng = np.random.default_rng(n)
  pages = np.array([3, 0, 1, 7, 2, 0], np.int32)
  parts = 5
  cu, sched = ms.schedule(jnp.asarray(pages), parts)
  e_total = parts + len(pages)
  o_part = rng.standard_normal((e_total, groups, 512, n)).astype(np.float32)
  lse2 = (rng.standard_normal((e_total, groups, n)) * 4).astype(np.float32)
  lse2[:, :, 0] = -np.inf                                          # row 0 never sees a key
  lse2[2, :, 1] = -np.inf                                          # an empty partial row among full ones
  owned = np.zeros(e_total, bool)
  for p, (begin, end, b0, b1) in enumerate(np.asarray(sched)):
    owned[[p + b for b in range(b0, b1 + 1)]] = end > begin
  o_part[~owned], lse2[~owned] = np.nan, np.nan                    # entries no (share, sequence) writes
  ref_out, ref_lse = ms._combine(jnp.asarray(o_part), jnp.asarray(lse2), sched, len(pages))
  out, lse = ms.merge_partials(jnp.asarray(o_part.reshape(-1, 512, n)), jnp.asarray(lse2.reshape(-1, n)), cu,
                               ms.share_pages(cu, parts).reshape(1), batch=len(pages), groups=groups,
                               out_dtype=jnp.float32, interpret=True)
  ref_out = np.swapaxes(np.asarray(ref_out), -1, -2).reshape(len(pages), groups * n, 512)
  np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse).reshape(len(pages), groups * n), rtol=1e-6)


def test_merge_kernel_direct_leaves_whole_sequences_alone():
  """merge_partials(direct=(out, lse)): sequences with exactly one share keep what the kernel wrote there (here a
  sentinel), the others (split over shares, or without pages) get the plain merge's values; the shapes and dtypes
  of direct are checked."""
  rng = np.random.default_rng(7)
  pages = np.array([3, 0, 1, 7, 2, 0, 4], np.int32)
  parts, n = 5, 8
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
  payload = ms.share_pages(cu, parts).reshape(1)
  e_total = parts + len(pages)
  o_part = jnp.asarray(rng.standard_normal((e_total, 512, n)).astype(np.float32))
  lse2 = jnp.asarray((rng.standard_normal((e_total, n)) * 4).astype(np.float32))
  kw = dict(batch=len(pages), groups=1, out_dtype=jnp.float32, interpret=True)
  ref_out, ref_lse = ms.merge_partials(o_part, lse2, cu, payload, **kw)
  sentinel = (jnp.full((len(pages), n, 512), 123.0, jnp.float32), jnp.full((len(pages), n), -5.0, jnp.float32))
  out, lse = ms.merge_partials(o_part, lse2, cu, payload, direct=sentinel, **kw)
  p = int(payload[0])
  c = np.asarray(cu)
  single = np.array([c[b + 1] > c[b] and (c[b + 1] - 1) // p == c[b] // p for b in range(len(pages))])
  assert single.any() and (~single).any(), (single, p)
  np.testing.assert_array_equal(np.asarray(out)[single], 123.0)
  np.testing.assert_array_equal(np.asarray(lse)[single], -5.0)
  np.testing.assert_array_equal(np.asarray(out)[~single], np.asarray(ref_out)[~single])
  np.testing.assert_array_equal(np.asarray(lse)[~single], np.asarray(ref_lse)[~single])
  with pytest.raises(ValueError, match="direct output 0 is bfloat16"):
    ms.merge_partials(o_part, lse2, cu, payload, direct=(sentinel[0].astype(jnp.bfloat16), sentinel[1]), **kw)


@pytest.mark.parametrize("rows", [1, 16, 20, 40, 64, 128, 256])
@pytest.mark.parametrize("fp8", [False, True])
def test_plan_fits(rows, fp8):
  plan = ms.make_plan(rows, fp8, num_parts=132)
  assert plan.n % 8 == 0 and 8 <= plan.n <= 32 and plan.n * plan.groups >= rows
  assert plan.n * (plan.groups - 1) < rows                         # no all-padding head group
  assert 1 <= plan.num_stages <= 4 and plan.smem_bytes <= ms.SMEM_LIMIT
  assert plan.split_p == (not fp8)
  assert plan.n & (plan.n - 1) == 0                               # N a power of two (the merge kernel's blocks)


@pytest.mark.parametrize("rows", [1, 9, 16, 20, 33, 128])
def test_reductions_fit_one_round_of_scratch(rows):
  """The kernel reduces [64, N] f32 WGMMA-layout scores over the 64 tokens (cross-warp). Mosaic does that through
  one SMEM scratch region shared by both compute warpgroups, in rounds of as many registers as fit; with two
  rounds the warpgroups overwrite each other's slots (wrong results on the H200 at N >= 24, never in interpret
  mode). Guard: for every N the plan can pick, one round holds all registers, computed from Mosaic's own layout."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  n = ms.make_plan(rows, True, num_parts=8).n
  layout = fa.WGMMA_LAYOUT
  registers = int(np.prod(layout.reduce((0,)).registers_shape((n,))))
  bytes_per_register = 4 * 32 * layout.vector_length * 4            # warps x lanes x vector x f32
  assert registers * bytes_per_register <= ms._reduction_scratch_bytes(n)


def test_rejects_what_it_cannot_run():
  with pytest.raises(ValueError, match="split_p"):
    ms.make_plan(16, True, split_p=True)
  with pytest.raises(ValueError, match="SMEM"):
    ms.make_plan(32, False, num_stages=4, rows_per_cta=32)
  with pytest.raises(ValueError, match="rows_per_cta"):
    ms.make_plan(16, True, rows_per_cta=12)
  q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
  small_pages = MLAKVCache.allocate(4, page_size=32, dtype="fp8_e4m3")
  with pytest.raises(ValueError, match="page_size 64"):
    ms.mla_decode(q, small_pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=0.1,
                  causal=False)
  f32 = MLAKVCache.allocate(4, dtype="float32")
  with pytest.raises(ValueError, match="bfloat16 and fp8_e4m3"):
    ms.mla_decode(q, f32, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=0.1,
                  causal=False)


def test_registered_and_never_auto_on_cpu():
  reasons = api.available_backends("fp8_e4m3", interpret=True)
  assert reasons["mosaic_sm90"] is None                            # interpret mode runs anywhere
  reason = api.available_backends("fp8_e4m3")["mosaic_sm90"]
  assert reason is not None and "9.0" in reason
  assert "float32" in api.available_backends("float32", interpret=True)["mosaic_sm90"]
  if jax.devices()[0].platform == "cpu":
    t = api._device_target(jax.devices()[0], "fp8_e4m3", False)
    assert api.select_backend("auto", t) == "xla"


# ---- the kernel in GPU interpret mode ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,heads,sq,lens,causal,parts", [
    ("bfloat16", 16, 1, [70, 0, 5], False, 3),          # one head group, zero length, partial pages, splits
    ("fp8_e4m3", 20, 2, [1, 130, 64], True, 3),         # two head groups (40 rows), causal, masked dequant
    ("fp8_e4m3", 16, 1, [129, 0, 64, 3], False, 3),     # one head group of 16, masked dequant, a full last page
])
def test_kernel_interpret(dtype, heads, sq, lens, causal, parts):
  q, cache, table, lens_a = random_problem(len(lens) + heads, lens=lens, sq=sq, heads=heads, dtype=dtype)
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts)
  ref_out, ref_lse = f64_reference(q, cache, table, lens_a, causal)
  res = compare(out, lse, ref_out, ref_lse)
  assert res["ok"], res
  assert out.dtype == jnp.bfloat16 and out.shape == (len(lens), sq, heads, 512)
  assert lse.dtype == jnp.float32 and lse.shape == (len(lens), heads, sq)


@pytest.mark.parametrize("seed,lens,kw", [
    (3, [130, 2], dict(num_stages=2)),      # a 2-slot fp8 ring that wraps (3 pages in one share), dequant + swap
    # producer_dequant: the producer's stores into the 2-slot f16 ring against both compute warpgroups' reads
    (5, [330, 2], dict(kernel="swapped", producer_dequant=True, producers=1)),
    # two producers, each storing one latent half of every page into the ring, the first also its rope by TMA
    (6, [330, 2], dict(kernel="swapped", producer_dequant=True, producers=2)),
    # alternate pages: each compute warpgroup reads its own slot; warpgroup 1's state handed over in SMEM
    (7, [330, 2, 65], dict(kernel="swapped", producer_dequant=True, producers=2, alternate=True)),
])
def test_kernel_interpret_no_races(seed, lens, kw):
  """Race detector on: 2 shares of an fp8 cache, the ring wrapping."""
  q, cache, table, lens = random_problem(seed, lens=lens, sq=1, heads=8, dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens, False, num_parts=2,
                        interpret=plgpu.InterpretGPUParams(detect_races=True), **kw)
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  res = compare(out, lse, *f64_reference(q, cache, table, lens, False))
  assert res["ok"], res


def test_engine_greedy_decode_matches_xla_in_interpret_mode():
  """mla_jax.LLM with attention_backend="mosaic_sm90" (GPU interpret mode, fp8 cache, page 64) generates the same
  greedy tokens as the xla backend: the engine's decode step through the schedule, kernel and merge."""
  import json
  from mla_jax.engine.llm import LLM
  from mla_jax.engine.params import SamplingParams
  import os
  from conftest import fixture_path
  fixture = fixture_path("real_dims")
  prompts = json.load(open(os.path.join(fixture, "generate_golden.json")))["prompts"][:2]
  runs = {}
  for backend in ("xla", "mosaic_sm90"):
    llm = LLM(fixture, dtype="float32", kv_cache_dtype="fp8_e4m3", attention_backend=backend, interpret=True,
              max_model_len=160, max_num_seqs=2, page_size=64, num_pages=8, max_num_batched_tokens=32)
    runs[backend] = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True))
  for ref, got in zip(runs["xla"], runs["mosaic_sm90"]):
    assert got.error is None and got.token_ids == ref.token_ids
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-2)


# ---- the rows kernel (mosaic_sm90_rows.py: 64 query rows per CTA on wgmma M, bf16 cache) -----------------------
def f64_reference_abs(q, cache, table, lens, causal):
  lat, rope = cache.dequantize()
  return mla_decode_numpy(np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), np.asarray(table),
                          np.asarray(lens), softmax_scale=SCALE, causal=causal, page_size=64, return_abs=True)


@pytest.mark.parametrize("heads,sq,lens,causal,parts", [
    (64, 1, [70, 0, 5], False, 3),                 # one row group, zero length, partial pages, splits
    (128, 1, [130, 1, 64], False, 2),              # two row groups, a full last page, 3 pages in one share
    (128, 2, [1, 130, 0, 64], True, 3),            # Sq 2 causal: 4 row groups (rows of both query tokens)
    (64, 2, [3, 200, 127], True, 4),               # Sq 2 causal, one query token per row group
])
def test_rows_kernel_interpret(heads, sq, lens, causal, parts):
  """kernel="rows" on NaN-poisoned caches against the float64 reference, with §3's bf16-P bound."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + sq, lens=lens, sq=sq, heads=heads, dtype="bfloat16")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="rows")
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, causal)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=ref_abs)
  assert res["ok"], res
  assert out.dtype == jnp.bfloat16 and out.shape == (len(lens), sq, heads, 512)
  assert lse.dtype == jnp.float32 and lse.shape == (len(lens), heads, sq)


def test_rows_kernel_pads_rows_not_multiple_of_64():
  """Forced kernel="rows" with 80 rows (h40 Sq2): the second row group is half zero-padded queries."""
  lens = [129, 7]
  q, cache, table, lens_a = random_problem(77, lens=lens, sq=2, heads=40, dtype="bfloat16")
  out, lse = run_kernel(q, cache, table, lens_a, True, interpret=True, num_parts=2, kernel="rows")
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, True)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=ref_abs)
  assert res["ok"], res


def test_rows_kernel_interpret_no_races():
  """Race detector on: a 1-slot ring (every page waits for the previous one's release), 2 shares, partial pages."""
  q, cache, table, lens = random_problem(9, lens=[130, 2], sq=1, heads=64, dtype="bfloat16")
  out, lse = run_kernel(q, cache, table, lens, False, num_parts=2, num_stages=1, kernel="rows",
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  res = compare(out, lse, *f64_reference_abs(q, cache, table, lens, False)[:2],
                ref_abs=f64_reference_abs(q, cache, table, lens, False)[2])
  assert res["ok"], res


@pytest.mark.parametrize("fp8", [False, True])
def test_seesaw_schedule_charges_cuts(monkeypatch, fp8):
  """With direct write (the seesaw default) the schedule mla_decode and make_schedule compute charges each cut
  sequence CUT_PAGES_DIRECT: b128 at 64 pages a sequence on 132 SMs (66 shares a row group at h128) takes 128-page
  shares of two whole sequences; the rows kernel (no direct write) keeps the 125-page shares."""
  monkeypatch.setattr(ms, "_num_sms", lambda: 132)
  lens = jnp.full((128,), 4096, jnp.int32)
  for kernel, want in (("seesaw", 128), ("rows", 125)):
    _, _, payload = ms.make_schedule(lens, 64, rows=128, fp8=fp8, interpret=True, kernel=kernel)
    assert int(payload[0]) == want, kernel
  lens64 = jnp.full((64,), 4096, jnp.int32)
  _, _, payload = ms.make_schedule(lens64, 64, rows=128, fp8=fp8, interpret=True, kernel="seesaw")
  assert int(payload[0]) == 64


def test_rows_kernel_schedule_matches_its_shares():
  """make_schedule(kernel=...) gives the share count of the kernel that runs; a schedule made for the other
  kernel is refused with a clear error instead of silently mis-splitting."""
  q, cache, table, lens = random_problem(3, lens=[70, 5], sq=1, heads=128, dtype="bfloat16")
  rows_sched = ms.make_schedule(lens, table.shape[1], rows=128, fp8=False, interpret=True, kernel="rows")
  swapped_sched = ms.make_schedule(lens, table.shape[1], rows=128, fp8=False, interpret=True, kernel="swapped")
  assert rows_sched[1].shape != swapped_sched[1].shape                 # 2 row groups vs 4 head groups
  out, lse = run_kernel(q, cache, table, lens, False, interpret=True, kernel="rows", schedule=rows_sched)
  res = compare(out, lse, *f64_reference_abs(q, cache, table, lens, False)[:2],
                ref_abs=f64_reference_abs(q, cache, table, lens, False)[2])
  assert res["ok"], res
  with pytest.raises(ValueError, match="schedule"):
    ms.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=False, interpret=True, kernel="rows",
                  schedule=swapped_sched)


def test_plan_defaults():
  """The measured defaults: the fp8 seesaw prefetches 1 page pair into L2 (not for bf16); the
  swapped kernel's producer converts fp8 pages from 32 rows per CTA (h20, h32, h16 Sq 2), with 2 pages prefetched;
  16 rows a CTA (h16, h8 Sq 2, h9) take register_dequant with one shared copy of the compute code, or, when an option
  of the producers' plan is given, that plan with two producers."""
  seesaw = ms.mosaic_sm90_seesaw
  assert seesaw.make_plan(128, num_sms=132, fp8=True).l2_prefetch == seesaw.DEFAULT_L2_PREFETCH == 1
  assert seesaw.make_plan(128, num_sms=132, fp8=False).l2_prefetch == 0
  assert seesaw.make_plan(128, num_sms=132, fp8=True, l2_prefetch=0).l2_prefetch == 0
  for fp8 in (False, True):
    assert seesaw.make_plan(128, num_sms=132, fp8=fp8).direct_write == seesaw.DIRECT_WRITE[fp8]
    assert seesaw.make_plan(128, num_sms=132, fp8=fp8, direct_write=False).direct_write is False
  for rows, on in ((32, True), (20, True), (40, True), (8, False), (1, False)):
    plan = ms.make_plan(rows, True)
    assert (plan.producer_dequant, plan.l2_prefetch) == ((True, ms.DEFAULT_L2_PREFETCH_PAGES) if on else (False, 0))
    assert (plan.producers, plan.register_dequant, plan.shared_loop) == (1, False, False), rows
  for rows in (16, 9):
    plan = ms.make_plan(rows, True)
    assert (plan.n, plan.register_dequant, plan.shared_loop, plan.producer_dequant, plan.producers,
            plan.l2_prefetch) == (16, True, True, False, 1, ms.REGISTER_DEQUANT_L2_PREFETCH_PAGES), rows
    assert plan == ms.make_plan(rows, True, register_dequant=True, shared_loop=True)
  assert not ms.make_plan(16, False).register_dequant                          # bf16: nothing to convert
  for producer_option in (dict(producer_dequant=True), dict(producers=2), dict(lookahead=True), dict(alternate=True),
                          dict(producer_registers=96), dict(num_stages=2)):
    plan = ms.make_plan(16, True, **producer_option)
    assert plan.producer_dequant and not (plan.register_dequant or plan.shared_loop), producer_option
  plan = ms.make_plan(32, False)
  assert (plan.producer_dequant, plan.l2_prefetch) == (False, 0)
  plan = ms.make_plan(32, True, producer_dequant=False)
  assert (plan.producer_dequant, plan.l2_prefetch) == (False, 0)
  plan = ms.make_plan(16, True, producer_dequant=True)
  assert (plan.producer_dequant, plan.l2_prefetch) == (True, ms.DEFAULT_L2_PREFETCH_PAGES)
  two = ms.make_plan(32, True, rows_per_cta=16)                                 # 16 rows per CTA, 2 groups
  assert (two.n, two.groups, two.register_dequant) == (16, 2, True)
  two = ms.make_plan(32, True, rows_per_cta=16, producer_dequant=True)
  assert (two.n, two.producer_dequant, two.producers) == (16, True, 2)
  assert ms.make_plan(16, True, producer_dequant=False).producers == 1
  with pytest.raises(ValueError, match="needs producer_dequant"):
    ms.make_plan(32, True, producer_dequant=False, l2_prefetch=2)


def test_register_splits_fit_the_launch():
  """setmaxnreg only moves registers between a CTA's warpgroups: a split over what the CTA launched with waits
  forever in its first increase (four producers' 4 x 56 + 2 x 144 = 512 hung on an H100: six warpgroups launch with
  80 registers a thread, 480 a thread-slot). Every split the plans pick fits, and an over-budget one is refused."""
  from pallas_kernels.sm90_registers import check_register_split, launch_registers
  assert [launch_registers(w) for w in (1, 3, 4, 6)] == [248, 168, 128, 80]   # ptxas: "Used 80 registers" at 6
  for rows in (1, 8, 9, 16, 20, 32, 40, 64):
    for producers, lookahead in ((None, None), (1, False), (1, True), (2, False), (2, True)):
      if producers and producers > 1 and rows > 16:
        continue
      plan = ms.make_plan(rows, True, producer_dequant=True, producers=producers, lookahead=lookahead)
      p, c = plan.registers
      assert plan.producers * p + 2 * c <= plan.num_warpgroups * launch_registers(plan.num_warpgroups), (rows, plan)
  with pytest.raises(ValueError, match="wait forever"):
    ms.make_plan(16, True, producers=2, producer_registers=120)               # 2 x 120 + 2 x 144 > 4 x 128
  with pytest.raises(ValueError, match="multiples of 8"):
    ms.make_plan(16, True, producers=2, compute_registers=150)
  with pytest.raises(ValueError, match="producer_dequant"):
    ms.make_plan(16, True, producer_dequant=False, compute_registers=128)
  assert ms.make_plan(16, True, producers=2, producer_registers=96, compute_registers=152).registers == (96, 152)
  seesaw = ms.mosaic_sm90_seesaw
  for fp8 in (False, True):
    plan = seesaw.make_plan(128, num_sms=132, fp8=fp8)
    check_register_split([plan.producer_registers] + [plan.compute_registers] * 2, "seesaw default")
  with pytest.raises(ValueError, match="wait forever"):
    seesaw.make_plan(128, num_sms=132, fp8=True, producer_registers=56, compute_registers=232)
  from pallas_kernels.mla_decode.sm90_shared import COMPUTE_REGISTERS, TMA_PRODUCER_REGISTERS
  check_register_split([TMA_PRODUCER_REGISTERS] + [COMPUTE_REGISTERS] * 2,
                       "the rows kernel and the swapped kernel without producer_dequant")
  # mla_decode hands the split to the swapped kernel's plan, and refuses it for a kernel that has none
  q, cache, table, lens = random_problem(3, lens=[70], sq=1, heads=16, dtype="fp8_e4m3")
  with pytest.raises(ValueError, match="wait forever"):
    ms.mla_decode(q, cache, table, lens, softmax_scale=0.1, causal=False, interpret=True, kernel="swapped",
                  producer_dequant=True, producers=2, registers=dict(producer_registers=120))
  with pytest.raises(ValueError, match="registers"):
    ms.mla_decode(q, cache, table, lens, softmax_scale=0.1, causal=False, interpret=True, kernel="rows",
                  registers=dict(compute_registers=200))


def test_kernel_choice():
  assert ms.choose_kernel(128, False) == "seesaw" and ms.choose_kernel(64, False) == "seesaw"
  assert ms.choose_kernel(256, False) == "seesaw"                      # h128 Sq2
  assert ms.choose_kernel(128, False, "rows") == "rows"
  assert ms.choose_kernel(128, True) == "seesaw" and ms.choose_kernel(64, True) == "seesaw"
  assert ms.choose_kernel(16, True) == "swapped" and ms.choose_kernel(80, True) == "swapped"
  assert ms.choose_kernel(128, True, "rows") == "rows"
  assert ms.choose_kernel(80, False) == "swapped" and ms.choose_kernel(32, False) == "swapped"
  assert ms.choose_kernel(80, False, "rows") == "rows"
  assert ms.choose_kernel(128, False, "swapped") == "swapped"
  with pytest.raises(ValueError, match="kernel must be"):
    ms.choose_kernel(128, False, "fast")
  q = jnp.zeros((1, 1, 64, 576), jnp.bfloat16)
  cache = MLAKVCache.allocate(2, dtype="bfloat16")
  with pytest.raises(ValueError, match="swapped kernel only"):
    ms.mla_decode(q, cache, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=0.1,
                  causal=False, split_p=True, kernel="rows")


def test_rows_plan_fits_smem():
  from pallas_kernels.mla_decode import mosaic_sm90_rows as mr
  plan = mr.make_plan(128, num_sms=132)
  assert (plan.groups, plan.num_parts, plan.num_stages) == (2, 66, 2)
  assert plan.smem_bytes <= mr.SMEM_LIMIT < mr.smem_bytes(3)
  with pytest.raises(ValueError, match="SMEM"):
    mr.make_plan(128, num_sms=132, num_stages=3)
  fp8 = mr.make_plan(128, num_sms=132, fp8=True)          # default: 1 fp8 slot (2 slots: opt-in, unmeasured)
  assert (fp8.groups, fp8.num_parts, fp8.num_stages, fp8.fp8) == (2, 66, 1, True)
  fp8_2 = mr.make_plan(128, num_sms=132, num_stages=2, fp8=True)   # no rope copies, Q's rope in registers
  assert fp8.smem_bytes <= mr.SMEM_LIMIT and fp8_2.smem_bytes <= mr.SMEM_LIMIT < mr.smem_bytes(3, fp8=True)
  with pytest.raises(ValueError, match=r"num_stages in \[1, 2\]"):
    mr.make_plan(128, num_sms=132, num_stages=3, fp8=True)


def test_merge_kernel_rows_major_matches_transposed():
  """merge_partials(rows_major=True) on partials [E*G, N, 512] == the default orientation on their transpose."""
  rng = np.random.default_rng(64)
  pages = np.array([3, 0, 1, 7, 2], np.int32)
  parts, groups, n = 4, 2, 64
  cu, _ = ms.schedule(jnp.asarray(pages), parts)
  e_total = parts + len(pages)
  o_rows = rng.standard_normal((e_total * groups, n, 512)).astype(np.float32)
  lse2 = (rng.standard_normal((e_total * groups, n)) * 4).astype(np.float32)
  lse2[:, 0] = -np.inf
  payload = ms.share_pages(cu, parts).reshape(1)
  kw = dict(batch=len(pages), groups=groups, out_dtype=jnp.float32, interpret=True)
  out_r, lse_r = ms.merge_partials(jnp.asarray(o_rows), jnp.asarray(lse2), cu, payload, rows_major=True, **kw)
  out_t, lse_t = ms.merge_partials(jnp.asarray(np.swapaxes(o_rows, 1, 2)), jnp.asarray(lse2), cu, payload, **kw)
  np.testing.assert_array_equal(np.asarray(out_r), np.asarray(out_t))
  np.testing.assert_array_equal(np.asarray(lse_r), np.asarray(lse_t))


def test_merge_kernel_row_of_dim_gathers_rows_in_dim_order():
  """merge_partials(row_of_dim=R) on partials whose row R[d] holds dim d == the plain merge of them put in dim order
  first (register_dequant's P.V order; a random permutation too); a malformed table is refused."""
  rng = np.random.default_rng(65)
  pages = np.array([3, 0, 1, 7, 2], np.int32)
  parts, groups, n = 4, 1, 16
  cu, _ = ms.schedule(jnp.asarray(pages), parts)
  e_total = parts + len(pages)
  o_dims = rng.standard_normal((e_total * groups, 512, n)).astype(np.float32)
  lse2 = (rng.standard_normal((e_total * groups, n)) * 4).astype(np.float32)
  lse2[:, 0] = -np.inf
  payload = ms.share_pages(cu, parts).reshape(1)
  kw = dict(batch=len(pages), groups=groups, out_dtype=jnp.float32, interpret=True)
  want = ms.merge_partials(jnp.asarray(o_dims), jnp.asarray(lse2), cu, payload, **kw)
  # (the table as an operand; the same map as a function the kernel runs itself, as mla_decode passes it)
  rd_table = np.asarray(ms.fp8_ops.row_of_dim())
  for table, arg in ((rd_table, jnp.asarray(rd_table)), (rd_table, ms.fp8_ops.row_of_dim),
                     (perm := rng.permutation(512).astype(np.int32), jnp.asarray(perm))):
    o_rows = np.empty_like(o_dims)
    o_rows[:, table] = o_dims                           # row table[d] holds dim d
    got = ms.merge_partials(jnp.asarray(o_rows), jnp.asarray(lse2), cu, payload, row_of_dim=arg, **kw)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="row_of_dim must be int32"):
    ms.merge_partials(jnp.asarray(o_dims), jnp.asarray(lse2), cu, payload, row_of_dim=jnp.arange(256), **kw)
  with pytest.raises(ValueError, match="not rows_major"):
    ms.merge_partials(jnp.asarray(np.swapaxes(o_dims, 1, 2)), jnp.asarray(lse2), cu, payload, rows_major=True,
                      row_of_dim=ms.fp8_ops.row_of_dim, **kw)


@pytest.mark.parametrize("cols", [16, 32, 64, 256])
def test_merge_kernel_tilings_give_the_same_bits(cols):
  """merge_partials(cols=c): c latent columns a program instead of 128 (more programs for the same work) gives the
  default's bits in every orientation (dims-major, register_dequant's row function, rows-major with direct outputs);
  a tiling that does not divide the 512 columns is refused."""
  rng = np.random.default_rng(66)
  pages = np.array([3, 0, 1, 7, 2], np.int32)
  parts, n = 4, 16
  cu, _ = ms.schedule(jnp.asarray(pages), parts)
  payload = ms.share_pages(cu, parts).reshape(1)
  e_total = parts + len(pages)
  o_part = jnp.asarray(rng.standard_normal((e_total, 512, n)).astype(np.float32))
  lse2 = (rng.standard_normal((e_total, n)) * 4).astype(np.float32)
  lse2[:, 0] = -np.inf
  lse2 = jnp.asarray(lse2)
  kw = dict(batch=len(pages), groups=1, out_dtype=jnp.float32, interpret=True)
  sentinel = (jnp.full((len(pages), n, 512), 7.0, jnp.float32), jnp.full((len(pages), n), -3.0, jnp.float32))
  for o, extra in ((o_part, {}), (o_part, dict(row_of_dim=ms.fp8_ops.row_of_dim)),
                   (jnp.swapaxes(o_part, 1, 2), dict(rows_major=True, direct=sentinel))):
    want = ms.merge_partials(o, lse2, cu, payload, **extra, **kw)
    got = ms.merge_partials(o, lse2, cu, payload, cols=cols, num_stages=2, **extra, **kw)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for bad in (8, 48, 1024, 64.0):
    with pytest.raises(ValueError, match="cols must be a power of two"):
      ms.merge_partials(o_part, lse2, cu, payload, cols=bad, **kw)


def test_merge_cols_rule():
  """The merge's default tiling (measured): 64 columns a program for dims-major partials where 128 would make fewer
  than MERGE_MIN_PROGRAMS programs (b32 h16), else 128; rows-major partials (the seesaw kernel's) always 128."""
  from pallas_kernels.mla_decode import split_kv
  assert split_kv.merge_cols(128, 1) == split_kv.merge_cols(64, 1) == 128      # 512 / 256 programs
  assert split_kv.merge_cols(32, 1) == split_kv.merge_cols(4, 1) == split_kv.merge_cols(16, 2) == 64
  assert split_kv.merge_cols(32, 1, rows_major=True) == split_kv.merge_cols(4, 2, rows_major=True) == 128


# ---- the rows kernel with an fp8 cache (each warpgroup dequantizes its token half; a 1-slot fp8 ring by default,
# 2 slots held through QK as an option) ----------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("heads,sq,lens,causal,parts", [
    (64, 1, [70, 0, 5], False, 3),       # zero length; last pages with 6 and 5 tokens (warpgroup 1's half empty)
    (128, 1, [130, 1, 64], False, 2),    # two row groups, a full last page, the 1-slot ring wraps within a share
    (128, 2, [1, 130, 0, 64], True, 3),  # Sq 2 causal, 4 row groups
    (64, 2, [3, 200, 100], True, 4),     # Sq 2 causal; last pages of 8 and 36 tokens (warpgroup 1's half partial)
])
def test_rows_kernel_fp8_interpret(heads, sq, lens, causal, parts, stages):
  """kernel="rows" with an fp8 cache on NaN-poisoned pages (unused slots, pages and scales) against the float64
  reference on the dequantized cache. P and V are f16 here, so §3's plain bound applies (no bf16-P widening).
  stages=2: the slot held through QK, Q's rope through the interpret fallback (SMEM, not registers)."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + sq + 1000, lens=lens, sq=sq, heads=heads,
                                           dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, num_stages=stages,
                        kernel="rows")
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res
  assert res["cos_diff"] < 1e-5
  assert out.dtype == jnp.bfloat16 and out.shape == (len(lens), sq, heads, 512)
  assert lse.dtype == jnp.float32 and lse.shape == (len(lens), heads, sq)


@pytest.mark.parametrize("stages", [1, 2])
def test_rows_kernel_fp8_interpret_no_races(stages):
  """Race detector on the fp8 rows path: the ring refilled while the f16 page is in use, 2 shares (one with 3
  pages, so kbuf is reused across pages and segments and the 2-slot ring wraps), a partial last page."""
  q, cache, table, lens = random_problem(11, lens=[130, 2], sq=1, heads=64, dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens, False, num_parts=2, num_stages=stages, kernel="rows",
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  res = compare(out, lse, *f64_reference(q, cache, table, lens, False))
  assert res["ok"], res


def test_rows_kernel_fp8_schedule_matches_its_shares():
  """make_schedule(kernel="rows", fp8=True) gives the rows kernel's shares (2 row groups at h128), and the fp8 call
  accepts it; the swapped kernel's schedule for the same call is refused."""
  q, cache, table, lens = random_problem(5, lens=[70, 5], sq=1, heads=128, dtype="fp8_e4m3")
  rows_sched = ms.make_schedule(lens, table.shape[1], rows=128, fp8=True, interpret=True, kernel="rows")
  swapped_sched = ms.make_schedule(lens, table.shape[1], rows=128, fp8=True, interpret=True, kernel="swapped")
  assert rows_sched[1].shape != swapped_sched[1].shape
  out, lse = run_kernel(q, cache, table, lens, False, interpret=True, kernel="rows", schedule=rows_sched)
  res = compare(out, lse, *f64_reference(q, cache, table, lens, False))
  assert res["ok"], res
  with pytest.raises(ValueError, match="schedule"):
    ms.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=False, interpret=True, kernel="rows",
                  schedule=swapped_sched)


def _lower_rows_for_sm90(plan, *, heads, sq, causal, batch=4, num_pages=64, max_pages=8, kernel="rows"):
  """Lowers a 64-rows-per-CTA kernel (rows or seesaw) for CUDA on this (CPU) machine: Mosaic GPU's own checks run
  here (layout inference, wgmma operand shapes and dtypes, swizzles, the SMEM limit of an sm90 block)."""
  s = jax.ShapeDtypeStruct
  call = ms.ROWS_KERNELS[kernel].build_call(plan, batch=batch, sq=sq, heads=heads, causal=causal, softmax_scale=SCALE,
                       num_pages=num_pages, interpret=False)
  qrows = batch * plan.groups
  q_args = (s((qrows, 64, 512), jnp.bfloat16), s((qrows, 64, 64), jnp.bfloat16))
  if plan.fp8:
    cache_args = q_args + (s((num_pages, 64, 512), jnp.float8_e4m3fn), s((num_pages, 64, 64), jnp.bfloat16),
                           s((num_pages, 64, 4), jnp.float32))
  else:
    cache_args = q_args + (s((num_pages, 64, 512), jnp.bfloat16), s((num_pages, 64, 64), jnp.bfloat16))
  args = cache_args + (s((batch, max_pages), jnp.int32), s((batch,), jnp.int32), s((batch + 1,), jnp.int32),
                       s((4, plan.num_parts), jnp.int32))
  return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mosaic_smem_bytes(plan, **kw):
  """Mosaic's own count of the kernel's dynamic SMEM (its error message under an artificial limit of 0 bytes)."""
  import re
  from jax.experimental.mosaic.gpu import core as mgpu_core
  with mgpu_core.artificial_shared_memory_limit(0):
    with pytest.raises(ValueError, match="exceeds available shared memory") as e:
      _lower_rows_for_sm90(plan, **kw)
  return int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))


@pytest.mark.parametrize("fp8,heads,sq,causal,stages", [
    (False, 128, 1, False, None), (True, 128, 1, False, None), (True, 64, 2, True, None),
    (True, 128, 1, False, 2), (True, 64, 2, True, 2),     # the 2-slot fp8 ring: Q's rope as a register A operand
])
def test_rows_kernel_lowers_for_sm90(fp8, heads, sq, causal, stages):
  """The GPU code path (P and, with 2 fp8 slots, Q's rope as register A operands, in-place accumulator, the
  dequant layouts) lowers for sm90, and smem_bytes equals Mosaic's SMEM count: the plan fits, one more slot
  exceeds the 227 KiB of a block."""
  import dataclasses
  from pallas_kernels.mla_decode import mosaic_sm90_rows as mr
  plan = mr.make_plan(sq * heads, num_sms=8, fp8=fp8, num_stages=stages)
  assert "mosaic_gpu" in _lower_rows_for_sm90(plan, heads=heads, sq=sq, causal=causal)
  assert _mosaic_smem_bytes(plan, heads=heads, sq=sq, causal=causal) == plan.smem_bytes <= mr.SMEM_LIMIT
  if fp8 and plan.num_stages == 1:
    return                   # one more fp8 slot is the other layout (no rope copies): the stages=2 cases
  deeper = dataclasses.replace(plan, num_stages=plan.num_stages + 1)
  assert mr.smem_bytes(deeper.num_stages, fp8) > mr.SMEM_LIMIT
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    _lower_rows_for_sm90(deeper, heads=heads, sq=sq, causal=causal)


# ---- rows kernel: loop-variant operand addresses (rebase_per_page; default on) ------------------------------
@pytest.mark.parametrize("dtype,heads,sq,lens,causal,parts", [
    ("fp8_e4m3", 64, 1, [70, 0, 5], False, 3),      # zero length; partial last pages; a share spans sequences
    ("fp8_e4m3", 64, 2, [3, 200, 100], True, 4),    # Sq 2 causal
    ("bfloat16", 128, 1, [130, 1, 64], False, 2),   # two row groups
])
def test_rows_kernel_rebase_interpret(dtype, heads, sq, lens, causal, parts):
  """rebase_per_page adds a run-time zero to kbuf's and Q's SMEM indices: against the float64 reference and
  bit-identical without it (the same products in the same order)."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + sq + 3000, lens=lens, sq=sq, heads=heads, dtype=dtype)
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="rows",
                        rebase_per_page=True)
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, causal)
  # fp8: f16 P, the plain bound; bf16: the bf16-P bound (§3)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res
  out0, lse0 = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="rows",
                          rebase_per_page=False)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))


@pytest.mark.parametrize("fp8", [True, False])
def test_rows_kernel_rebase_lowers_for_sm90(fp8):
  """Without rebase_per_page it lowers too (the default, on: test_rows_kernel_lowers_for_sm90)."""
  from pallas_kernels.mla_decode import mosaic_sm90_rows as mr
  plan = mr.make_plan(128, num_sms=8, fp8=fp8, rebase_per_page=False)
  default = mr.make_plan(128, num_sms=8, fp8=fp8)
  assert not plan.rebase_per_page and default.rebase_per_page
  assert default.prefetch_tiles == (2 if fp8 else 0)
  assert "mosaic_gpu" in _lower_rows_for_sm90(plan, heads=128, sq=1, causal=False)


def test_rows_kernel_rebase_refused_for_swapped():
  q, cache, table, lens = random_problem(3, lens=[70, 5], sq=1, heads=16, dtype="fp8_e4m3")
  with pytest.raises(ValueError, match="apply to the rows kernel"):
    run_kernel(q, cache, table, lens, False, interpret=True, kernel="swapped", rebase_per_page=True)


# ---- fp8 rows with the next page's dequant tiles converted while P.V runs (prefetch_tiles, opt-in) --------------
@pytest.mark.parametrize("heads,sq,lens,causal,parts,k", [
    (64, 1, [70, 0, 5], False, 3, 2),      # zero length; last pages of 6 and 5 tokens; a share spans sequences
    (128, 1, [130, 1, 64], False, 2, 4),   # two row groups, 3-page segments: prefetch inside a segment
    (64, 2, [3, 200, 100], True, 4, 1),    # Sq 2 causal; partial halves of either warpgroup
])
def test_rows_kernel_fp8_prefetch_interpret(heads, sq, lens, causal, parts, k):
  """Against the float64 reference, and bit-identical to the default schedule: prefetching only moves when a
  tile is loaded and converted (interpret mode runs the same products in the same order)."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + sq + 2000, lens=lens, sq=sq, heads=heads,
                                           dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="rows",
                        prefetch_tiles=k)
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res
  assert res["cos_diff"] < 1e-5
  out0, lse0 = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="rows")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))


def test_rows_kernel_fp8_prefetch_no_races():
  """Race detector: the next page's slot read while P.V reads kbuf, kbuf rewritten after kfree, 2 shares."""
  q, cache, table, lens = random_problem(13, lens=[130, 2], sq=1, heads=64, dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens, False, num_parts=2, kernel="rows", prefetch_tiles=2,
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  res = compare(out, lse, *f64_reference(q, cache, table, lens, False))
  assert res["ok"], res


@pytest.mark.parametrize("k,heads,sq,causal", [(2, 128, 1, False), (4, 128, 1, False), (1, 64, 2, True)])
def test_rows_kernel_fp8_prefetch_lowers_for_sm90(k, heads, sq, causal):
  """The GPU structure (O in one accumulator for the whole segment, rescaled through the ref, P as a register A
  operand, the next page's tiles converted between the P.V wgmma and its wait) lowers; SMEM unchanged."""
  from pallas_kernels.mla_decode import mosaic_sm90_rows as mr
  plan = mr.make_plan(sq * heads, num_sms=8, fp8=True, prefetch_tiles=k)
  assert "mosaic_gpu" in _lower_rows_for_sm90(plan, heads=heads, sq=sq, causal=causal)
  assert _mosaic_smem_bytes(plan, heads=heads, sq=sq, causal=causal) == plan.smem_bytes == mr.smem_bytes(1, True)


def test_rows_kernel_prefetch_refusals():
  from pallas_kernels.mla_decode import mosaic_sm90_rows as mr
  with pytest.raises(ValueError, match="fp8 cache with a 1-slot ring"):
    mr.make_plan(128, num_sms=8, fp8=False, prefetch_tiles=2)
  with pytest.raises(ValueError, match="fp8 cache with a 1-slot ring"):
    mr.make_plan(128, num_sms=8, fp8=True, num_stages=2, prefetch_tiles=2)
  with pytest.raises(ValueError, match="prefetch_tiles must be in"):
    mr.make_plan(128, num_sms=8, fp8=True, prefetch_tiles=5)
  q, cache, table, lens = random_problem(3, lens=[70, 5], sq=1, heads=16, dtype="fp8_e4m3")
  with pytest.raises(ValueError, match="apply to the rows kernel"):
    run_kernel(q, cache, table, lens, False, interpret=True, kernel="swapped", prefetch_tiles=2)


def test_fp8_q_operands_never_write_the_concatenation():
  """With an fp8 cache the swapped kernel reads Q's latent part (f16) from one array and its rope part from the
  last 64 columns of another. With padded rows (40 of 64 here) q whole is sliced before the pad, so when q is a
  concatenation of two parts XLA takes each from its own operand and no [.., 576] array is written (the optimized
  HLO has no concatenate); q apart (q_rope=) gives the same arrays; without padding q whole is the rope operand
  itself (a reshape, no copy)."""
  a = jax.ShapeDtypeStruct((3, 2, 20, 512), jnp.bfloat16)     # [B, Sq, H, .] parts
  b = jax.ShapeDtypeStruct((3, 2, 20, 64), jnp.bfloat16)
  f = jax.jit(lambda a, b: ms.fp8_q_operands(jnp.concatenate([a, b], axis=-1), None, 64, 1))
  text = f.lower(a, b).compile().as_text()
  assert "concatenate" not in text
  rng = np.random.default_rng(0)
  an = jnp.asarray(rng.standard_normal(a.shape), jnp.bfloat16)
  bn = jnp.asarray(rng.standard_normal(b.shape), jnp.bfloat16)
  lat, rope = f(an, bn)
  assert lat.shape == (3, 64, 512) and lat.dtype == jnp.float16 and rope.shape == (3, 64, 64)
  np.testing.assert_array_equal(np.asarray(lat[:, :40], np.float32),
                                np.asarray(an, np.float32).reshape(3, 40, 512))
  np.testing.assert_array_equal(np.asarray(rope[:, :40], np.float32), np.asarray(bn, np.float32).reshape(3, 40, 64))
  assert not np.asarray(lat[:, 40:], np.float32).any() and not np.asarray(rope[:, 40:], np.float32).any()
  for x, y in zip((lat, rope), jax.jit(lambda a, b: ms.fp8_q_operands(a, b, 64, 1))(an, bn)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  # no padded rows (Sq * H = 32 = the CTA's rows): q whole is the rope operand, its last 64 columns the rope
  q = jnp.concatenate([an[:, :, :16], bn[:, :, :16]], axis=-1)                       # [3, 2, 16, 576]
  lat, rope = ms.fp8_q_operands(q, None, 32, 1)
  assert rope.shape == (3, 32, 576)
  np.testing.assert_array_equal(np.asarray(rope[..., 512:], np.float32),
                                np.asarray(bn[:, :, :16], np.float32).reshape(3, 32, 64))


@pytest.mark.parametrize("heads,sq,lens,causal,parts,ahead", [
    (16, 1, [129, 0, 64, 3, 200], False, 3, 0),   # zero length, partial pages (the producer zeroes their tails)
    (20, 2, [1, 130, 64], True, 3, 2),            # two head groups, causal; the table read 2 pages ahead
    (8, 1, [330, 2, 65, 1], False, 2, 8),         # the ring wraps many times; reads ahead past every share's end
])
def test_swapped_producer_dequant_interpret(heads, sq, lens, causal, parts, ahead):
  """producer_dequant (fp8: the producer warpgroup converts each page into an f16 ring; l2_prefetch pages read
  ahead) on NaN-poisoned caches against the float64 reference on the dequantized cache."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + ahead, lens=lens, sq=sq, heads=heads,
                                           dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="swapped",
                        producer_dequant=True, producers=1, l2_prefetch=ahead)    # one producer (two: below)
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res


@pytest.mark.parametrize("heads,sq,lens,causal,parts,kw", [
    # two producer warpgroups, each converting one latent half of every page: zero length, partial pages
    (16, 1, [129, 0, 64, 3, 200], False, 3, dict(producers=2)),
    (8, 1, [330, 2, 65, 1], False, 2, dict(producers=2, l2_prefetch=8)),   # wraps; reads past every share's end
    (16, 2, [1, 130, 64], True, 2, dict(producers=2, l2_prefetch=2, rows_per_cta=16)),   # Sq 2 causal, 2 groups
    # lookahead: each producer loads the next page's halves before converting this page's
    (8, 1, [330, 2, 65, 1], False, 2, dict(producers=1, l2_prefetch=8, lookahead=True)),
    (16, 2, [1, 130, 64], True, 2, dict(producers=2, l2_prefetch=1, rows_per_cta=16, lookahead=True)),
    # the path the default left at 32 rows a CTA: the compute warpgroups dequantize (two head groups, causal)
    (20, 2, [1, 130, 64], True, 3, dict(producer_dequant=False)),
])
def test_swapped_fp8_producer_variants_interpret(heads, sq, lens, causal, parts, kw):
  q, cache, table, lens_a = random_problem(len(lens) + heads + 11, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  kw = {"producer_dequant": True, **kw}
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="swapped", **kw)
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res


@pytest.mark.parametrize("heads,sq,lens,causal,parts,kw", [
    # zero length, partial pages, one-page segments (one warpgroup without a page), odd page counts
    (16, 1, [129, 0, 64, 3, 200], False, 3, dict(producers=2)),
    (8, 1, [330, 2, 65, 1], False, 2, dict(producers=1, l2_prefetch=8)),   # one producer; the ring wraps
    (16, 1, [129, 0, 64, 3, 200], False, 3, dict(producers=2, lookahead=True)),  # lookahead too
    (16, 2, [1, 130, 64], True, 2, dict(producers=2, rows_per_cta=16)),    # Sq 2 causal, two head groups
    # one copy of the compute warpgroups' code, the warpgroup index at run time
    (16, 1, [129, 0, 64, 3, 200], False, 3, dict(producers=2, shared_loop=True)),
    (16, 2, [1, 130, 64], True, 2, dict(producers=2, rows_per_cta=16, shared_loop=True)),
])
def test_swapped_alternate_interpret(heads, sq, lens, causal, parts, kw):
  """alternate: the compute warpgroups take alternate pages of the f16 ring, each whole, and merge at each
  segment's end; against float64 on NaN-poisoned caches."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + 11, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="swapped",
                        producer_dequant=True, alternate=True, **kw)
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res


def test_swapped_alternate_plan():
  plan = ms.make_plan(16, True, alternate=True)
  assert (plan.alternate, plan.num_stages, plan.producers) == (True, 2, 2)
  assert plan.smem_bytes <= ms.SMEM_LIMIT and 2 * sum(plan.registers) <= 4 * 128
  assert ms.make_plan(8, True, producer_dequant=True, alternate=True).num_stages == 2
  default = ms.make_plan(16, True, producer_dequant=True)           # two producers: alternate and lookahead
  assert (default.alternate, default.lookahead) == (ms.ALTERNATE, ms.LOOKAHEAD)
  for one_producer in (ms.make_plan(32, True), ms.make_plan(16, True, producers=1), ms.make_plan(8, True)):
    assert not (one_producer.alternate or one_producer.lookahead)
  with pytest.raises(ValueError, match="alternate .* needs producer_dequant"):
    ms.make_plan(16, True, producer_dequant=False, alternate=True)
  with pytest.raises(ValueError, match="at most 16 rows a CTA"):
    ms.make_plan(32, True, alternate=True)
  with pytest.raises(ValueError, match="2-slot ring"):
    ms.make_plan(8, True, producer_dequant=True, alternate=True, num_stages=1)


def test_swapped_producer_dequant_rejects():
  with pytest.raises(ValueError, match="producer_dequant applies to an fp8 cache only"):
    ms.make_plan(16, False, producer_dequant=True)
  for bad in (-1, ms.MAX_L2_PREFETCH_PAGES + 1, True):
    with pytest.raises(ValueError, match="l2_prefetch is a number of pages"):
      ms.make_plan(16, True, producer_dequant=True, l2_prefetch=bad)
  with pytest.raises(ValueError, match="needs producer_dequant"):
    ms.make_plan(8, True, l2_prefetch=2)                                # off by default at 8 rows
  plan = ms.make_plan(16, True, producer_dequant=True, producers=1)
  assert plan.num_stages == 2 and plan.smem_bytes <= ms.SMEM_LIMIT     # two f16 pages, no fp8 slot
  assert (plan.producers, plan.num_warpgroups) == (1, 3)
  two = ms.make_plan(16, True, producer_dequant=True, producers=2, alternate=False, lookahead=False)
  assert (two.num_warpgroups, two.smem_bytes) == (4, plan.smem_bytes)   # one more warpgroup, the same SMEM
  assert 2 * sum(two.registers) <= 4 * 128          # the launch's 512 threads get 128 registers each
  both = ms.make_plan(16, True, producer_dequant=True, producers=2)        # alternate + lookahead by default
  assert both.alternate and both.lookahead and 2 * sum(both.registers) <= 4 * 128
  with pytest.raises(ValueError, match="needs producer_dequant"):
    ms.make_plan(16, True, producer_dequant=False, producers=2)
  with pytest.raises(ValueError, match="at most 16 rows a CTA"):
    ms.make_plan(32, True, producers=2)                                  # producer_dequant by default there
  for bad in (0, 3, 4, True):
    with pytest.raises(ValueError, match="producers must be 1 or 2"):
      ms.make_plan(16, True, producer_dequant=True, producers=bad)
  q = jnp.zeros((1, 1, 128, 576), jnp.bfloat16)
  cache = MLAKVCache.allocate(2, dtype="fp8_e4m3")
  for kw in (dict(producers=2), dict(producer_dequant=True)):            # the seesaw kernel's (auto at h128)
    with pytest.raises(ValueError, match="seesaw kernel does not take"):
      ms.mla_decode(q, cache, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=0.1,
                    causal=False, **kw)


@pytest.mark.parametrize("fp8,heads,pd,producers", [(True, 16, False, 1), (False, 16, False, 1), (True, 20, False, 1),
                                                    (True, 16, True, 1), (True, 32, True, 1), (True, 16, True, 2)])
def test_swapped_kernel_lowers_for_sm90(fp8, heads, pd, producers):
  """The swapped kernel's GPU code path lowers for sm90 with the operands the wrapper passes: Q's latent part (f16
  for an fp8 cache, else q itself) and, for its rope columns, q's rope part alone (fp8) or q itself (bf16); pd:
  with producer_dequant (and an L2 prefetch of 4 pages), which has the TMA unit's L2 prefetch in it; producers 2:
  4 warpgroups."""
  plan = ms.make_plan(heads, fp8, num_parts=8, producer_dequant=pd, l2_prefetch=4 if pd else None,
                      producers=producers)
  assert plan.num_warpgroups == 2 + producers
  batch, num_pages, max_pages = 4, 64, 8
  s = jax.ShapeDtypeStruct
  call = ms._build_call(plan, batch=batch, sq=1, heads=heads, causal=False, softmax_scale=SCALE,
                        num_pages=num_pages, interpret=False)
  qrows = batch * plan.groups
  if fp8:
    q_args = (s((qrows, plan.n, 512), jnp.float16), s((qrows, plan.n, 64), jnp.bfloat16))
    cache_args = (s((num_pages, 64, 512), jnp.float8_e4m3fn), s((num_pages, 64, 64), jnp.bfloat16),
                  s((num_pages, 64, 4), jnp.float32))
  else:
    q_args = (s((qrows, plan.n, 576), jnp.bfloat16),) * 2
    cache_args = (s((num_pages, 64, 512), jnp.bfloat16), s((num_pages, 64, 64), jnp.bfloat16))
  parts_padded = 1 << (plan.num_parts - 1).bit_length()
  args = q_args + cache_args + (s((batch, max_pages), jnp.int32), s((batch,), jnp.int32),
                                s((batch + 1,), jnp.int32), s((4, parts_padded), jnp.int32))
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "wgmma" in text
  assert ("cp.async.bulk.prefetch.tensor" in text) == pd


# ---- the seesaw kernel (mosaic_sm90_seesaw.py, opt-in kernel="seesaw", bf16 cache): FlashMLA's staggered pair ----
@pytest.mark.parametrize("dtype,heads,sq,lens,causal,parts", [
    ("bfloat16", 64, 1, [70, 0, 5], False, 3),             # zero length, partial pages, an odd last page
    ("bfloat16", 128, 1, [130, 1, 64, 200], False, 2),     # two row groups, odd and even page counts per share
    ("bfloat16", 64, 1, [70, 0, 5, 64, 129, 1, 190], False, 1),   # one share walks 7 sequences
    ("bfloat16", 128, 2, [1, 130, 0, 64], True, 3),        # Sq 2 causal: 4 row groups (a row with no key)
    ("bfloat16", 64, 2, [3, 200, 127], True, 4),           # Sq 2 causal, one query token per row group
    ("fp8_e4m3", 64, 1, [70, 0, 5, 37, 128], False, 3),    # partial pages of 6, 5, 37 tokens (masked conversion)
    ("fp8_e4m3", 128, 1, [130, 1, 64, 200], False, 2),
    ("fp8_e4m3", 64, 1, [70, 0, 5, 64, 129, 1, 190], False, 1),
    ("fp8_e4m3", 128, 2, [1, 130, 0, 64, 37], True, 3),
])
def test_seesaw_kernel_interpret(dtype, heads, sq, lens, causal, parts):
  """kernel="seesaw" on NaN-poisoned caches (unused slots, pages and fp8 scales) against the float64 reference on
  the dequantized cache: §3's bf16-P bound for a bf16 cache, the plain bound for fp8 (f16 P and V)."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + sq + 5, lens=lens, sq=sq, heads=heads, dtype=dtype)
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="seesaw")
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, causal)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res
  assert out.dtype == jnp.bfloat16 and out.shape == (len(lens), sq, heads, 512)
  assert lse.dtype == jnp.float32 and lse.shape == (len(lens), heads, sq)


@pytest.mark.parametrize("dtype,lens,parts", [
    ("bfloat16", [70, 0, 5, 64, 1290, 1, 190], 3),   # some sequences whole in a share, one split, one empty
    ("fp8_e4m3", [64, 0, 1300, 200], 2),
])
def test_seesaw_direct_write_is_the_merge(dtype, lens, parts):
  """direct_write (a share's CTA writes the output of each sequence it holds whole; the merge skips those) gives the
  same bits as merging every sequence's partials, and the schedule at hand has both kinds of sequence. Both runs
  take the schedule the direct call computes (cuts charged: split_kv.CUT_PAGES_DIRECT)."""
  q, cache, table, lens_a = random_problem(len(lens) + parts, lens=lens, sq=1, heads=64, dtype=dtype)
  schedule = schedule_kernel(jnp.asarray(lens_a), parts, page=64, interpret=True, cut_pages=CUT_PAGES_DIRECT)
  cu, payload = np.asarray(schedule[0])[:len(lens) + 1], int(np.asarray(schedule[2])[0])
  shares = [(b - 1) // payload - a // payload + 1 if b > a else 0 for a, b in zip(cu[:-1], cu[1:])]
  assert 0 in shares and 1 in shares and max(shares) > 1, shares
  runs = [run_kernel(q, cache, table, lens_a, False, interpret=True, num_parts=parts, kernel="seesaw",
                     direct_write=d, schedule=schedule) for d in (True, False)]
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, False)
  res = compare(*runs[0], ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_seesaw_kernel_interpret_no_races(dtype):
  """Race detector on: 2 shares, one with odd and even segments (the ring's two slots refilled part by part)."""
  q, cache, table, lens = random_problem(9, lens=[330, 2, 129], sq=1, heads=64, dtype=dtype)
  out, lse = run_kernel(q, cache, table, lens, False, num_parts=2, kernel="seesaw",
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens, False)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,sq,causal", [(128, 1, False), (64, 2, True)])
def test_seesaw_kernel_lowers_for_sm90(fp8, heads, sq, causal):
  """The GPU code path (P0, P1 and Q's rope as register A operands, O in a whole-segment accumulator; fp8: the
  producer's GMEM loads and conversion) lowers for sm90, and smem_bytes equals Mosaic's SMEM count, under the
  227 KiB of a block."""
  from pallas_kernels.mla_decode import mosaic_sm90_seesaw as mss
  plan = mss.make_plan(sq * heads, num_sms=8, fp8=fp8)
  kw = dict(heads=heads, sq=sq, causal=causal, kernel="seesaw")
  lowered = _lower_rows_for_sm90(plan, **kw)
  assert "mosaic_gpu" in lowered
  assert _mosaic_smem_bytes(plan, **kw) == plan.smem_bytes <= mss.SMEM_LIMIT
  # early_p0 (warpgroup 0's P0 V0_L left in flight) is a GPU-only program: it lowers to a different kernel
  assert plan.early_p0 == (not fp8)                                    # the default: on for bf16, off for fp8
  other = mss.make_plan(sq * heads, num_sms=8, fp8=fp8, early_p0=fp8)
  assert other.early_p0 == fp8 and _lower_rows_for_sm90(other, **kw) != lowered


def test_seesaw_tile_release_lowers_for_sm90():
  """tile_release lowers for sm90 with its barriers (one a part) counted in smem_bytes as Mosaic counts them, to a
  program that differs from the one without."""
  from pallas_kernels.mla_decode import mosaic_sm90_seesaw as mss
  kw = dict(heads=128, sq=1, causal=False, kernel="seesaw")
  plan = mss.make_plan(128, num_sms=8, fp8=True, tile_release=("a1", "b0"))
  lowered = _lower_rows_for_sm90(plan, **kw)
  assert _mosaic_smem_bytes(plan, **kw) == plan.smem_bytes <= mss.SMEM_LIMIT
  assert lowered != _lower_rows_for_sm90(mss.make_plan(128, num_sms=8, fp8=True, tile_release=()), **kw)
  assert mss.make_plan(128, num_sms=8, fp8=True).tile_release == mss.TILE_RELEASE


@pytest.mark.parametrize("dtype,heads,lens,parts,ahead", [
    ("fp8_e4m3", 64, [70, 0, 5, 64, 129, 1, 190], 1, 2),   # one share over 7 sequences: reads ahead past each end
    ("fp8_e4m3", 128, [130, 1, 64, 200], 2, 4),            # ahead of the longest share: only table reads, clipped
    ("bfloat16", 64, [70, 0, 5, 37, 128], 3, 1),
])
def test_seesaw_l2_prefetch_interpret(dtype, heads, lens, parts, ahead):
  """l2_prefetch (the producer's L2 prefetch of pages a few pairs ahead): interpret mode runs its table reads and
  conditions (the prefetches are no-ops there) on NaN-poisoned caches whose unused table entries are out of range;
  the result matches the float64 reference."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + ahead, lens=lens, sq=1, heads=heads, dtype=dtype)
  out, lse = run_kernel(q, cache, table, lens_a, False, interpret=True, num_parts=parts, kernel="seesaw",
                        l2_prefetch=ahead)
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, False)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("option", ["b0_before_a1", "p0_first", "tile_release"])
@pytest.mark.parametrize("dtype,heads,sq,lens,parts", [
    ("fp8_e4m3", 64, 1, [70, 0, 5, 37, 128, 1, 190], 1),   # one share over 7 segments: odd and even, empty, partial
    ("fp8_e4m3", 128, 2, [1, 130, 0, 64, 37], 3),          # Sq 2 causal
    ("bfloat16", 64, 1, [330, 2, 129], 2),
])
def test_seesaw_orders_interpret(option, dtype, heads, sq, lens, parts):
  """The seesaw kernel's other part orders, on NaN-poisoned caches with the race detector on, within §3 of the
  float64 reference: b0_before_a1 (the producer fills slot 0's part B before slot 1's part A), also the same bits
  as without it; p0_first (warpgroup 1's P0 V0_R before its P1 V1_R, its QK over slot 1's part A first, the
  producer's order A0, B0, A1, B1; O_R sums its two products the other way round: not the same bits);
  tile_release (fp8: slot 0's part B and slot 1's part A released to their QK tile by tile), the same bits as
  without it."""
  if option == "tile_release" and dtype != "fp8_e4m3":
    pytest.skip("tile_release is the fp8 producer's (test_seesaw_kernel_rejects_what_it_cannot_run)")
  q, cache, table, lens_a = random_problem(len(lens) + heads + 31, lens=lens, sq=sq, heads=heads, dtype=dtype)
  causal = sq > 1
  on, off = (("a1", "b0"), ()) if option == "tile_release" else (True, False)
  out, lse = run_kernel(q, cache, table, lens_a, causal, num_parts=parts, kernel="seesaw", **{option: on},
                        interpret=plgpu.InterpretGPUParams(detect_races=True))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found
  if option != "p0_first":
    other = run_kernel(q, cache, table, lens_a, causal, num_parts=parts, kernel="seesaw", **{option: off},
                       interpret=True)
    for a, b in zip((out, lse), other):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens_a, causal)
  res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("fp8", [False, True])
def test_seesaw_l2_prefetch_lowers_for_sm90(fp8):
  """The prefetching producer lowers for sm90 with the same SMEM (a prefetch takes no buffer and no barrier), to a
  program with the TMA unit's L2 prefetch in it that differs from the one without; out-of-range values refused."""
  from pallas_kernels.mla_decode import mosaic_sm90_seesaw as mss
  kw = dict(heads=128, sq=1, causal=False, kernel="seesaw")
  plan = mss.make_plan(128, num_sms=8, fp8=fp8, l2_prefetch=2)
  lowered = _lower_rows_for_sm90(plan, **kw)
  assert "cp.async.bulk.prefetch.tensor" in lowered
  assert _mosaic_smem_bytes(plan, **kw) == plan.smem_bytes <= mss.SMEM_LIMIT
  without = _lower_rows_for_sm90(mss.make_plan(128, num_sms=8, fp8=fp8, l2_prefetch=0), **kw)
  assert "cp.async.bulk.prefetch.tensor" not in without
  for bad in (-1, mss.MAX_L2_PREFETCH + 1, True, 1.5):
    with pytest.raises(ValueError, match="l2_prefetch is a number of page pairs"):
      mss.make_plan(128, num_sms=8, fp8=fp8, l2_prefetch=bad)


def test_seesaw_kernel_rejects_what_it_cannot_run():
  q, cache, table, lens = random_problem(3, lens=[70], sq=1, heads=64, dtype="bfloat16")
  call = lambda **kw: ms.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=False, interpret=True,
                                    **kw)
  with pytest.raises(ValueError, match="2 slots"):
    call(kernel="seesaw", num_stages=1)
  with pytest.raises(ValueError, match="seesaw kernel does not take"):
    call(kernel="seesaw", prefetch_tiles=2)
  with pytest.raises(ValueError, match="over the 504 that 3 warpgroups launch with"):
    call(kernel="seesaw", registers=dict(producer_registers=80, compute_registers=216))
  with pytest.raises(ValueError, match="to the swapped kernel with producer_dequant, got .* for the rows kernel"):
    call(kernel="rows", registers=dict(producer_registers=72))
  with pytest.raises(ValueError, match="p0_first and tile_release apply to the seesaw"):
    call(kernel="swapped", early_p0=True)
  with pytest.raises(ValueError, match="p0_first and tile_release apply to the seesaw"):
    call(kernel="swapped", direct_write=False)
  with pytest.raises(ValueError, match="p0_first and tile_release apply to the seesaw"):
    call(kernel="rows", b0_before_a1=True)
  with pytest.raises(ValueError, match="p0_first and tile_release apply to the seesaw"):
    call(kernel="swapped", p0_first=True)
  with pytest.raises(ValueError, match="tile_release splits the fp8 producer's conversion"):
    call(kernel="seesaw", tile_release=("b0",))            # this problem's cache is bf16
  with pytest.raises(ValueError, match="tile_release is a tuple of page parts"):
    ms.mla_decode(*random_problem(3, lens=[70], sq=1, heads=64, dtype="fp8_e4m3"), softmax_scale=SCALE,
                  causal=False, interpret=True, kernel="seesaw", tile_release=("b1",))
  # its schedule has the rows kernel's shape (same row groups and shares; the payload may differ, as the seesaw's
  # direct write charges cut sequences), so either kernel takes either schedule
  sched = [ms.make_schedule(lens, table.shape[1], rows=128, fp8=False, interpret=True, kernel=k)
           for k in ("rows", "seesaw")]
  assert all(a.shape == b.shape for a, b in zip(*sched))
  np.testing.assert_array_equal(sched[0][0], sched[1][0])                     # the page prefix sums


@pytest.mark.parametrize("kernel,dtype,heads", [
    ("seesaw", "bfloat16", 64), ("seesaw", "fp8_e4m3", 64), ("rows", "fp8_e4m3", 64),
    ("swapped", "fp8_e4m3", 16), ("swapped", "fp8_e4m3", 20), ("swapped", "bfloat16", 20)])
def test_q_whole_and_q_apart_give_the_same_bits(kernel, dtype, heads):
  """The kernels read Q's latent part from the first 512 columns of one operand and its rope part from the last 64
  of the other: q whole [.., 576] (both operands, no copy) and q apart (q_rope=) give the same bits; h20 pads its
  rows (the swapped kernel's 32-row CTAs)."""
  q, cache, table, lens = random_problem(heads + 17, lens=[70, 0, 129], sq=1, heads=heads, dtype=dtype)
  kw = dict(interpret=True, kernel=kernel, num_parts=2)
  whole = run_kernel(q, cache, table, lens, False, **kw)
  apart = run_kernel(q[..., :512], cache, table, lens, False, q_rope=q[..., 512:], **kw)
  for a, b in zip(whole, apart):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_out, ref_lse, ref_abs = f64_reference_abs(q, cache, table, lens, False)
  res = compare(*whole, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
  assert res["ok"], res


@pytest.mark.parametrize("heads,sq,lens,causal,parts,kw", [
    # zero length, partial pages (NaN past the length reaches the P.V operand), one-page segments, odd counts
    (16, 1, [129, 0, 64, 3, 200], False, 3, {}),
    (8, 1, [330, 2, 65, 1], False, 2, dict(l2_prefetch=8)),                # the ring wraps; prefetch past ends
    (16, 1, [129, 0, 64, 3, 200], False, 3, dict(l2_prefetch=0, loads_first=True)),
    (16, 2, [1, 130, 64], True, 2, dict(rows_per_cta=16)),                 # Sq 2 causal, two head groups
    (16, 2, [1, 130, 64], True, 2, dict(rows_per_cta=16, loads_first=True)),
    # the cases above run the default 4-slot ring (slots w and w + 2 a compute warpgroup); these the 2-slot one
    (16, 1, [129, 0, 64, 3, 200, 130, 257], False, 3, dict(num_stages=2)),
    (16, 2, [1, 130, 64], True, 2, dict(rows_per_cta=16, num_stages=2, l2_prefetch=1)),
    # one copy of the compute warpgroups' code (the default), also with loads_first
    (16, 1, [129, 0, 64, 3, 200, 130, 257], False, 3, dict(shared_loop=True)),
    (16, 1, [129, 0, 64, 3, 200, 130, 257], False, 3, dict(shared_loop=True, loads_first=True)),
    # QK's scales applied to the operands instead of S (scale_on_s off; the cases above take it on, the default):
    # shared loop, and Sq 2 causal
    (16, 1, [129, 0, 64, 3, 200, 130, 257], False, 3, dict(shared_loop=True, scale_on_s=False)),
    (16, 2, [1, 130, 64], True, 2, dict(rows_per_cta=16, scale_on_s=False)),
])
def test_swapped_register_dequant_interpret(heads, sq, lens, causal, parts, kw):
  """register_dequant: no f16 page; each compute warpgroup converts its page into the A operands of both products
  (Q's dims and O's rows permuted to match); against float64 on NaN-poisoned caches."""
  q, cache, table, lens_a = random_problem(len(lens) + heads + 13, lens=lens, sq=sq, heads=heads, dtype="fp8_e4m3")
  out, lse = run_kernel(q, cache, table, lens_a, causal, interpret=True, num_parts=parts, kernel="swapped",
                        register_dequant=True, **kw)
  res = compare(out, lse, *f64_reference(q, cache, table, lens_a, causal))
  assert res["ok"], res


def test_swapped_register_dequant_plan():
  plan = ms.make_plan(16, True, register_dequant=True)
  assert (plan.register_dequant, plan.alternate, plan.producer_dequant, plan.producers, plan.num_stages,
          plan.num_warpgroups, plan.l2_prefetch) == (True, True, False, 1, ms.REGISTER_DEQUANT_STAGES, 3,
                                                     ms.REGISTER_DEQUANT_L2_PREFETCH_PAGES)
  assert ms.make_plan(16, True, register_dequant=True, l2_prefetch=2).l2_prefetch == 2
  plan = ms.make_plan(16, True, register_dequant=True, num_stages=2)
  # no f16 page (kbuf: [2, 64, 256] f16): the e4m3 ring and its scales only; the hand-over's max and sums share one
  # [64, 16] f32 array
  assert (plan.smem_bytes == ms._smem_bytes(16, 2, True, alternate=True) - ms.PAGE * 512 * 2 - ms.PAGE * 16 * 4
          <= ms.SMEM_LIMIT)
  for bad in (dict(producer_dequant=True), dict(producers=2), dict(lookahead=True), dict(alternate=False),
              dict(num_stages=3)):
    with pytest.raises(ValueError, match="register_dequant"):
      ms.make_plan(16, True, register_dequant=True, **bad)
  with pytest.raises(ValueError, match="needs an fp8_e4m3 cache"):
    ms.make_plan(16, False, register_dequant=True)
  assert ms.make_plan(16, True, register_dequant=True, loads_first=True).loads_first
  with pytest.raises(ValueError, match="pass register_dequant=True"):
    ms.make_plan(16, True, producer_dequant=True, loads_first=True)
  with pytest.raises(ValueError, match="pass rows_per_cta=16"):
    ms.make_plan(32, True, register_dequant=True)
  assert ms.make_plan(16, True, producer_dequant=True).num_warpgroups == 4   # 2 compute, 2 producers
  # scale_on_s: on by default (SCALE_ON_S), only with register_dequant
  assert ms.make_plan(16, True).scale_on_s == ms.SCALE_ON_S
  assert not ms.make_plan(16, True, scale_on_s=False).scale_on_s
  assert not ms.make_plan(16, True, producer_dequant=True).scale_on_s
  with pytest.raises(ValueError, match="scale_on_s"):
    ms.make_plan(16, True, producer_dequant=True, scale_on_s=True)
  # two slots a compute warpgroup (the default): the m / l hand-over in one [64, n] array makes the 4-slot ring fit
  four = ms.make_plan(16, True, register_dequant=True)
  assert (four.num_stages, four.num_warpgroups) == (4, 3) and four.smem_bytes <= ms.SMEM_LIMIT
  with pytest.raises(ValueError, match="or two of a 4-slot ring"):
    ms.make_plan(16, True, register_dequant=True, num_stages=3)
  # one copy of the compute code: a reduction region a compute warpgroup instead of the scoped ones, the same bytes
  shared = ms.make_plan(16, True, register_dequant=True, shared_loop=True)
  assert shared.shared_loop and shared.smem_bytes == four.smem_bytes
  with pytest.raises(ValueError, match="shared_loop .* needs alternate"):
    ms.make_plan(32, True, shared_loop=True)


@pytest.mark.parametrize("dtype,heads,sq", [("fp8_e4m3", 16, 1), ("fp8_e4m3", 8, 2), ("fp8_e4m3", 20, 1),
                                            ("fp8_e4m3", 128, 1), ("bfloat16", 16, 1), ("bfloat16", 128, 2)])
def test_production_op_traces_without_constants(monkeypatch, dtype, heads, sq):
  """The op a GPU runs (api.mla_decode, interpret=False: custom_partitioning, which refuses a traced call holding
  array constants) traces for each kernel and plan auto picks, on a CPU that says it is an sm90 GPU. The interpret
  tests run the same kernels unpartitioned, where a constant (e.g. register_dequant's row table) passes."""
  monkeypatch.setattr(api, "_device_target", lambda device, cache_dtype, interpret: api.Target(
      platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), cache_dtype=cache_dtype,
      interpret=interpret))
  q, cache, table, lens = random_problem(5, lens=[70, 0, 129], sq=sq, heads=heads, dtype=dtype)
  traced = jax.jit(lambda q, c, t, n: api.mla_decode(q, c, t, n, softmax_scale=SCALE, backend="mosaic_sm90")).trace(
      q, cache, table, lens)
  assert "custom_partitioning" in str(traced.jaxpr)


def test_production_op_traces_off_the_default_cut(monkeypatch):
  """The plan off the default (scale_on_s off) traces through the production op (custom_partitioning) too: no array
  constant in its code (what the interpret tests cannot see)."""
  monkeypatch.setattr(ms, "SCALE_ON_S", False)
  assert not ms.make_plan(16, True).scale_on_s
  test_production_op_traces_without_constants(monkeypatch, "fp8_e4m3", 16, 1)
