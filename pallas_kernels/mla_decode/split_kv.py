"""Device-side split-KV schedule and merge for mosaic_sm90 (Pallas Triton kernels; CPU with interpret=True).

Schedule: the batch's pages, in sequence order, are cut into at most `num_parts` equal shares of `payload` pages:
share p covers flat pages [p * payload, (p + 1) * payload) and sequences b_first..b_last. The payload is the
smallest that covers the batch or up to SNAP_CANDIDATES - 1 pages more where that cuts fewer sequences
(mosaic_sm90.share_pages has the rule; a cut costs more where the kernel writes whole sequences' outputs itself).
`schedule_kernel` computes the page prefix sums, the payload and every share's (begin, end, b_first, b_last) in one
launch; plain XLA needs ~7 small fusions of ~1.5 µs each on the H200 (mosaic_sm90.schedule is the XLA reference
the tests compare it with). The kernel is latency-bound: each of its programs loads all lengths at once (one
memory round trip), computes the prefix sums and the payload itself, all candidate payloads side by side, and
then the sequences of SCHEDULE_SHARES shares or fewer; the few reductions, each a barrier, are its time.

Merge: sequence b (flat pages [cu[b], cu[b+1])) has partials from shares p = cu[b] // payload ...
(cu[b+1] - 1) // payload, stored at entries e = p + b. Each partial is normalized (o) with its log2-domain
log-sum-exp (lse2; -inf where a row saw no key), and

    lse2 = log2 sum_p 2^lse2_p,     o = sum_p 2^(lse2_p - lse2) o_p.

Program (b, g, d) merges sequence b, head group g, latent columns [128 d, 128 d + 128) and writes them
transposed into the caller's row order in bf16 (rows past the query count are padding the caller slices off).
One pass instead of ~10 XLA fusions (segment reductions over scatters, a transpose, casts), which cost 20-110 µs
on the H200 against ~5 µs for this kernel (NOTES.md); mosaic_sm90._combine is the plain-XLA reference the tests
compare it with.

Pallas Triton needs every loaded or stored array to have a power-of-two size: the schedule loads the lengths in
chunks of a power of two >= B + 1 (SEQ_CHUNK the most; masked loads read zeros past the batch) and pads the shares
to a power of two.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mla_decode.cache import LATENT_DIM

COLS = 128          # latent columns per program (merge), the most
# merge_cols: the dims-major partials (the swapped kernel's) get programs of 64 columns where 128 would make fewer
# than MERGE_MIN_PROGRAMS programs. Each program walks its partials one after another, so few sequences make few long
# chains. One H100, jax 0.11.2, 13ee541, `scripts/bench_merge.py`, CUPTI µs of the merge alone at 128 / 64 / 32
# columns: fp8 h16 b32 L16384 5.98 / 4.22 / 4.06, b128 L4096 2.82 / 3.04 / 4.29, b128 ragged [1, 2L] 4.35 / 4.19 /
# 5.92; the rows-major ones (seesaw, h128) lose at 64 (Sq 2 21.1 -> 23.1, ragged 19.6 -> 21.1): 128 there.
# Triton stages 2 and 2 warps: no gain (NOTES.md)
MERGE_MIN_PROGRAMS = 256
MERGE_WARPS = 4     # the merge program's Triton configuration
MERGE_STAGES = 1
SEQ_CHUNK = 1024    # the schedule kernel's sequences a chunk (larger batches take several, each loaded up front)
SCHEDULE_SHARES = 32       # shares a schedule program, the most
SCHEDULE_COMPARES = 8192   # ... and at most this many [shares, chunk] compares (32 a thread at 8 warps)
SCHEDULE_WARPS = 8
SNAP_CANDIDATES = 8  # payloads tried: base .. base + 7 pages a share (base = ceil(total pages / shares))
SEGMENT_PAGES = 2    # what one (share, sequence) segment costs, in pages (fp8 h128 b64 on an H200, NOTES.md)
# what cutting a sequence over shares costs on top, in pages of a share's time, where the kernel writes the output of
# every sequence a share holds whole (the seesaw kernel's direct write): a cut sequence goes through the merge
# instead. One H100, fp8 b128 h128 L4096, 6d32b45: the merge of the 65 sequences 125-page shares cut took 13.6 µs,
# ~0.21 µs a sequence, against ~2.9 µs a page of a share: ~0.21 x 66 shares / 2.9 = ~5 pages
CUT_PAGES_DIRECT = 5
_LN2 = math.log(2.0)


def _merge_kernel(cu_ref, payload_ref, o_ref, lse2_ref, *refs, groups: int, n: int, rows_major: bool = False,
                  direct: bool = False, permuted=None, cols: int = COLS):
  # permuted: None (row d is dim d), True (a row table operand first in refs) or a function of the dims (rows)
  out_ref, lse_ref = refs[-2:]                       # direct: refs[1:3] / refs[:2] are the same buffers (aliased)
  b, g, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = None                                                          # o_part's rows of this program's dims
  if callable(permuted):
    rows = permuted(d * cols + lax.broadcasted_iota(jnp.int32, (cols,), 0))
  elif permuted:
    rows = refs[0][pl.ds(d * cols, cols)]
  first, last = cu_ref[b], cu_ref[b + 1]            # sequence b's flat pages [first, last)
  payload = payload_ref[0]
  p_lo = first // payload
  p_hi = jnp.where(last > first, (last - 1) // payload, p_lo - 1)     # no pages -> no partials
  if direct:
    # one share held all of sequence b's pages and its kernel CTA wrote out / lse itself: nothing to merge
    pl.when(p_hi != p_lo)(functools.partial(_merge_sequence, b, g, d, p_lo, p_hi, o_ref, lse2_ref, out_ref,
                                            lse_ref, groups=groups, n=n, rows_major=rows_major, rows=rows,
                                            cols=cols))
  else:
    _merge_sequence(b, g, d, p_lo, p_hi, o_ref, lse2_ref, out_ref, lse_ref, groups=groups, n=n,
                    rows_major=rows_major, rows=rows, cols=cols)


def _merge_sequence(b, g, d, p_lo, p_hi, o_ref, lse2_ref, out_ref, lse_ref, *, groups: int, n: int,
                    rows_major: bool, rows=None, cols: int = COLS):
  def merge(p, carry):
    m, den, acc = carry                                                # [n], [n], [cols, n]
    e = (p + b) * groups + g
    l2 = lse2_ref[e, :]                                                # [n] log2 domain, -inf = no key
    if rows_major:                                                     # partials [E*G, n, 512]
      o = o_ref[e, :, pl.ds(d * cols, cols)].T
    elif rows is not None:
      o = o_ref[e, rows, :]                                            # [cols, n], gathered rows
    else:
      o = o_ref[e, pl.ds(d * cols, cols), :]                           # [cols, n]
    m_new = jnp.maximum(m, l2)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)                                       # 0 while nothing was seen
    w = jnp.exp2(l2 - m_safe)                                          # 0 for an empty partial row
    return m_new, den * alpha + w, acc * alpha[None, :] + o * w[None, :]

  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((cols, n), jnp.float32))
  m, den, acc = lax.fori_loop(p_lo, p_hi + 1, merge, init)
  seen = den > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, den, 1.0), 0.0)
  out_ref[pl.ds(g * n, n), pl.ds(d * cols, cols)] = (acc * inv[None, :]).T.astype(out_ref.dtype)

  @pl.when(d == 0)
  def _():
    lse_ref[pl.ds(g * n, n)] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, den, 1.0))) * _LN2, jnp.inf)


def merge_cols(batch: int, groups: int, rows_major: bool = False) -> int:
  """Latent columns a merge program takes by default: COLS, or 64 for dims-major partials where COLS would give
  fewer than MERGE_MIN_PROGRAMS programs (batch x groups x 512 / cols)."""
  if not rows_major and batch * groups * (LATENT_DIM // COLS) < MERGE_MIN_PROGRAMS:
    return 64
  return COLS


def merge_partials(o_part: jax.Array, lse2_part: jax.Array, cu: jax.Array, payload: jax.Array, *, batch: int,
                   groups: int, out_dtype=jnp.bfloat16, interpret: bool = False, rows_major: bool = False,
                   direct: tuple[jax.Array, jax.Array] | None = None,
                   row_of_dim=None, cols: int | None = None, num_warps: int = MERGE_WARPS,
                   num_stages: int = MERGE_STAGES) -> tuple[jax.Array, jax.Array]:
  """o_part f32 [E*G, 512, N] (rows_major: [E*G, N, 512], the rows kernel's), lse2_part f32 [E*G, N]
  (entry-major, head group minor), cu int32 [>= B+1] and payload int32 [1] (schedule_kernel's) -> out
  [B, G*N, 512] out_dtype, lse f32 [B, G*N] (natural log; +inf where no key).

  direct: (out, lse) of those shapes that the kernel already wrote for every sequence one share held whole (its
  partials are then not written); they are updated in place (aliased) for the other sequences only: those split
  over shares and those without pages. With uniform lengths every share holds whole sequences and the merge reads
  and writes nothing.

  row_of_dim: int32 [512], the row of o_part [E*G, 512, N] that holds each latent dim (a kernel whose output rows
  come in another order: the swapped kernel's register_dequant), or a function that maps an int32 [cols] array of
  dims to their rows with ops the kernel can run (sm90_fp8_operands.row_of_dim: computed in the kernel, no table
  operand); None: row d is dim d. cols / num_warps / num_stages: latent columns a program (a power of two
  dividing 512: more programs for the same work; None: merge_cols) and the Triton program's configuration (tuning).
  Every tiling gives the same bits."""
  if rows_major:
    _, n, dims = o_part.shape
  else:
    _, dims, n = o_part.shape
  if cols is None:
    cols = merge_cols(batch, groups, rows_major)
  if not (isinstance(cols, int) and 16 <= cols <= LATENT_DIM and cols & (cols - 1) == 0):
    raise ValueError(f"merge_partials: cols must be a power of two in [16, {LATENT_DIM}], got {cols!r}")
  if dims != LATENT_DIM or n & (n - 1) or n < 8:
    want = f"[E*G, N, {LATENT_DIM}]" if rows_major else f"[E*G, {LATENT_DIM}, N]"
    raise ValueError(f"merge_partials needs partials {want} with N a power of two >= 8, got {o_part.shape}")

  def whole(x):
    return pl.BlockSpec(x.shape, lambda b, g, d, _n=x.ndim: (0,) * _n)

  out_specs = [pl.BlockSpec((None, groups * n, LATENT_DIM), lambda b, g, d: (b, 0, 0)),
               pl.BlockSpec((None, groups * n), lambda b, g, d: (b, 0))]
  out_shape = [jax.ShapeDtypeStruct((batch, groups * n, LATENT_DIM), out_dtype),
               jax.ShapeDtypeStruct((batch, groups * n), jnp.float32)]
  operands = [cu, payload, o_part, lse2_part]
  table = row_of_dim is not None and not callable(row_of_dim)          # else the kernel computes its rows
  if row_of_dim is not None and rows_major:
    raise ValueError(f"merge_partials: row_of_dim applies to partials [E*G, {LATENT_DIM}, N], not rows_major ones")
  if table:
    if getattr(row_of_dim, "shape", None) != (LATENT_DIM,) or getattr(row_of_dim, "dtype", None) != jnp.int32:
      raise ValueError(f"merge_partials: row_of_dim must be int32 [{LATENT_DIM}] or a function of the dims, got "
                       f"{getattr(row_of_dim, 'dtype', type(row_of_dim).__name__)}"
                       f"{list(getattr(row_of_dim, 'shape', ()))}")
    operands.append(row_of_dim)
  in_specs = [whole(x) for x in operands]
  aliases = {}
  if direct is not None:
    for i, (x, want) in enumerate(zip(direct, out_shape)):
      if x.shape != want.shape or x.dtype != want.dtype:
        raise ValueError(f"merge_partials: direct output {i} is {x.dtype}{list(x.shape)}, expected "
                         f"{want.dtype}{list(want.shape)}")
      aliases[len(operands)] = i
      operands.append(x)
      in_specs.append(out_specs[i])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        functools.partial(_merge_kernel, groups=groups, n=n, rows_major=rows_major, direct=direct is not None,
                          permuted=table or row_of_dim, cols=cols),
        grid=(batch, groups, LATENT_DIM // cols),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="mla_decode_merge_partials",
    )(*operands)


def _schedule_kernel(lens_ref, cu_ref, sched_ref, payload_ref, *, batch: int, num_parts: int, page: int,
                     chunk: int, chunks: int, shares: int, cut_pages: int):
  # every program computes the prefix sums and the payload (a few reductions; the kernel is latency-bound, so
  # redundant work in parallel beats a second launch), then (begin, end, b_first, b_last) of its `shares` shares
  me = pl.program_id(0)
  s_iota = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  # all loads first: one memory round trip, not one a chunk
  lens = [pltriton.load(lens_ref.at[c * chunk + s_iota], mask=c * chunk + s_iota < batch, other=0)
          for c in range(chunks)]
  pages = [(x + page - 1) // page for x in lens]                       # [S] each, zeros past the batch
  incl, before = [], jnp.int32(0)                                      # incl[c][s] = cu[c * S + s + 1]
  for pg in pages:
    incl.append(jnp.cumsum(pg) + before)
    before = before + jnp.sum(pg)
  total = before
  nonempty = sum(jnp.sum((pg > 0).astype(jnp.int32)) for pg in pages)

  # the payload: share_pages' rule (the first candidate of the lowest modelled time), all candidates at once
  base = jnp.maximum(1, (total + num_parts - 1) // num_parts)
  k_iota = lax.broadcasted_iota(jnp.int32, (SNAP_CANDIDATES,), 0)
  cand = base + k_iota
  segments = jnp.zeros((SNAP_CANDIDATES,), jnp.int32)
  for pg, inc in zip(pages, incl):        # (share, sequence) segments a candidate makes: last share - first + 1
    first, last = (inc - pg)[None, :] // cand[:, None], (inc - 1)[None, :] // cand[:, None]
    segments += jnp.sum(jnp.where(pg[None, :] > 0, last - first + 1, 0), axis=1)
  n_shares = jnp.maximum(1, (total + cand - 1) // cand)
  nums = cand * n_shares + SEGMENT_PAGES * segments + cut_pages * (segments - nonempty)  # time x shares
  # candidate i wins iff its time nums_i / shares_i is below every earlier one's and not above any later one's
  lhs, rhs = nums[:, None] * n_shares[None, :], nums[None, :] * n_shares[:, None]      # [i, j]: time_i vs time_j
  earlier = k_iota[None, :] < k_iota[:, None]
  beats = jnp.where(earlier, lhs < rhs, lhs <= rhs)
  wins = jnp.sum(beats.astype(jnp.int32), axis=1) == SNAP_CANDIDATES
  payload = jnp.sum(jnp.where(wins, cand, 0))

  p = me * shares + lax.broadcasted_iota(jnp.int32, (shares,), 0)
  begin = jnp.minimum(p * payload, total)
  end = jnp.minimum(begin + payload, total)
  # per share, the sequences that end at or before begin / end - 1 (padded sequences count only where
  # begin == total, an empty share: the clip absorbs them)
  n_first = sum(jnp.sum((inc[None, :] <= begin[:, None]).astype(jnp.int32), axis=1) for inc in incl)
  n_last = sum(jnp.sum((inc[None, :] <= (end - 1)[:, None]).astype(jnp.int32), axis=1) for inc in incl)
  b_first = jnp.minimum(n_first, batch - 1)
  b_last = jnp.where(end > begin, jnp.minimum(n_last, batch - 1), b_first - 1)
  for i, v in enumerate((begin, end, b_first, b_last)):
    sched_ref[i, pl.ds(me * shares, shares)] = v

  @pl.when(me == 0)
  def _():
    for c, (pg, inc) in enumerate(zip(pages, incl)):
      cu_ref[pl.ds(c * chunk, chunk)] = inc - pg
    payload_ref[...] = jnp.full((1,), payload, jnp.int32)


def schedule_kernel(lens: jax.Array, num_parts: int, *, page: int, interpret: bool = False, cut_pages: int = 0,
                    num_warps: int = SCHEDULE_WARPS) -> tuple[jax.Array, jax.Array, jax.Array]:
  """lens int32 [B] (clipped to the table) -> cu int32 [>= B+1] (page prefix sums, cu[B] = total pages),
  sched int32 [4, P'] (rows begin, end, b_first, b_last of share p < num_parts; P' = num_parts padded to a
  power of two), payload int32 [1]. Same values as mosaic_sm90.schedule. cut_pages: the payload rule's cost of a
  sequence cut over shares (CUT_PAGES_DIRECT for a kernel that writes whole sequences' outputs itself; else 0).
  num_warps: the Triton programs' warps (tuning; any value gives the same schedule)."""
  batch = lens.shape[0]
  if batch < 1 or num_parts < 1:
    raise ValueError(f"schedule_kernel: needs at least one sequence and one share, got batch {batch} and "
                     f"num_parts {num_parts}")
  chunk = min(SEQ_CHUNK, 1 << batch.bit_length())    # a power of two >= B + 1 where one chunk holds the batch
  chunks = batch // chunk + 1                         # room for cu[B]
  parts_padded = 1 << (num_parts - 1).bit_length()
  shares = min(parts_padded, SCHEDULE_SHARES, max(1, SCHEDULE_COMPARES // chunk))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        functools.partial(_schedule_kernel, batch=batch, num_parts=num_parts, page=page, chunk=chunk, chunks=chunks,
                          shares=shares, cut_pages=int(cut_pages)),
        grid=(parts_padded // shares,),
        in_specs=[pl.BlockSpec(lens.shape, lambda i: (0,))],
        out_specs=[pl.BlockSpec((chunks * chunk,), lambda i: (0,)),
                   pl.BlockSpec((4, parts_padded), lambda i: (0, 0)),
                   pl.BlockSpec((1,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((chunks * chunk,), jnp.int32),
                   jax.ShapeDtypeStruct((4, parts_padded), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)],
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=int(num_warps), num_stages=1),
        name="mla_decode_split_schedule",
    )(lens.astype(jnp.int32))
