"""mosaic_sm90's seesaw kernel (auto's where Sq * H is a multiple of 64, both caches): FlashMLA's schedule.

The rows kernel (mosaic_sm90_rows.py) runs each page in lockstep: both compute warpgroups take half its tokens'
scores, swap row maxima, run the softmax and multiply P by their halves of V, so the tensor cores idle through
every exchange and softmax (an H200 measured ~4,870 clock cycles a page against ~2,750 of tensor work: NOTES.md).
Here the two warpgroups take a PAIR of pages (K0 in ring slot 0, K1 in slot 1) and stagger, as FlashMLA's
"seesaw" (its docs/20250422-new-kernel-deep-dive.md) does, so one's softmax runs under the other's MMAs:

    [0] S0 = Q K0^T          m0 = max(m, rowmax S0)      P0 = exp2(S0 - m0)    O_L = O_L * 2^(m - m0) + P0 V0_L
    [1] S1 = Q K1^T          m1 = max(m0, rowmax S1)     P1 = exp2(S1 - m1)    O_R = O_R * 2^(m - m1) + P1 V1_R
    [0] O_L = (O_L + ...) * 2^(m0 - m1) + P1 V1_L        (P1 from SMEM, written by [1])
    [1] O_R += (P0 * 2^(m0 - m1)) V0_R                    (P0 rescaled and written to SMEM by [0])
                                                         m = m1

Q [64 rows, 576] . K^T is one m64n64 wgmma stream over 576 dims per warpgroup and page (a third less SMEM traffic
per FLOP than the rows kernel's two m64n32 streams); warpgroup 0 owns O's latent columns [0, 256) (O_L), warpgroup
1 [256, 512) (O_R), 128 f32 registers a thread each. Each keeps its own row sum (L0 over the P0s, L1 over the P1s,
both rescaled to the running max) and they add them once per segment.

SMEM (227 KiB): Q's latent part 64 KiB + 2 pages x 72 KiB + two P buffers 16 KiB + 1 KiB of row maxima / sums =
225 KiB; Q's rope [64, 64] is a register A operand (16 registers, loaded once a segment), as FlashMLA keeps it.
The ring's two slots are the pair, so each slot is released in two parts as soon as its readers are done, and the
producer refills them in the order they are freed: part A (latent columns [0, 256)) of slot 0 is read by warpgroup
0 only (QK, then P0 V0_L); part B (latent [256, 512) + rope) of slot 1 by warpgroup 1 only (QK, P1 V1_R); part B of
slot 0 by [0]'s QK and [1]'s P0 V0_R; part A of slot 1 by [1]'s QK and [0]'s P1 V1_L. An odd last page of a segment
has no K1: warpgroup 1 skips its QK and P.V (m1 = m0) and slot 1 is not loaded. With an fp8 cache the producer
converts the parts one after another, so it fills slot 0's part B (freed last, needed first by [0]'s next QK)
before slot 1's part A (`b0_before_a1`, NOTES.md).

fp8 cache: the ring holds the pages in f16 (the same SMEM as bf16: no fp8 slot at all). The producer warpgroup
loads each part's e4m3 tiles straight from GMEM into registers (before waiting for the part's release, so their
latency runs under the wait), converts them to f16 x the tile's power-of-two scale (exact) and stores them into the
slot; the rope still comes by TMA. So the dequant runs beside the compute warpgroups' MMAs instead of in lockstep
before them (the rows kernel's fp8 bound, NOTES.md), and it has registers for it: 72 a thread against 40 (the
compute warpgroups get 216 instead of 232; `REGISTERS`). Q's latent part and P are f16, as in the rows kernel.

Direct write (`Plan.direct_write`, on by default: `DIRECT_WRITE`): a share that holds a sequence whole writes its
normalized bf16 output and lse itself instead of f32 partials, and the merge kernel skips it (FlashMLA's scheme);
with an fp8 cache the output leaves through the warpgroup's Q half of SMEM and a TMA store. The split schedule's
payload rule then charges every sequence it cuts over shares a merge (split_kv.CUT_PAGES_DIRECT), so uniform
batches get shares of whole sequences where that is cheap.

Masks and NaN safety as in the rows kernel: table entries past a sequence's pages are never read, scores past the
length or the causal limit are masked to -inf by select, and the V rows of a partial last page past the length are
zeroed by select before P.V (bf16: by the warpgroup that reads that half of V, after every QK on the page is done;
fp8: by the producer's conversion).

Interpret mode runs neither a register A operand nor an accumulator that is read and written in place: there each
warpgroup passes its own P and its copy of Q's rope through SMEM (interpret-only buffers) and carries O as a value,
adding each P.V from a fresh accumulator (same products). Synchronisation: every SMEM hand-off is ordered by an
mbarrier or commit_smem (Mosaic's automatic barriers off); no reduction crosses warps.
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
from pallas_kernels.mla_decode.sm90_shared import (check_l2_prefetch, convert_fp8_part, load_fp8_part, page_ahead,
                                                    q_rope_of, share_of_part, start_q_latent, SWZ16)
from pallas_kernels.sm90_registers import check_register_split

PAGE = 64                     # tokens per page
ROWS = 64                     # query rows per CTA (wgmma M)
HALF = LATENT_DIM // 2        # latent columns of O per compute warpgroup; also a ring slot's part A / B split
CHUNK = 64                    # 64 16-bit elements = one 128-byte swizzle row
TOK = PAGE // 2               # tokens of an fp8 conversion unit
FP8_TILE = 128                # latent columns per fp8 scale
SMEM_LIMIT = 227 * 1024
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NUM_WARPGROUPS = 3
# barriers: loaded A/B x 2 slots, consumed A/B x 2 slots, qbar, the four hand-offs, lbar
_NUM_BARRIERS = 14

# l2_prefetch's limit: 4 pairs of bf16 pages a CTA ahead is ~78 MB over 132 SMs, above the 50 MB L2
MAX_L2_PREFETCH = 4
# make_plan's l2_prefetch for an fp8 cache (jax 0.11.2, 51d1294, b128 h128 L4096, CUPTI kernel.
# H100: 387.7 us off, 357.8 at 1 pair, 364.6 at 2, 384.1 at 3; the rows kernel 376.0. H200: 386.6 off, 358.6 at 1;
# rows 372.0). Off for bf16 (TMA pages; H100: 301.0 off, 369.7 at 1)
DEFAULT_L2_PREFETCH = 1
# make_plan's direct_write by cache (fp8?). jax 0.11.2, one H100, CUPTI, whole call (kernel) µs, L4096, merging every
# sequence -> direct. bf16 b128 h128 (a86969c): 331.3 (283.5) -> 321.3 (284.2): on. fp8 with the output stored from
# registers (a86969c): b128 405.2 (357.0) -> 424.1 (386.5); its SASS had two spill loads in warpgroup 0's page-pair
# loop. fp8 through the Q half and a TMA store (71e9901; no spill in either page loop): b128 404.6 (357.0) -> 425.4
# (388.0), b64 208.9 (187.6) -> 200.7 (184.8), Sq 2 766.0 (685.3) -> 729.0 (675.8), ragged [1, 2L] 429.6 -> 425.0.
# The b128 kernel's +20-31 µs came with 125-page shares (the payload rule's pick at 66 shares a row group: about
# half the sequences cut, one or none whole a share): ncu (H100, 6d32b45) gives both builds the same mean SM active
# cycles (627.8k merged, 633.9k direct) but 652k -> 699k elapsed, a tail, and the same stall profile. With 64
# shares of two whole sequences (num_parts 64) direct is 381.4 (357.6) against 404.9 (365.4) merged, the default's
# 405.7 (356.9). So fp8 is on too, with the payload rule charging a cut sequence its merge
# (split_kv.CUT_PAGES_DIRECT), which picks 128-page shares there
DIRECT_WRITE = {False: True, True: True}
# make_plan's b0_before_a1 by cache (fp8?). One H100, jax 0.11.2, f58de25, L4096, CUPTI whole call (kernel) µs,
# release order -> B0 first: fp8 b128 h128 368.3 (358.0) -> 334.8 (324.5), b64 189.1 -> 174.3, Sq 2 732.6 -> 690.6,
# ragged [1, 2L] 409.5 -> 386.5; bf16 b128 h128 281.3 -> 286.8 (its TMA pages land a few hundred ns after a release,
# so the order costs nothing there, and its [1] then waits for A1)
B0_BEFORE_A1 = {False: False, True: True}
# make_plan's p0_first by cache (fp8?). One H100, 42d71d3, whole call µs, default -> p0_first: fp8 b128 h128 340.6 ->
# 346.3, b64 174.3 -> 179.9, Sq 2 699.9 -> 666.9, ragged 383.5 -> 392.3; bf16 280.7 -> 290.8: off (Sq 2 alone gains)
P0_FIRST = {False: False, True: False}
# the parts tile_release can name, and make_plan's default for an fp8 cache. One H100, jax 0.11.2,
# e69250b / 5eb964b, L4096, CUPTI kernel µs, none -> ("b0",): b128 h128 329.8 -> 325.4 and 328.8 -> 325.7 (two runs),
# b64 169.0 -> 166.9, Sq 2 676.7 -> 638.9, ragged [1, 2L] 363.4 -> 365.9 and 363.1 -> 362.0; ("a1", "b0") no better
# than ("b0",) at b128 / b64 (325.9, 168.2)
TILE_PARTS = ("b0", "a1")
TILE_RELEASE = ("b0",)

# registers a thread per warpgroup: (producer, each compute warpgroup). The launch gives 3 x 168, so the three must
# sum to at most 504 (2 x 240 + 24 hung on an H200: NOTES.md). The fp8 producer converts a page part in registers
# and holds its tiles and scales across the wait: 88 / 208 (an H100 timed it equal to 72 / 216 at 095a11f; ptxas
# since the scales load with the tiles: 0 B of spills against 4 / 8 B at 72 / 216).
REGISTERS = {False: (40, 232), True: (88, 208)}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static launch configuration of the seesaw kernel for one call shape (a 2-page ring)."""
  rows: int            # Sq * H query rows per sequence
  groups: int          # row groups G of 64: 64 * G >= rows (the last one zero-padded)
  num_parts: int       # KV shares per row group (the split-KV width)
  fp8: bool = False    # fp8_e4m3 cache: the producer dequantizes each page from GMEM into the (f16) ring
  producer_registers: int = 40
  compute_registers: int = 232
  num_stages: int = 2  # the ring is the pair of pages
  # warpgroup 0 leaves P0 V0_L in flight while it waits for m1 and hands the rescaled P0 to warpgroup 1 (GPU only;
  # interpret mode runs every wgmma to completion, so there both orders are the same program). make_plan's default:
  # on for a bf16 cache (H100, b128 h128 L4096: kernel 285.9 -> 284.5 us, Sq 2 496.5 -> 486.5), off for fp8 (not
  # timed; 4 B more spilled there)
  early_p0: bool = False
  # pairs of pages ahead of the one it fills that the producer asks the TMA unit to bring into L2 (0: off). The fp8
  # producer reads each page part from GMEM into registers, and on an H100 (ncu, 14ec995) it spent its time waiting
  # for those loads and the block table's entry in front of them, one part after another, while the compute
  # warpgroups waited for it; a page already in L2 shortens each wait
  l2_prefetch: int = 0
  # a sequence that one share holds whole (every one, with uniform lengths and the snapped payload) is normalized
  # and written as the op's bf16 output by its CTA (FlashMLA's kernel does the same), not as an f32 partial for the
  # merge to read: the merge then runs only for sequences split over shares. make_plan's default: on (DIRECT_WRITE)
  direct_write: bool = False
  # the producer fills slot 0's part B before slot 1's part A, not in the order the previous pair frees them (A1 is
  # freed before B0, by [0]'s P1 V1_L; B0 last, by [1]'s P0 V0_R). With an fp8 cache each part is converted in
  # turn, and in ncu (H100, 6d32b45, stalls mapped to the SASS) the compute warpgroups waited most for B0, which
  # [0]'s QK needs right after part A at the start of the next pair; A1 is [1]'s, whose pair starts later
  b0_before_a1: bool = False
  # warpgroup 1 runs P0 V0_R before P1 V1_R (and its QK reads slot 1's part A first), so slot 0's part B is freed
  # mid-pair and B1 last; the producer fills A0, B0, A1, B1. make_plan's default: P0_FIRST
  p0_first: bool = False
  # fp8: page parts released to their QK in two column tiles, the first on a barrier of its own once the producer
  # has converted it, the second (and part B's rope) on the part's loaded barrier, so that QK starts half a part's
  # conversion earlier: "b0" (warpgroup 0's QK over slot 0's part B, the part it waits for most: b0_before_a1),
  # "a1" (warpgroup 1's QK over slot 1's part A, converted last with b0_before_a1). The P.V readers wait for the
  # whole part (its loaded barrier, released after the first tile's). make_plan's default: TILE_RELEASE
  tile_release: tuple[str, ...] = ()

  @property
  def n(self) -> int:
    return ROWS

  @property
  def smem_bytes(self) -> int:
    # + a barrier a part released by tile
    return smem_bytes() + 8 * len(self.tile_release)


def smem_bytes() -> int:
  """Dynamic SMEM of the GPU kernel as Mosaic counts it (each scratch buffer rounded up to 1 KiB, 8 B a barrier):
  Q's latent part, two pages (latent + rope), two P buffers, one [4, 64] f32 buffer of row maxima and sums. The
  same for both caches (an fp8 cache's pages are held in f16: no fp8 slot)."""
  q_lat = ROWS * LATENT_DIM * 2
  ring = 2 * PAGE * (LATENT_DIM + ROPE_DIM) * 2
  p = 2 * ROWS * PAGE * 2
  stats = 4 * ROWS * 4
  return q_lat + ring + p + stats + 8 * _NUM_BARRIERS


def make_plan(rows: int, *, num_sms: int, num_parts: int | None = None, num_stages: int | None = None,
              fp8: bool = False, producer_registers: int | None = None,
              compute_registers: int | None = None, early_p0: bool | None = None, l2_prefetch: int | None = None,
              direct_write: bool | None = None, b0_before_a1: bool | None = None,
              p0_first: bool | None = None, tile_release=None) -> Plan:
  if num_stages not in (None, 2):
    raise ValueError(f"mosaic_sm90 seesaw kernel: its ring is the pair of pages it works on (2 slots), got "
                     f"num_stages={num_stages}")
  if rows < 1:
    raise ValueError(f"rows must be >= 1, got {rows}")
  producer, compute = REGISTERS[bool(fp8)]
  producer = int(producer_registers or producer)
  compute = int(compute_registers or compute)
  check_register_split([producer, compute, compute], "mosaic_sm90 seesaw kernel (producer, 2 compute warpgroups)")
  groups = -(-rows // ROWS)
  if num_parts is None:
    num_parts = max(1, num_sms // groups)
  if l2_prefetch is None:
    l2_prefetch = DEFAULT_L2_PREFETCH if fp8 else 0
  l2_prefetch = check_l2_prefetch(l2_prefetch, MAX_L2_PREFETCH, "page pairs")
  if tile_release is None:
    tile_release = TILE_RELEASE if fp8 else ()
  tile_release = tuple(sorted(set(tile_release))) if isinstance(tile_release, (tuple, list)) else tile_release
  if not isinstance(tile_release, tuple) or not set(tile_release) <= set(TILE_PARTS):
    raise ValueError(f"mosaic_sm90 seesaw kernel: tile_release is a tuple of page parts from {TILE_PARTS}, got "
                     f"{tile_release!r}")
  if tile_release and not fp8:
    raise ValueError("mosaic_sm90 seesaw kernel: tile_release splits the fp8 producer's conversion of a page part "
                     "(an fp8 cache; a bf16 page comes by TMA whole)")
  return Plan(rows=rows, groups=groups, num_parts=int(num_parts), fp8=bool(fp8), producer_registers=producer,
              compute_registers=compute, early_p0=(not fp8) if early_p0 is None else bool(early_p0),
              l2_prefetch=l2_prefetch,
              direct_write=DIRECT_WRITE[bool(fp8)] if direct_write is None else bool(direct_write),
              b0_before_a1=B0_BEFORE_A1[bool(fp8)] if b0_before_a1 is None else bool(b0_before_a1),
              p0_first=P0_FIRST[bool(fp8)] if p0_first is None else bool(p0_first), tile_release=tile_release)


def build_call(plan: Plan, *, batch: int, sq: int, heads: int, causal: bool, softmax_scale: float, num_pages: int,
               interpret):
  """The pallas kernel: (q_lat [B*G, 64, >= 512] bf16 (its first 512 columns), q_rope [B*G, 64, 64 or 576] bf16 (its
  last 64 columns; both can be q whole), latent, rope, (scale: fp8 cache),
  block_table, lens, cu, sched) -> (o_part f32 [E*G, 64, 512] normalized, lse2_part f32 [E*G, 64] log2 domain),
  E = num_parts + batch: mosaic_sm90_rows.build_call's contract. plan.direct_write adds (out bf16 [B, G, 64, 512]
  (with an fp8 cache its bits as float16, the type of the SMEM it leaves from), lse f32 [B, G, 64] natural log, +inf
  where no key): a row group of a sequence that one share holds whole is written there, normalized, and not as a
  partial (split_kv.merge_partials(direct=...) leaves it alone)."""
  g_count, parts, fp8, direct = plan.groups, plan.num_parts, plan.fp8, plan.direct_write
  entries = parts + batch
  scale_log2 = float(softmax_scale) * LOG2E
  causal_rows = bool(causal) and sq > 1
  dt = jnp.float16 if fp8 else jnp.bfloat16      # latent MMAs (Q latent, K/V, P): f16 for fp8 (no fp8 -> bf16 cvt)
  on_gpu = interpret is False or interpret is None
  tma_out = direct and fp8 and on_gpu             # direct write through the Q half of SMEM and a TMA store
  early_p0 = plan.early_p0 and on_gpu             # interpret mode completes every wgmma as it is issued

  scratch = dict(
      q_smem=plgpu.SMEM((2, ROWS, HALF), dt, transforms=SWZ16),                 # Q latent, by half
      ring_lat=plgpu.SMEM((2, 2, PAGE, HALF), dt, transforms=SWZ16),            # [slot, part A/B, tok, col]
      ring_rope=plgpu.SMEM((2, PAGE, ROPE_DIM), jnp.bfloat16, transforms=SWZ16),  # part B's rope
      pbuf=plgpu.SMEM((2, ROWS, PAGE), dt, transforms=SWZ16),                   # P0 (rescaled) by [0], P1 by [1]
      stats=plgpu.SMEM((4, ROWS), jnp.float32),                                  # m0, m1, L0, L1
      # latent [0, 256) of slot s landed (bf16: its TMA; fp8: the producer's stores)
      loaded_a=plgpu.Barrier(num_arrivals=1, num_barriers=2),
      # latent [256, 512) + rope (bf16: two TMAs; fp8: the producer's stores and the rope's TMA)
      loaded_b=plgpu.Barrier(num_arrivals=2, num_barriers=2),
      # part A free: slot 0 after [0]'s P0 V0_L; slot 1 after [1]'s QK and [0]'s P1 V1_L
      consumed_a0=plgpu.Barrier(num_arrivals=1),
      consumed_a1=plgpu.Barrier(num_arrivals=2),
      # part B free: slot 0 after [0]'s QK and [1]'s P0 V0_R; slot 1 after [1]'s P1 V1_R
      consumed_b0=plgpu.Barrier(num_arrivals=2),
      consumed_b1=plgpu.Barrier(num_arrivals=1),
      qbar=plgpu.Barrier(num_arrivals=2),    # Q's latent halves landed (bf16: 2 TMAs; fp8: each warpgroup's f16 half)
      m0bar=plgpu.Barrier(num_arrivals=1),                                       # [0] wrote m0
      m1bar=plgpu.Barrier(num_arrivals=1),                                       # [1] wrote m1
      p0bar=plgpu.Barrier(num_arrivals=1),                                       # [0] wrote P0 (and its QK is done)
      p1bar=plgpu.Barrier(num_arrivals=1),                                       # [1] wrote P1 (and its QK is done)
      lbar=plgpu.Barrier(num_arrivals=2))                                        # row sums written (segment done)
  for part_name in plan.tile_release:     # the part's first column tile converted (the producer)
    scratch[f"loaded_{part_name}_tile"] = plgpu.Barrier(num_arrivals=1)
  if not on_gpu:
    # interpret mode runs no register A operand: each warpgroup's own P and its copy of Q's rope through SMEM
    scratch["own_p"] = plgpu.SMEM((2, ROWS, PAGE), dt, transforms=SWZ16)
    scratch["qr_smem"] = plgpu.SMEM((2, ROWS, ROPE_DIM), jnp.bfloat16, transforms=SWZ16)
  names = list(scratch)

  def body(*refs):
    q_ref, qr_ref, lat_ref, rope_ref = refs[:4]
    sc_ref, refs = (refs[4], refs[5:]) if fp8 else (None, refs[4:])
    bt_ref, lens_ref, cu_ref, sched_ref, o_ref, lse_ref, *refs = refs
    out_ref, lse_out_ref, scratch_refs = (*refs[:2], refs[2:]) if direct else (None, None, refs)
    r = dict(zip(names, scratch_refs))
    q_smem, ring_lat, ring_rope, pbuf, stats = (r[k] for k in ("q_smem", "ring_lat", "ring_rope", "pbuf", "stats"))
    loaded_a, loaded_b, qbar, lbar = r["loaded_a"], r["loaded_b"], r["qbar"], r["lbar"]
    consumed_a0, consumed_a1, consumed_b0, consumed_b1 = (
        r[k] for k in ("consumed_a0", "consumed_a1", "consumed_b0", "consumed_b1"))
    consumed = {("a", 0): consumed_a0, ("a", 1): consumed_a1, ("b", 0): consumed_b0, ("b", 1): consumed_b1}
    m0bar, m1bar, p0bar, p1bar = r["m0bar"], r["m1bar"], r["p0bar"], r["p1bar"]
    own_p, qr_smem = r.get("own_p"), r.get("qr_smem")
    wg = lax.axis_index("wg")
    part = lax.axis_index("part")
    grp = lax.axis_index("g")
    b_first, b_last, seq_pages = share_of_part(sched_ref, cu_ref, part)   # split_kv.schedule_kernel's share

    # (what, slot) -> the barrier of the part's first column tile (tile_release)
    tile_loaded = {(n[0], int(n[1])): r[f"loaded_{n}_tile"] for n in plan.tile_release}

    # -------- warpgroup 2: the producer. Pair i of a segment: page lo + 2i -> slot 0, lo + 2i + 1 -> slot 1. ----
    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(plan.producer_registers, action="decrease")

      def load(b, j, slot, what, used, pg=None):
        """Part `what` of page j of sequence b (pool page pg when it was read ahead) into ring slot `slot`, once its
        readers of the previous pair are done (used: pairs that used the slot before)."""
        if pg is None:
          pg = jnp.clip(bt_ref[b, j], 0, num_pages - 1)     # a bad entry cannot fault (the api NaNs that row)
        loaded = (loaded_b if what == "b" else loaded_a).at[slot]
        if fp8:
          tiles = fp8_tiles(pg, 0 if what == "a" else 1)   # loads issued before the wait: latency under it

        @pl.when(used > 0)
        def _():
          plgpu.barrier_wait(consumed[what, slot])

        if what == "b":
          plgpu.copy_gmem_to_smem(rope_ref.at[pg], ring_rope.at[slot], loaded_b.at[slot])
        if not fp8:
          plgpu.copy_gmem_to_smem(lat_ref.at[pg, :, pl.ds(HALF if what == "b" else 0, HALF)],
                                  ring_lat.at[slot, 1 if what == "b" else 0], loaded)
          return
        # 0 (used >= 0), but not a constant to the compiler: the store addresses depend on the pair, so they are
        # computed in the loop instead of hoisted out of it and kept (spilled) in registers (NOTES.md)
        z = lax.shift_right_logical(used, 31)
        if (what, slot) in tile_loaded:
          # the first column tile released on its own barrier: the QK over this part starts on it
          n_valid, half = lens_ref[b] - j * PAGE, 0 if what == "a" else 1
          store_f16(tiles, slot + z, half, n_valid, col_tiles=(2 * half,))
          plgpu.commit_smem()
          plgpu.barrier_arrive(tile_loaded[what, slot])
          store_f16(tiles, slot + z, half, n_valid, col_tiles=(2 * half + 1,))
        else:       # (the length read in each branch: read once above the if, the measured PTX reorders)
          store_f16(tiles, slot + z, 0 if what == "a" else 1, lens_ref[b] - j * PAGE)
        plgpu.commit_smem()                 # the f16 tiles visible to the compute warpgroups' wgmmas
        plgpu.barrier_arrive(loaded)

      page_id = lambda b, j: page_ahead(bt_ref, b, j, num_pages)

      def prefetch(pg, j, hi):
        """Page pg (page j of a sequence with hi pages) into L2 by TMA: its latent rows and the fp8 scales, or
        (bf16) the rope. A hint: no barrier, nothing waits for it; interpret mode skips it."""
        @pl.when(j < hi)
        def _():
          for h in (0, 1):
            plgpu.async_prefetch(lat_ref.at[pg, :, pl.ds(h * HALF, HALF)])
          if fp8:
            plgpu.async_prefetch(sc_ref.at[pg])
          else:
            plgpu.async_prefetch(rope_ref.at[pg])   # (fp8: the rope's TMA has the part's conversion time to land)

      def fp8_tiles(pg, half):
        """The e4m3 tiles and scales of latent half `half` of page pg.
        The scales load with the tiles: loaded after the wait they were a second GMEM round trip in every part's
        chain (ncu, 14ec995: the sums of the scale selects stalled on them, ~7% of all warp samples)."""
        return load_fp8_part(lat_ref, sc_ref, pg, half)

      def store_f16(part, slot, half, n_valid, col_tiles=None):
        """The converted part into ring_lat[slot, half]."""
        def store(x, t, th):
          ring_lat[slot, half, pl.ds(th * TOK, TOK), pl.ds((t % 2) * FP8_TILE, FP8_TILE)] = x

        convert_fp8_part(part, half, n_valid, store, col_tiles=col_tiles)

      ahead = plan.l2_prefetch          # interpret mode: the table reads run, the prefetches are no-ops

      def seg(b, counts):
        lo, hi = seq_pages(b)
        # with l2_prefetch: the pool pages of the next `ahead` pairs, read from the table and prefetched before
        # they are loaded; a pair takes its own two from the front, so no load waits on a table read
        queue = tuple(page_id(b, lo + j) for j in range(2 * ahead))
        for j, pg in enumerate(queue):   # the segment's first pairs, before its first page is read
          prefetch(pg, lo + j, hi)

        def pair(i, carry):
          n0, n1, queue = carry            # pairs that used slot 0 / slot 1 so far; the pages read ahead
          j0 = lo + 2 * i
          has1 = j0 + 1 < hi
          pg0, pg1 = queue[:2] if ahead else (None, None)
          if ahead:
            # the table reads for the pages `ahead` pairs on go first; their prefetch waits until part A is
            # stored, so the reads' latency passes under that work
            jp = j0 + 2 * ahead
            new = (page_id(b, jp), page_id(b, jp + 1))
          # in the order the previous pair frees them: A0 ([0] mid-pair), B1 ([1] mid-pair), A1, B0 (pair ends);
          # b0_before_a1: B0 before A1; p0_first ([1] frees B0 mid-pair, B1 last): A0, B0, A1, B1
          load(b, j0, 0, "a", n0, pg0)
          if ahead:
            prefetch(new[0], jp, hi)
            prefetch(new[1], jp + 1, hi)
            queue = queue[2:] + new
          order = (("0b", "1a", "1b") if plan.p0_first else ("1b", "0b", "1a") if plan.b0_before_a1
                   else ("1b", "1a", "0b"))
          for which in order:
            if which == "0b":
              load(b, j0, 0, "b", n0, pg0)
            else:
              pl.when(has1)(functools.partial(load, b, j0 + 1, 1, which[1], n1, pg1))
          return n0 + 1, n1 + has1.astype(jnp.int32), queue

        n0, n1, _ = lax.fori_loop(0, (jnp.maximum(hi - lo, 0) + 1) // 2, pair, (*counts, queue))
        return n0, n1

      n0, n1 = lax.fori_loop(b_first, b_last + 1, seg, (jnp.int32(0), jnp.int32(0)))
      # observe the last releases too, so no barrier phase is left pending at exit
      for slot, n in ((0, n0), (1, n1)):
        @pl.when(n > 0)
        def _():
          for what in ("a", "b"):
            plgpu.barrier_wait(consumed[what, slot])

    # -------- warpgroups 0, 1 --------
    def compute(w: int):
      plgpu.set_max_registers(plan.compute_registers, action="increase")
      wgmma_layout = plgpu.Layout.WGMMA
      row_layout = wgmma_layout.reduce(1)
      row_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE), 0, layout=wgmma_layout)
      tok_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, PAGE), 1, layout=wgmma_layout)
      q_index = lax.div(grp * ROWS + row_iota, jnp.int32(heads))   # query token s of each row (r = s*H + h)
      rows_of = lambda v: lax.broadcast_in_dim(v, (ROWS, HALF), [0])
      safe = lambda m: jnp.where(m == -jnp.inf, 0.0, m)             # exp2(x - safe(m)): no -inf - -inf

      def zero_tail(slot, half, n_valid, z):
        # V rows past the length of a partial last page -> 0 in one half of a slot (they may hold NaN); with an
        # fp8 cache the producer's conversion already zeroed them
        if fp8:
          return

        @pl.when(n_valid < PAGE)
        def _():
          for c in range(HALF // CHUNK):
            x = ring_lat[slot + z, half, :, pl.ds(c * CHUNK, CHUNK)]
            rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=wgmma_layout)
            ring_lat[slot + z, half, :, pl.ds(c * CHUNK, CHUNK)] = jnp.where(rows < n_valid, x, jnp.zeros_like(x))
          plgpu.commit_smem()               # the zeros visible to the P.V wgmma

      def scores(slot, qr, z, j, limit):
        """S [64 rows, 64 tok] = Q . K^T of the page in `slot` (log2 domain, masked), each part waited for as it
        comes: warpgroup 0 (slot 0) reads part A first, warpgroup 1 (slot 1) part B first (the producer's order)."""
        def qk(s_ref):
          def latent(what):
            half, first_tile = (0 if what == "a" else 1), tile_loaded.get((what, slot))
            if first_tile is not None:
              plgpu.barrier_wait(first_tile)          # its first column tile (tile_release)
            for cc in range(HALF // CHUNK):
              if cc == (FP8_TILE // CHUNK if first_tile is not None else 0):
                plgpu.barrier_wait((loaded_b if half else loaded_a).at[slot])
              plgpu.wgmma(s_ref, q_smem.at[half + z, :, pl.ds(cc * CHUNK, CHUNK)],
                          ring_lat.at[slot + z, half, :, pl.ds(cc * CHUNK, CHUNK)].T)

          def part_a():
            latent("a")

          def part_b():
            latent("b")
            plgpu.wgmma(s_ref, qr if on_gpu else qr_smem.at[w + z], ring_rope.at[slot + z].T)

          for f in ((part_a, part_b) if slot == 0 or plan.p0_first else (part_b, part_a)):
            f()
          plgpu.wgmma_wait(0)
          return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE), jnp.float32)) * scale_log2
        return jnp.where(j * PAGE + tok_iota < limit, s, -jnp.inf)

      def pv(acc, p, v_ref, own: bool, wait: bool = True):
        """O (this warpgroup's half) += P [64, 64] . V [64 tok, 256]. own: P is this warpgroup's registers (the
        GPU's register A operand; interpret mode: own_p[w] in SMEM), else the other's pbuf. On the GPU acc is the
        segment's accumulator ref (returned as it is); in interpret mode acc is a value and the sum is returned.
        wait=False (GPU): the product is left in flight; the caller waits before it touches acc or frees V."""
        if on_gpu:
          plgpu.wgmma(acc, p, v_ref)
          if wait:
            plgpu.wgmma_wait(0)
          return acc
        if own:
          own_p[w] = p
          plgpu.commit_smem()
          p = own_p.at[w]

        def one(d_ref):
          plgpu.wgmma(d_ref, p, v_ref)
          plgpu.wgmma_wait(0)
          return d_ref[...]

        return acc + pl.run_scoped(one, plgpu.ACC((ROWS, HALF), jnp.float32))

      def rescale(acc, alpha):
        if on_gpu:
          acc[...] = acc[...] * rows_of(alpha)
          return acc
        return acc * rows_of(alpha)

      def seg(b, ctr):
        lo, hi = seq_pages(b)
        length = lens_ref[b]

        @pl.when(hi > lo)
        def _segment():
          # Q of (sequence b, row group grp): both warpgroups are done with the previous Q (lbar of the previous
          # segment, or nothing came before)
          bg = b * g_count + grp
          if tma_out:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last segment's output has left q_smem[w]
          start_q_latent(q_ref, bg, q_smem, qbar, w, fp8, HALF)
          # Q's rope [64, 64] bf16 straight from GMEM into the WGMMA layout, once a segment (16 registers)
          qr = plgpu.load(q_rope_of(qr_ref, bg), layout=wgmma_layout, optimized=False)
          if not on_gpu:
            qr_smem[w] = qr                 # this warpgroup's previous QKs are done with its copy
            plgpu.commit_smem()
          plgpu.barrier_wait(qbar)
          limit = (length - sq + 1 + q_index) if causal_rows else length

          def pair_step(acc_ref):
            """One pair of pages for this warpgroup; O in acc_ref (GPU) or in the carry (interpret mode)."""
            def pair(i, carry):
              m, l_mine = carry[:2]
              acc = acc_ref if on_gpu else carry[2]
              c = ctr + i                    # pairs of this warpgroup so far (>= 0)
              # 0 (c >= 0), but not a constant to the compiler: the operand addresses depend on the pair, so their
              # wgmma descriptors are rebuilt in the loop instead of kept (and spilled) in registers across it
              z = lax.shift_right_logical(c, 31)
              j0 = lo + 2 * i
              has1 = j0 + 1 < hi
              n0, n1 = length - j0 * PAGE, length - (j0 + 1) * PAGE    # valid tokens of each page
              if w == 0:
                s0 = scores(0, qr, z, j0, limit)
                plgpu.barrier_arrive(consumed_b0)                      # [0]'s reads of slot 0's part B are done
                m0 = jnp.maximum(m, s0.max(axis=1))
                stats[0] = m0
                plgpu.barrier_arrive(m0bar)
                m0s = safe(m0)
                alpha0 = jnp.exp2(m - m0s)
                p0 = jnp.exp2(s0 - lax.broadcast_in_dim(m0s, s0.shape, [0]))
                l_mine = l_mine * alpha0 + p0.sum(axis=1)
                zero_tail(0, 0, n0, z)
                acc = pv(rescale(acc, alpha0), p0.astype(dt), ring_lat.at[0 + z, 0], own=True, wait=not early_p0)
                if not early_p0:
                  plgpu.barrier_arrive(consumed_a0)                    # slot 0's part A is free
                plgpu.barrier_wait(m1bar)
                m1 = plgpu.load(stats.at[1], layout=row_layout, optimized=False)
                alpha1 = jnp.exp2(m0 - safe(m1))
                # P0 (f32, not the bf16 A operand of the product in flight) rescaled for warpgroup 1's P0 V0_R
                pbuf[0 + z] = (p0 * lax.broadcast_in_dim(alpha1, s0.shape, [0])).astype(dt)
                plgpu.commit_smem()
                plgpu.barrier_arrive(p0bar)
                if early_p0:
                  plgpu.wgmma_wait(0)                                  # P0 V0_L done: acc and part A free
                  plgpu.barrier_arrive(consumed_a0)
                l_mine = l_mine * alpha1
                acc = rescale(acc, alpha1)
                plgpu.barrier_wait(p1bar)

                def p1_v1l(acc):
                  plgpu.barrier_wait(loaded_a.at[1])
                  zero_tail(1, 0, n1, z)    # after [1]'s QK (p1bar)
                  acc = pv(acc, pbuf.at[1 + z], ring_lat.at[1 + z, 0], own=False)
                  plgpu.barrier_arrive(consumed_a1)
                  return acc
              else:
                def qk1():
                  s1 = scores(1, qr, z, j0 + 1, limit)
                  plgpu.barrier_arrive(consumed_a1)                    # [1]'s reads of slot 1's part A are done
                  return s1

                s1 = lax.cond(has1, qk1, lambda: plgpu.layout_cast(
                    jnp.full((ROWS, PAGE), -jnp.inf, jnp.float32), wgmma_layout))
                plgpu.barrier_wait(m0bar)
                m0 = plgpu.load(stats.at[0], layout=row_layout, optimized=False)
                m1 = jnp.maximum(m0, s1.max(axis=1))
                stats[1] = m1
                plgpu.barrier_arrive(m1bar)
                m1s = safe(m1)
                alpha = jnp.exp2(m - safe(m0)) * jnp.exp2(m0 - m1s)
                p1 = jnp.exp2(s1 - lax.broadcast_in_dim(m1s, s1.shape, [0]))   # all 0 without a K1
                l_mine = l_mine * alpha + p1.sum(axis=1)
                p1 = p1.astype(dt)
                pbuf[1 + z] = p1
                plgpu.commit_smem()
                plgpu.barrier_arrive(p1bar)
                acc = rescale(acc, alpha)

                def p1_v1r(acc):
                  zero_tail(1, 1, n1, z)
                  acc = pv(acc, p1, ring_lat.at[1 + z, 1], own=True)
                  plgpu.barrier_arrive(consumed_b1)
                  return acc

              def p0_v0r(acc):
                plgpu.barrier_wait(p0bar)
                plgpu.barrier_wait(loaded_b.at[0])
                zero_tail(0, 1, n0, z)      # after [0]'s QK (p0bar)
                acc = pv(acc, pbuf.at[0 + z], ring_lat.at[0 + z, 1], own=False)
                plgpu.barrier_arrive(consumed_b0)
                return acc

              if w == 1 and plan.p0_first:
                acc = p0_v0r(acc)
              p1_v = p1_v1l if w == 0 else p1_v1r                      # only where the pair has a K1
              if on_gpu:
                @pl.when(has1)
                def _():
                  p1_v(acc)
              else:
                acc = lax.cond(has1, p1_v, lambda a: a, acc)
              if w == 1 and not plan.p0_first:
                acc = p0_v0r(acc)
              return (m1, l_mine) if on_gpu else (m1, l_mine, acc)

            return pair

          def finish(acc, m, l_mine):
            # row sums of both warpgroups (both rescaled to the same running max)
            stats[2 + w] = l_mine
            plgpu.barrier_arrive(lbar)
            plgpu.barrier_wait(lbar)
            l_sum = l_mine + plgpu.load(stats.at[3 - w], layout=row_layout, optimized=False)
            seen = l_sum > 0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l_sum, 1.0), 0.0)

            def lse2():                           # log2 domain, -inf where no key
              return jnp.where(seen, m + jnp.log2(jnp.where(seen, l_sum, 1.0)), -jnp.inf)

            def partial():
              eg = (part + b) * g_count + grp     # partial entry (share + sequence) of this row group
              o_ref[eg, :, pl.ds(w * HALF, HALF)] = acc * rows_of(inv)
              if w == 0:
                lse_ref[eg] = lse2()

            def final():                          # the merge's output for this row group, written here
              o = (acc * rows_of(inv)).astype(jnp.bfloat16)
              if fp8:                             # out_ref holds the bf16 bits as f16 (q_smem's type)
                o = lax.bitcast_convert_type(o, jnp.float16)
              if tma_out:
                # through this warpgroup's Q half and a TMA store: stores straight from the registers put spill
                # loads into warpgroup 0's page loop (DIRECT_WRITE); every QK of the segment is done (lbar)
                q_smem[w] = o
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[w], out_ref.at[b, grp, :, pl.ds(w * HALF, HALF)])
              else:
                out_ref[b, grp, :, pl.ds(w * HALF, HALF)] = o
              if w == 0:
                # the merge's lse of one partial: its log2-domain lse (as partial() stores it) times ln 2
                lse_out_ref[b, grp] = jnp.where(seen, lse2() * LN2, jnp.inf)

            if not direct:
              partial()
              return
            whole = (lo == 0) & (hi == cu_ref[b + 1] - cu_ref[b])   # this share holds all of sequence b's pages
            pl.when(whole)(final)
            pl.when(jnp.logical_not(whole))(partial)

          n_pairs = (hi - lo + 1) // 2
          m_init = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
          l_init = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
          if on_gpu:
            def run(acc_ref):               # O's half, zero at the segment start
              m, l_mine = lax.fori_loop(0, n_pairs, pair_step(acc_ref), (m_init, l_init))
              finish(acc_ref[...], m, l_mine)

            pl.run_scoped(run, plgpu.ACC((ROWS, HALF), jnp.float32))
          else:
            acc0 = plgpu.layout_cast(jnp.zeros((ROWS, HALF), jnp.float32), wgmma_layout)
            m, l_mine, acc = lax.fori_loop(0, n_pairs, pair_step(None), (m_init, l_init, acc0))
            finish(acc, m, l_mine)

        return ctr + (jnp.maximum(hi - lo, 0) + 1) // 2

      lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))
      if tma_out:
        plgpu.wait_smem_to_gmem(0)

    for w in range(2):
      pl.when(wg == w)(functools.partial(compute, w))

  out_type = (jax.ShapeDtypeStruct((entries * g_count, ROWS, LATENT_DIM), jnp.float32),
              jax.ShapeDtypeStruct((entries * g_count, ROWS), jnp.float32))
  if direct:
    out_type += (jax.ShapeDtypeStruct((batch, g_count, ROWS, LATENT_DIM), dt),       # fp8: bf16 bits as f16
                 jax.ShapeDtypeStruct((batch, g_count, ROWS), jnp.float32))
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=list(scratch.values()), grid=(g_count, parts),
      grid_names=("g", "part"), num_threads=NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           reduction_scratch_bytes=0),
      interpret=interpret)
