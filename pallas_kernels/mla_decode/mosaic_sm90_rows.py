"""mosaic_sm90's kernel for many query rows (Sq * H >= 64): 64 query rows on the wgmma M side (FlashMLA's orientation).

The swapped kernel (mosaic_sm90.py) puts a page's 64 tokens on wgmma M and at most 32 query rows on N, so at h128
every page is read by 4 CTAs and each m64n32k16 wgmma streams more SMEM bytes than the tensor cores consume (NOTES.md).
Here a CTA owns 64 query rows (r = s * H + h) of one sequence and one split-KV share of its pages:

    S_w [64 rows, 32 tok]  = Q [64, 576] . K[tokens of half w]^T     (A = Q in SMEM, B = the page tile, transposed)
    O_w [64 rows, 256]    += P [64, 64 tok] . V[64 tok, dims of half w]   (A = P in SMEM, B = the page tile)

Warpgroup 2 streams 64-token pages by TMA through the block table into a 2-slot ring (the swapped kernel's
producer). Compute warpgroup w in {0, 1} computes the scores of the page's tokens [32 w, 32 w + 32) over all 576
dims and accumulates O for latent columns [256 w, 256 w + 256) in registers ([64, 256] f32 = 128 registers a
thread). Per page the two warpgroups exchange only their per-row maxima (64 f32 each, through SMEM), run the same
online softmax (log2 domain, masks by select) on their 32 tokens, publish P in bf16 (8 KiB for both halves) and
each multiplies the whole P [64, 64] by its half of V.

Why tokens and not dims are split for QK (the swapped kernel splits dims and swaps partial scores): a partial-score
exchange needs [64, 64] f32 = 16 KiB of SMEM at least once, and SMEM has no room for it next to Q (72 KiB) and a
2-page ring (144 KiB): 232 KiB > 227 KiB. The token split needs 8 KiB (P) plus 1 KiB, and its QK wgmmas are
m64n32 with Q as the SMEM A operand (more SMEM traffic per FLOP than m64n64: NOTES.md counts it).

P is rounded to bf16 (FlashMLA's choice; docs/architecture.md §3 admits it under the widened bound). Pages and
slots past a sequence's length never enter a sum: table entries past its pages are never read, scores past the
length or the causal limit are masked to -inf by select, and the latent rows of a partial last page past the length
are zeroed by select before P.V (0 * NaN would be NaN).

fp8 cache (plan.fp8): the ring holds fp8 pages (latent e4m3, rope bf16, scales f32) and has ONE slot: the
dequantized f16 page (64 KiB) and its rope copy (8 KiB) leave no room for a second (NOTES.md counts it). Each compute
warpgroup dequantizes its own 32 tokens (all 512 columns, e4m3 -> f16 x power-of-two tile scale: exact; tail tokens
of a partial page -> 0) into that page and copies their rope, releases the fp8 slot at once (the producer refills it
during this page's compute), and reads the f16 page for QK (its tokens) and P.V (its columns, after pbar). Q's
latent part and P are f16 (no fp8 -> bf16 convert on this ptxas). A `kfree` barrier keeps the next dequant off the
f16 page until both P.Vs are done with it. mosaic_sm90's `auto` ran it when Sq·H is a multiple of 64 (H200 h128:
359 TFLOP/s against the swapped kernel's 163) until the seesaw kernel with its L2 prefetch beat it (H200, 51d1294:
kernel 358.6 vs 372.0 µs); now it runs when asked for (kernel="rows").

fp8 with num_stages=2 (opt-in; 3% slower on an H200, NOTES.md): each slot stays held until both warpgroups'
QKs are done with it, so QK reads the page's rope from the slot (no rope copy) and `consumed` is arrived after
QK; Q's rope is loaded from GMEM once a segment into registers, the rope wgmma's A operand (interpret mode:
through a per-warpgroup SMEM copy). Without those two 8 KiB buffers two fp8 slots fit (NOTES.md counts it).

fp8 with prefetch_tiles = k (1 slot; default k = 2: -3% time on an H200, slower at 4, NOTES.md): while a page's
P.V runs, the next page of the segment is waited for and its first k dequant tiles are loaded and converted into
registers, stored after kfree. On the GPU O then lives in one accumulator for the whole segment (a page's P.V
cannot carry registers out of its run_state); interpret mode keeps O as a value (bit-identical results).

Operand addresses (rebase_per_page, on by default): the page loop adds a run-time zero (page counter >> 31) to
the SMEM indices of Q and the dequantized page, so the compiler rebuilds their wgmma descriptors in the loop (a
few integer ops) instead of keeping ~20 loop-invariant 64-bit descriptors in registers, which ptxas spilled to
local memory (fp8: 632 B, reloaded every page on the QK chain; bf16: 148 B). NOTES.md has the profile.

Synchronisation: every SMEM hand-off is ordered by an mbarrier or commit_smem (Mosaic's automatic barriers are
off), and no reduction crosses warps (the row reductions of a WGMMA-layout [64, 32] array stay inside a warp), so
Mosaic's shared cross-warp reduction scratch (NOTES.md's trap) is never used.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mla_decode.cache import LATENT_DIM, ROPE_DIM
from pallas_kernels.mla_decode.sm90_shared import (COMPUTE_REGISTERS, dequant_layout, produce_pages, q_rope_of,
                                                    scale_layout, scaled_f16, share_of_part, start_q_latent, SWZ16)

PAGE = 64                     # tokens per page
ROWS = 64                     # query rows per CTA (wgmma M)
HALF = LATENT_DIM // 2        # latent columns of O per compute warpgroup
TOK = PAGE // 2               # tokens of a page whose scores one compute warpgroup computes
CHUNK = 64                    # 64 16-bit elements = one 128-byte swizzle row
SMEM_LIMIT = 227 * 1024
LOG2E = 1.4426950408889634
NUM_WARPGROUPS = 3
_SWZ8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))      # fp8 [.., 256]: 128-byte rows
FP8_TILE = 128                # latent columns per fp8 scale
_SWZ_P = (plgpu.TilingTransform((8, TOK)), plgpu.SwizzleTransform(64))    # [64, 32] bf16: 64-byte rows


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static launch configuration of the rows kernel for one call shape."""
  rows: int            # Sq * H query rows per sequence
  groups: int          # row groups G of 64: 64 * G >= rows (the last one zero-padded)
  num_parts: int       # KV shares per row group (the split-KV width)
  num_stages: int      # page ring depth
  fp8: bool = False    # fp8_e4m3 cache: a ring of fp8 pages, dequantized per page into one f16 page
  # fp8, 1 slot: how many of a page's 4 [32, 128] dequant tiles a warpgroup loads and converts into registers
  # while the previous page's P.V runs (stored after kfree); 0: the whole dequant after kfree
  prefetch_tiles: int = 0
  # every kbuf / Q operand address of the page loop is offset by a per-page zero the compiler cannot see through
  # (the page counter >> 31), so their wgmma descriptors are rebuilt in the loop instead of kept in registers
  # across it, where ptxas spills them (NOTES.md)
  rebase_per_page: bool = True

  @property
  def n(self) -> int:  # rows per CTA, as mosaic_sm90.Plan names it
    return ROWS

  @property
  def smem_bytes(self) -> int:
    return smem_bytes(self.num_stages, self.fp8)


def smem_bytes(stages: int, fp8: bool = False) -> int:
  """Dynamic SMEM of the rows kernel as Mosaic counts it (every scratch buffer rounded up to 1 KiB, then 8 B a
  barrier): Q, the page ring, P, the row-max / row-sum exchange; with an fp8 cache also the dequantized f16 page,
  and with ONE fp8 slot Q's rope and the rope copy (NOTES.md: the 1-slot ring and the 2-slot ring)."""
  kib = lambda n: -(-n // 1024) * 1024
  q_lat = ROWS * LATENT_DIM * 2                  # fp8: in f16, same bytes
  rope = ROWS * ROPE_DIM * 2                     # Q's rope [64, 64] bf16; the page's rope is the same size
  p = ROWS * PAGE * 2
  exchange = 2 * kib(2 * ROWS * 4)
  if fp8:
    slot = PAGE * LATENT_DIM + PAGE * ROPE_DIM * 2 + kib(PAGE * (LATENT_DIM // FP8_TILE) * 4)
    f16_page = PAGE * LATENT_DIM * 2
    # 2+ slots: QK reads the rope from the held slot (no copy) and Q's rope from registers
    extra = 2 * rope if stages == 1 else 0
    return q_lat + stages * slot + f16_page + extra + p + exchange + 8 * (2 * stages + 5)
  return q_lat + rope + stages * PAGE * (LATENT_DIM + ROPE_DIM) * 2 + p + exchange + 8 * (2 * stages + 4)


def make_plan(rows: int, *, num_sms: int, num_parts: int | None = None, num_stages: int | None = None,
              fp8: bool = False, prefetch_tiles: int | None = None, rebase_per_page: bool | None = None) -> Plan:
  """Row groups, split-KV width and ring depth. Default depth: 2 pages for a bf16 cache, 1 for fp8 (2 fp8 slots
  fit only without the rope copies, Q's rope then in registers; 3% slower than 1 slot on an H200, NOTES.md).
  Defaults (None): prefetch_tiles 2 for fp8 with one slot, else 0; rebase_per_page on."""
  if rows < 1:
    raise ValueError(f"rows must be >= 1, got {rows}")
  groups = -(-rows // ROWS)
  if num_parts is None:
    num_parts = max(1, num_sms // groups)
  stages = (1 if fp8 else 2) if num_stages is None else int(num_stages)   # fp8 num_stages=2: measured 3% slower
  if stages < 1 or smem_bytes(stages, fp8) > SMEM_LIMIT:
    fitting = [s for s in (1, 2) if smem_bytes(s, fp8) <= SMEM_LIMIT]
    raise ValueError(f"mosaic_sm90 rows kernel: {stages} page stages ({'fp8' if fp8 else 'bf16'} cache) need "
                     f"{smem_bytes(max(stages, 1), fp8)} bytes of SMEM (limit {SMEM_LIMIT}); use num_stages in "
                     f"{fitting}")
  if prefetch_tiles is None:
    prefetch_tiles = 2 if fp8 and stages == 1 else 0   # fp8 h128 b128 L4096: 418.0 -> 406.6 us (NOTES.md)
  prefetch_tiles = int(prefetch_tiles)
  if prefetch_tiles and not (fp8 and stages == 1):
    raise ValueError(f"mosaic_sm90 rows kernel: prefetch_tiles={prefetch_tiles} applies to an fp8 cache with a "
                     f"1-slot ring (got {'fp8' if fp8 else 'bf16'}, {stages} slots)")
  if not 0 <= prefetch_tiles <= LATENT_DIM // FP8_TILE:
    raise ValueError(f"mosaic_sm90 rows kernel: prefetch_tiles must be in [0, {LATENT_DIM // FP8_TILE}], "
                     f"got {prefetch_tiles}")
  return Plan(rows=rows, groups=groups, num_parts=int(num_parts), num_stages=stages, fp8=bool(fp8),
              prefetch_tiles=prefetch_tiles, rebase_per_page=rebase_per_page is None or bool(rebase_per_page))


def build_call(plan: Plan, *, batch: int, sq: int, heads: int, causal: bool, softmax_scale: float, num_pages: int,
               interpret):
  """The pallas kernel: (q_lat [B*G, 64, >= 512] bf16 (its first 512 columns), q_rope [B*G, 64, 64 or 576] bf16 (its
  last 64 columns; both can be q whole), latent, rope, (scale: fp8 cache),
  block_table, lens, cu, sched) -> (o_part f32 [E*G, 64, 512] normalized, lse2_part f32 [E*G, 64] log2 domain),
  E = num_parts + batch. Q comes in its two parts so that the model's concatenation of them is never written
  (mosaic_sm90._mla_decode_rows slices it back; XLA takes each part from its producer)."""
  g_count, parts, stages, fp8 = plan.groups, plan.num_parts, plan.num_stages, plan.fp8
  entries = parts + batch
  scale_log2 = float(softmax_scale) * LOG2E
  causal_rows = bool(causal) and sq > 1
  dt = jnp.float16 if fp8 else jnp.bfloat16      # latent MMAs (Q latent, K/V, P): f16 for fp8 (no fp8 -> bf16 cvt)
  on_gpu = interpret is False or interpret is None
  # fp8 with 2+ slots: a slot stays held until both QKs are done, so QK reads the page's rope from it (no krope)
  # and Q's rope is the rope wgmma's register A operand (no qr_smem): 2 slots fit only without both (NOTES.md)
  held = fp8 and stages > 1

  # one list for the three paths (bf16; fp8 with 1 slot; fp8 with 2+ held slots), in one order
  scratch = dict(q_smem=plgpu.SMEM((2, ROWS, HALF), dt, transforms=SWZ16))      # Q latent (f16 for fp8), by half
  if not held:
    scratch["qr_smem"] = plgpu.SMEM((ROWS, ROPE_DIM), jnp.bfloat16, transforms=SWZ16)          # Q rope
  scratch.update(
      ring_lat=plgpu.SMEM((stages, 2, PAGE, HALF), jnp.float8_e4m3fn if fp8 else dt,
                          transforms=_SWZ8 if fp8 else SWZ16),
      ring_rope=plgpu.SMEM((stages, PAGE, ROPE_DIM), jnp.bfloat16, transforms=SWZ16))
  if fp8:
    scratch.update(
        ring_sc=plgpu.SMEM((stages, PAGE, LATENT_DIM // FP8_TILE), jnp.float32),
        kbuf=plgpu.SMEM((2, PAGE, HALF), dt, transforms=SWZ16))           # the dequantized page, by latent half
  if fp8 and not held:
    scratch["krope"] = plgpu.SMEM((PAGE, ROPE_DIM), jnp.bfloat16, transforms=SWZ16)   # its rope (frees the slot early)
  scratch.update(
      pbuf=plgpu.SMEM((ROWS, PAGE), dt),                                  # P; columns [32 w, +32) by warpgroup w
      mx=plgpu.SMEM((2, ROWS), jnp.float32),                              # per-page row maxima, by warpgroup
      lx=plgpu.SMEM((2, ROWS), jnp.float32),                              # per-segment row sums, by warpgroup
      # a page landed: latent halves + rope (+ scales for fp8)
      loaded=plgpu.Barrier(num_arrivals=4 if fp8 else 3, num_barriers=stages),
      # slot free again: bf16 after P.V; fp8 after both dequants (1 slot) or both QKs (held)
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      # Q landed: latent halves (bf16: 2 TMAs; fp8: each warpgroup's converted half) + rope (unless held)
      qbar=plgpu.Barrier(num_arrivals=2 if held else 3),
      mbar=plgpu.Barrier(num_arrivals=2),                                 # row maxima written (both QKs done)
      pbar=plgpu.Barrier(num_arrivals=2),                                 # P written (and tails zeroed)
      lbar=plgpu.Barrier(num_arrivals=2))                                 # row sums written (segment done)
  if fp8:
    scratch["kfree"] = plgpu.Barrier(num_arrivals=2)                      # both P.V done with kbuf (/ krope)
  if held and not on_gpu:
    # interpret mode runs no register A operand: each warpgroup's copy of Q's rope goes through SMEM (as P)
    scratch["qr_smem"] = plgpu.SMEM((2, ROWS, ROPE_DIM), jnp.bfloat16, transforms=SWZ16)
  names = list(scratch)

  def body(*refs):
    if fp8:
      q_ref, qr_ref, lat_ref, rope_ref, sc_ref, bt_ref, lens_ref, cu_ref, sched_ref, o_ref, lse_ref = refs[:11]
      scratch_refs = refs[11:]
    else:
      q_ref, qr_ref, lat_ref, rope_ref, bt_ref, lens_ref, cu_ref, sched_ref, o_ref, lse_ref = refs[:10]
      sc_ref = None
      scratch_refs = refs[10:]
    r = dict(zip(names, scratch_refs))
    q_smem, ring_lat, ring_rope, pbuf, mx, lx = (
        r[k] for k in ("q_smem", "ring_lat", "ring_rope", "pbuf", "mx", "lx"))
    loaded, consumed, qbar, mbar, pbar, lbar = (
        r[k] for k in ("loaded", "consumed", "qbar", "mbar", "pbar", "lbar"))
    qr_smem, ring_sc, kbuf, krope, kfree = (r.get(k) for k in ("qr_smem", "ring_sc", "kbuf", "krope", "kfree"))
    wg = lax.axis_index("wg")
    part = lax.axis_index("part")
    grp = lax.axis_index("g")
    b_first, b_last, seq_pages = share_of_part(sched_ref, cu_ref, part)   # split_kv.schedule_kernel's share

    # -------- warpgroup 2: the page producer (as in mosaic_sm90) --------
    @pl.when(wg == 2)
    def _producer():
      produce_pages(b_first=b_first, b_last=b_last, seq_pages=seq_pages, bt_ref=bt_ref, lat_ref=lat_ref,
                    rope_ref=rope_ref, sc_ref=sc_ref if fp8 else None, ring_lat=ring_lat, ring_rope=ring_rope,
                    ring_sc=ring_sc, loaded=loaded, consumed=consumed, stages=stages, num_pages=num_pages,
                    half=HALF)

    # -------- warpgroups 0, 1: scores of tokens [32 w, 32 w + 32), softmax, P.V for columns [256 w, +256) ----
    def compute(w: int):
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      row_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, TOK), 0, layout=plgpu.Layout.WGMMA)
      tok_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, TOK), 1, layout=plgpu.Layout.WGMMA) + w * TOK
      q_index = lax.div(grp * ROWS + row_iota, jnp.int32(heads))   # query token s of each row (r = s*H + h)
      row_layout = plgpu.Layout.WGMMA.reduce(1)

      def zero_tail(slot, n_valid):
        # rows past the length of a partial last page -> 0 in this warpgroup's V half before P.V
        @pl.when(n_valid < PAGE)
        def _():
          for c in range(HALF // CHUNK):
            x = ring_lat[slot, w, :, pl.ds(c * CHUNK, CHUNK)]
            rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
            ring_lat[slot, w, :, pl.ds(c * CHUNK, CHUNK)] = jnp.where(rows < n_valid, x, jnp.zeros_like(x))

      def dequant(slot, n_valid, z=0):
        """fp8: this warpgroup's tokens [32 w, 32 w + 32) of the page, all 512 latent columns -> f16 x tile scale
        (exact: power-of-two scales) into kbuf, tokens past the length -> 0 by select (they may hold NaN; only
        a partial last page pays the select), and (one slot) the same tokens' bf16 rope into krope. QK reads only
        these tokens; P.V reads both halves after pbar."""
        toks = pl.ds(w * TOK, TOK)
        sc_all = plgpu.load(ring_sc.at[slot, toks], layout=scale_layout(), optimized=False)
        col4 = plgpu.broadcasted_iota(jnp.int32, (TOK, 4), 1, layout=scale_layout())

        def convert(masked: bool):
          if masked:
            row4 = plgpu.broadcasted_iota(jnp.int32, (TOK, 4), 0, layout=scale_layout()) + w * TOK
            ok = (row4 < n_valid).astype(jnp.float32)
          for t in range(LATENT_DIM // FP8_TILE):
            cols = pl.ds((t % 2) * FP8_TILE, FP8_TILE)
            x = plgpu.load(ring_lat.at[slot, t // 2, toks, cols], layout=dequant_layout(), optimized=True)
            kbuf[t // 2 + z, toks, cols] = scaled_f16(x, sc_all, col4, t, ok if masked else None)
          if not held:
            krope[toks, :] = plgpu.load(ring_rope.at[slot, toks], layout=dequant_layout(), optimized=True)

        pl.when(n_valid >= (w + 1) * TOK)(lambda: convert(False))
        pl.when(n_valid < (w + 1) * TOK)(lambda: convert(True))

      def load_tiles(slot, n_valid, ts):
        """prefetch_tiles: dequant tiles ts of this warpgroup's tokens (as dequant's) into registers, f16,
        tail tokens -> 0 by select on a partial page (the other branch skips the select)."""
        toks = pl.ds(w * TOK, TOK)
        sc_all = plgpu.load(ring_sc.at[slot, toks], layout=scale_layout(), optimized=False)
        col4 = plgpu.broadcasted_iota(jnp.int32, (TOK, 4), 1, layout=scale_layout())

        def convert(masked: bool):
          if masked:
            row4 = plgpu.broadcasted_iota(jnp.int32, (TOK, 4), 0, layout=scale_layout()) + w * TOK
            ok = (row4 < n_valid).astype(jnp.float32)
          out = []
          for t in ts:
            x = plgpu.load(ring_lat.at[slot, t // 2, toks, pl.ds((t % 2) * FP8_TILE, FP8_TILE)],
                           layout=dequant_layout(), optimized=True)
            out.append(scaled_f16(x, sc_all, col4, t, ok if masked else None))
          return tuple(out)

        return lax.cond(n_valid >= (w + 1) * TOK, lambda: convert(False), lambda: convert(True))

      def store_tiles(ts, xs, z):
        toks = pl.ds(w * TOK, TOK)
        for t, x in zip(ts, xs):
          kbuf[t // 2 + z, toks, pl.ds((t % 2) * FP8_TILE, FP8_TILE)] = x

      def no_tiles(ts):
        return tuple(plgpu.layout_cast(jnp.zeros((TOK, FP8_TILE), jnp.float16), dequant_layout()) for _ in ts)

      def seg(b, ctr):
        lo, hi = seq_pages(b)
        length = lens_ref[b]

        def finish(acc, m_i, l_i):
          # row sums of both token halves (same scale history in both warpgroups: one max per page)
          lx[w] = l_i
          plgpu.barrier_arrive(lbar)
          plgpu.barrier_wait(lbar)
          l_other = plgpu.load(lx.at[1 - w], layout=row_layout, optimized=False)
          l_sum = l_i + l_other
          seen = l_sum > 0
          inv = jnp.where(seen, 1.0 / jnp.where(seen, l_sum, 1.0), 0.0)
          eg = (part + b) * g_count + grp     # partial entry (share + sequence) of this row group
          o_ref[eg, :, pl.ds(w * HALF, HALF)] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
          if w == 0:
            lse_ref[eg] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_sum, 1.0)), -jnp.inf)

        @pl.when(hi > lo)
        def _segment():
          # Q of (sequence b, row group grp): both warpgroups are done with the previous Q (lbar of the previous
          # segment, or nothing came before)
          bg = b * g_count + grp
          start_q_latent(q_ref, bg, q_smem, qbar, w, fp8, HALF)
          if w == 0 and not held:
            if fp8:
              plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(q_rope_of(qr_ref, bg), qr_smem, qbar)
          qr = None
          if held:
            # Q's rope [64, 64] bf16 straight from GMEM into the WGMMA layout, once a segment (16 registers)
            qr = plgpu.load(q_rope_of(qr_ref, bg), layout=plgpu.Layout.WGMMA, optimized=False)
            if not on_gpu:
              # this warpgroup's previous QKs are done with its copy (wgmma_wait in qk)
              qr_smem[w] = qr
              plgpu.commit_smem()
          plgpu.barrier_wait(qbar)
          limit = (length - sq + 1 + q_index) if causal_rows else length

          def page(j, carry):
            acc, m_i, l_i = carry
            c = ctr + (j - lo)
            slot = lax.rem(c, stages)
            n_valid = length - j * PAGE
            plgpu.barrier_wait(loaded.at[slot])
            # rebase_per_page: 0 (c >= 0), but not a constant to the compiler, so the kbuf / Q operand addresses
            # below depend on the page and their wgmma descriptors are rebuilt in the loop (a few integer ops)
            # instead of being kept in registers across it, where ptxas spills them (fp8: NOTES.md)
            z = lax.shift_right_logical(c, 31) if plan.rebase_per_page else 0
            if fp8:
              @pl.when(c > 0)
              def _():
                plgpu.barrier_wait(kfree)       # both P.Vs of the previous page are done reading kbuf

              dequant(slot, n_valid, z)
              plgpu.commit_smem()               # this warpgroup's tiles visible to its wgmma
              if not held:
                plgpu.barrier_arrive(consumed.at[slot])   # the fp8 slot is read: the producer may refill it

            def qk(acc_ref):
              for cc in range(LATENT_DIM // CHUNK):
                if fp8:
                  k_tile = kbuf.at[cc // 4 + z, pl.ds(w * TOK, TOK), pl.ds((cc % 4) * CHUNK, CHUNK)]
                else:
                  k_tile = ring_lat.at[slot, cc // 4, pl.ds(w * TOK, TOK), pl.ds((cc % 4) * CHUNK, CHUNK)]
                plgpu.wgmma(acc_ref, q_smem.at[cc // 4 + z, :, pl.ds((cc % 4) * CHUNK, CHUNK)], k_tile.T)
              if held:
                # the rope straight from the held slot; Q's rope from registers (interpret: this warpgroup's copy)
                plgpu.wgmma(acc_ref, qr if on_gpu else qr_smem.at[w], ring_rope.at[slot, pl.ds(w * TOK, TOK)].T)
              elif fp8:
                plgpu.wgmma(acc_ref, qr_smem, krope.at[pl.ds(w * TOK, TOK)].T)
              else:
                plgpu.wgmma(acc_ref, qr_smem, ring_rope.at[slot, pl.ds(w * TOK, TOK)].T)
              plgpu.wgmma_wait(0)
              return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, TOK), jnp.float32))
            if held:
              # this warpgroup's reads of the slot are done (dequant: fenced by commit_smem; QK: waited)
              plgpu.barrier_arrive(consumed.at[slot])
            s = s * scale_log2
            s = jnp.where(j * PAGE + tok_iota < limit, s, -jnp.inf)
            m_mine = s.max(axis=1)
            # exchange row maxima: after this barrier both QKs are done with every tile of the slot
            mx[w] = m_mine
            plgpu.barrier_arrive(mbar)
            plgpu.barrier_wait(mbar)
            m_other = plgpu.load(mx.at[1 - w], layout=row_layout, optimized=False)
            m_new = jnp.maximum(m_i, jnp.maximum(m_mine, m_other))     # max is exact: same bits in both
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)                          # this warpgroup's 32 tokens
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if not fp8:
              zero_tail(slot, n_valid)        # (fp8: the dequant zeroed the tail tokens of kbuf)
            pbuf[:, pl.ds(w * TOK, TOK)] = p.astype(dt)
            plgpu.commit_smem()
            plgpu.barrier_arrive(pbar)
            plgpu.barrier_wait(pbar)
            v_half = lambda: kbuf.at[w + z] if fp8 else ring_lat.at[slot, w]   # (taken inside each pv: same trace)

            if on_gpu:
              # P [64, 64] as the wgmma A operand from registers, accumulating onto the rescaled O in place
              p_all = plgpu.load(pbuf, layout=plgpu.Layout.WGMMA, optimized=False)

              def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_all, v_half())
                plgpu.wgmma_wait(0)

              acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:
              # GPU interpret mode runs neither a register A operand nor a preinitialized accumulator: the same
              # product with P read from SMEM into a fresh accumulator (on the GPU that would be 256 registers)
              def pv(acc_ref):
                plgpu.wgmma(acc_ref, pbuf, v_half())
                plgpu.wgmma_wait(0)
                return acc_ref[...]

              acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, HALF), jnp.float32))
            plgpu.barrier_arrive(kfree if fp8 else consumed.at[slot])
            return acc, m_new, l_i

          def prefetched_pages(acc_ref, m0, l0):
            """fp8, one slot, prefetch_tiles = k: a page's P.V is issued and, while it runs, the next page of the
            segment is waited for and its first k dequant tiles loaded and converted into registers; they are
            stored into kbuf after kfree, with the other 4 - k tiles converted then. The same hand-offs as `page`:
            kfree before kbuf is rewritten, consumed after the last read of the slot. On the GPU O stays in
            acc_ref, this scope's accumulator for the whole segment (zero at its start; `page` cannot carry
            registers out of its P.V's run_state); interpret mode (acc_ref None: no accumulator writes, no
            register A operand there) carries O as a value and adds each page's P.V from a fresh accumulator."""
            early = tuple(range(plan.prefetch_tiles))
            late = tuple(range(plan.prefetch_tiles, LATENT_DIM // FP8_TILE))
            toks = pl.ds(w * TOK, TOK)
            plgpu.barrier_wait(loaded.at[lax.rem(ctr, stages)])
            pre0 = load_tiles(lax.rem(ctr, stages), length - lo * PAGE, early)

            def page_pf(j, carry):
              m_i, l_i, pre, *acc = carry
              c = ctr + (j - lo)
              slot = lax.rem(c, stages)
              n_valid = length - j * PAGE
              z = lax.shift_right_logical(c, 31) if plan.rebase_per_page else 0    # as in `page`

              @pl.when(c > 0)
              def _():
                plgpu.barrier_wait(kfree)       # both P.Vs of the previous page are done reading kbuf

              store_tiles(early, pre, z)
              if late:
                store_tiles(late, load_tiles(slot, n_valid, late), z)
              krope[toks, :] = plgpu.load(ring_rope.at[slot, toks], layout=dequant_layout(), optimized=True)
              plgpu.commit_smem()               # this warpgroup's tiles visible to its wgmma
              plgpu.barrier_arrive(consumed.at[slot])     # the fp8 slot is read: the producer may refill it

              def qk(s_ref):
                for cc in range(LATENT_DIM // CHUNK):
                  k_tile = kbuf.at[cc // 4 + z, toks, pl.ds((cc % 4) * CHUNK, CHUNK)]
                  plgpu.wgmma(s_ref, q_smem.at[cc // 4 + z, :, pl.ds((cc % 4) * CHUNK, CHUNK)], k_tile.T)
                plgpu.wgmma(s_ref, qr_smem, krope.at[toks].T)
                plgpu.wgmma_wait(0)
                return s_ref[...]

              s = pl.run_scoped(qk, plgpu.ACC((ROWS, TOK), jnp.float32))
              s = s * scale_log2
              s = jnp.where(j * PAGE + tok_iota < limit, s, -jnp.inf)
              m_mine = s.max(axis=1)
              mx[w] = m_mine
              plgpu.barrier_arrive(mbar)
              plgpu.barrier_wait(mbar)
              m_other = plgpu.load(mx.at[1 - w], layout=row_layout, optimized=False)
              m_new = jnp.maximum(m_i, jnp.maximum(m_mine, m_other))
              m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
              alpha = jnp.exp2(m_i - m_use)
              p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
              l_i = l_i * alpha + p.sum(axis=1)
              alpha_o = lax.broadcast_in_dim(alpha, (ROWS, HALF), [0])
              if acc_ref is not None:
                acc_ref[...] = acc_ref[...] * alpha_o
              else:
                acc = [acc[0] * alpha_o]
              pbuf[:, toks] = p.astype(dt)
              plgpu.commit_smem()
              plgpu.barrier_arrive(pbar)
              plgpu.barrier_wait(pbar)
              def next_page():
                nxt = lax.rem(c + 1, stages)
                plgpu.barrier_wait(loaded.at[nxt])
                return load_tiles(nxt, n_valid - PAGE, early)

              if acc_ref is not None:
                plgpu.wgmma(acc_ref, plgpu.load(pbuf, layout=plgpu.Layout.WGMMA, optimized=False), kbuf.at[w + z])
                pre = lax.cond(j + 1 < hi, next_page, lambda: no_tiles(early))     # while P.V runs
                plgpu.wgmma_wait(0)
              else:
                def pv(tmp_ref):
                  plgpu.wgmma(tmp_ref, pbuf, kbuf.at[w + z])
                  nxt_tiles = lax.cond(j + 1 < hi, next_page, lambda: no_tiles(early))
                  plgpu.wgmma_wait(0)
                  return tmp_ref[...], nxt_tiles

                d, pre = pl.run_scoped(pv, plgpu.ACC((ROWS, HALF), jnp.float32))
                acc = [acc[0] + d]
              plgpu.barrier_arrive(kfree)
              return (m_new, l_i, pre, *acc)

            if acc_ref is not None:
              m_i, l_i, _ = lax.fori_loop(lo, hi, page_pf, (m0, l0, pre0))
              return acc_ref[...], m_i, l_i
            acc0 = plgpu.layout_cast(jnp.zeros((ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
            m_i, l_i, _, acc = lax.fori_loop(lo, hi, page_pf, (m0, l0, pre0, acc0))
            return acc, m_i, l_i

          m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
          l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
          if plan.prefetch_tiles:
            if on_gpu:
              finish(*pl.run_scoped(lambda acc_ref: prefetched_pages(acc_ref, m0, l0),
                                    plgpu.ACC((ROWS, HALF), jnp.float32)))
            else:
              finish(*prefetched_pages(None, m0, l0))
            return
          acc0 = plgpu.layout_cast(jnp.zeros((ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
          acc, m_i, l_i = lax.fori_loop(lo, hi, page, (acc0, m0, l0))
          finish(acc, m_i, l_i)

        return ctr + jnp.maximum(hi - lo, 0)

      done = lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))
      if fp8:
        @pl.when(done > 0)
        def _():
          plgpu.barrier_wait(kfree)           # the last page's release, so no phase is left pending

    for w in range(2):
      pl.when(wg == w)(functools.partial(compute, w))

  out_type = (jax.ShapeDtypeStruct((entries * g_count, ROWS, LATENT_DIM), jnp.float32),
              jax.ShapeDtypeStruct((entries * g_count, ROWS), jnp.float32))
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=list(scratch.values()), grid=(g_count, parts),
      grid_names=("g", "part"), num_threads=NUM_WARPGROUPS, thread_name="wg",
      # every SMEM hand-off is ordered by an mbarrier or commit_smem (as in mosaic_sm90); no cross-warp
      # reduction, so the reduction scratch is the minimum
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           reduction_scratch_bytes=0),
      interpret=interpret)
