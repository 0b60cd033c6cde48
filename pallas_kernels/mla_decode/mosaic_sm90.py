"""The `mosaic_sm90` backend: paged MLA decode for Hopper in Pallas Mosaic GPU (`plgpu.kernel`).

Shape of the work (the op of docs/architecture.md §3, FlashMLA semantics). Query rows are the (token, head) pairs
of one sequence, r = s * H + h, packed N rows per CTA (N <= 32, a power of two >= 8; more rows -> G head groups of
N). Every key page of 64 tokens is used in "swapped" orientation so that the 64 tokens fill the 64-row side of
wgmma and the few query rows are its N side (a 16-head decode then wastes no MMA work on padding):

    S^T [64 tok, N]  = K [64 tok, 576] . Q^T          (A = page tile in SMEM, K-major; B = Q, K-major)
    O^T [512, N]    += V^T [512, 64 tok] . P^T        (A = the same page tile, transposed; B = P [N, 64] in SMEM)

A CTA runs three warpgroups. Warpgroup 2 streams pages by TMA through the block table into a ring of
`num_stages` slots. Warpgroups 0 and 1 each own one half (256) of the 512 latent dims: each computes S^T over its
half (warpgroup 0 adds the 64 RoPE dims), they swap partial scores through SMEM, both run the same online softmax
(log2 domain, masked by select), and each accumulates its half of O^T in registers. With an fp8 cache each compute
warpgroup first dequantizes its half of the page (e4m3 -> f16, times the power-of-two tile scale: exact in f16)
into an f16 tile; Q's latent part is then f16 too and P is f16. fp8 -> bf16 is not available on this ptxas.
With `producer_dequant` (the default from 32 rows per CTA) the producer warpgroup loads the e4m3 page from GMEM and
converts it into a 2-slot f16 ring itself (the seesaw kernel's producer), and the compute warpgroups read f16 pages
as they read bf16 ones; `producers=2` adds a fourth warpgroup, and the two producers convert one latent half of each
page each. With two producers (fp8, 16 rows a CTA) the compute
warpgroups also take alternate pages, each whole, instead of both taking every page's halves (`alternate`), and the
producers load each page one page ahead (`lookahead`). With `register_dequant` (the default at 16 rows a CTA, fp8
h16) no f16 page exists: one TMA producer streams the e4m3 pages and each compute warpgroup converts its page
straight into the wgmma A registers of both products (sm90_fp8_operands.py), Q's latent dims and O's rows permuted
to match, and the compute warpgroups run one traced copy of their code (`shared_loop`); QK's operands stay unscaled,
one accumulator a scale tile, the tile scales applied to S (`scale_on_s`).

Split-KV: the whole batch's pages are cut into `num_parts` equal shares per head group (a device-side schedule
from seq_lens, so ragged batches keep every SM busy). Share p covering sequence b writes one partial (o, lse)
at entry p + b (unique: the (share, sequence) pairs form a staircase); `split_kv.merge_partials` merges
the partials of each sequence in one Pallas pass (`_combine` here is its plain-XLA reference). Pages and slots
past a sequence's length never enter a sum: the table entries are never read, tail slots are zeroed by select
before any product, scores past the length (or the causal limit) are masked to -inf by select.

Register budgets are set per warpgroup (producer 40, compute 232): the producer needs few, and with a uniform 168
the compute warpgroups (a [256, N] f32 accumulator, the [64, N] scores and row sums) took 1.36-1.43x as long on
the H200 (bench/HISTORY.md). What bounds this kernel, measured, and the designs that would lift it: NOTES.md here.

This module is the backend's dispatch too: with Sq * H a multiple of 64 (h64 / h128) the query rows fill wgmma M
and `choose_kernel` sends the call to a 64-row kernel instead, the seesaw kernel (mosaic_sm90_seesaw.py) for both
caches (the rows kernel, mosaic_sm90_rows.py, when asked for).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import gpu_interpret
from pallas_kernels.mla_decode import mosaic_sm90_rows, mosaic_sm90_seesaw, sm90_fp8_operands as fp8_ops
from pallas_kernels.mla_decode.cache import FP8_TILE, LATENT_DIM, ROPE_DIM, MLAKVCache
from pallas_kernels.mla_decode.sm90_shared import (COMPUTE_REGISTERS, CONVERT_TOKENS as TOK, SWZ16,
                                                    TMA_PRODUCER_REGISTERS, check_l2_prefetch, convert_fp8_part,
                                                    dequant_layout, load_fp8_part, page_ahead, produce_pages,
                                                    q_rope_of, reduce_rows, scale_layout, share_of_part)
from pallas_kernels.mla_decode.split_kv import (CUT_PAGES_DIRECT, SEGMENT_PAGES, SNAP_CANDIDATES, merge_partials,
                                                schedule_kernel)
from pallas_kernels.sm90_registers import check_register_split

PAGE = 64                     # tokens per page: the kernel is built around 64-token pages (FlashMLA's)
HALF = LATENT_DIM // 2        # latent dims owned by each compute warpgroup
CHUNK = 64                    # 64 16-bit elements = one 128-byte swizzle row
SMEM_LIMIT = 227 * 1024       # dynamic SMEM per block on the H100/H200
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_SWZ8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static launch configuration for one call shape."""
  rows: int            # Sq * H query rows per sequence
  n: int               # rows per CTA (wgmma N), multiple of 8, <= 32
  groups: int          # head groups G: n * G >= rows
  num_parts: int       # KV shares per head group (the split-KV width)
  num_stages: int      # page ring depth
  fp8: bool
  split_p: bool        # P.V as (P_hi + P_lo) . V in two bf16 MMAs (bf16 cache): f32-grade P instead of bf16's 2^-9
  # fp8 (opt-in): the producer warpgroup converts each page from GMEM into an f16 ring itself (the seesaw kernel's
  # producer), so the compute warpgroups' per-page chain loses its dequantization and the fp8 ring and the f16 page
  # give their SMEM to a second f16 slot; l2_prefetch: pages ahead it asks the TMA unit to bring into L2 (0: off)
  producer_dequant: bool = False
  l2_prefetch: int = 0
  # producer_dequant with 2: two producer warpgroups, each converting one latent half of every page (the first one
  # also issues the rope's TMA), so a page's conversion takes half the time; up to 16 rows a CTA (registers)
  producers: int = 1
  # producer_dequant, up to 16 rows a CTA: the two compute warpgroups take alternate pages of the f16 ring (each the
  # whole 576-wide QK and 512-wide P.V of its pages, with its own online softmax) instead of both taking every
  # page's two latent halves and swapping partial scores; warpgroup 1 hands its state to warpgroup 0 at the end of
  # each sequence's segment. Two pages are in flight in the compute warpgroups and no per-page exchange links them.
  # Needs the 2-slot ring (slot = warpgroup); register_dequant's default ring has 4 slots, w and w + 2 warpgroup w's.
  alternate: bool = False
  # producer_dequant: each producer loads the next page's e4m3 halves (into registers) before converting this
  # page's, so the GMEM / L2 latency of a page passes under the previous page's conversion instead of adding to it
  lookahead: bool = False
  # producer_dequant: (each producer, each compute warpgroup) registers a thread instead of
  # producer_dequant_registers' (tuning; make_plan checks the split against the launch's registers)
  register_split: tuple[int, int] | None = None
  # fp8, alternate, one TMA producer (opt-in): no f16 page at all; each compute warpgroup reads its page's e4m3
  # bytes from the TMA'd ring and converts them into the A registers of both products (sm90_fp8_operands.py),
  # with Q's latent dims and O's rows permuted to match
  register_dequant: bool = False
  # register_dequant: every shared-memory load of a product (QK: the page's four tiles; P.V: both halves) issued
  # before its first conversion, so their latency is paid once a product rather than once a tile
  loads_first: bool = False
  # alternate (make_plan: on with register_dequant): one traced copy of the compute warpgroups' code for all of them
  # (the warpgroup index at run time), their cross-warp reductions each in a scratch region of the kernel's own: the
  # instruction cache holds one page loop instead of one a warpgroup
  shared_loop: bool = False
  # register_dequant (make_plan: SCALE_ON_S): QK's A operands are the unscaled e4m3 values (exact in f16), each
  # 128-dim scale tile into an accumulator of its own, and S = rope + sum_t scale[:, t] acc_t in f32: one FMA an
  # S element a tile instead of one f16 multiply a converted pair
  scale_on_s: bool = False

  @property
  def smem_bytes(self) -> int:
    return _smem_bytes(self.n, self.num_stages, self.fp8, self.split_p, self.producer_dequant, self.alternate,
                       self.register_dequant)

  @property
  def num_warpgroups(self) -> int:
    return 2 + self.producers            # two compute warpgroups, then the producers

  @property
  def registers(self) -> tuple[int, int]:
    """(each producer, each compute warpgroup) registers a thread, with producer_dequant."""
    return self.register_split or producer_dequant_registers(self.n, self.producers, self.lookahead)


# registers a thread (producer, each compute warpgroup) with producer_dequant, by rows per CTA. Up to 16 rows the
# producer loads a whole page's e4m3 tiles and scales (~80 registers) before its wait; at 32 the compute
# warpgroups need more (O^T half [256, 32] f32 and the [64, 32] row sums), so the producer loads the page's second
# half after storing the first (ptxas, compile-only sm_90a, b128: 0 B of spills at h16; h32 212 / 216 B, against
# 436 / 484 for the swapped kernel without producer_dequant; h32 with the whole page ahead: 248-408 B at any split)
# With two producers (4 warpgroups: 512 threads, 128 registers each on average) each loads only its half page (~40
# registers) and the compute warpgroups at 16 rows hold O^T half [256, 16] f32 (32) and the [64, 16] scores and sums.
# With lookahead each of two producers holds two pages' halves (~80 registers): 112 / 144 (ptxas 72 / 120 B of
# spills; 96 / 160: 224 / 284).
def producer_dequant_registers(n: int, producers: int = 1, lookahead: bool = False) -> tuple[int, int]:
  if producers == 2 and lookahead:
    return (112, 144)
  if producers == 2:
    return (96, 160)
  return (120, 192) if n <= 16 else (88, 208)
MAX_L2_PREFETCH_PAGES = 8
# make_plan's defaults with an fp8 cache: producer_dequant from 32 rows per CTA, with 2 pages prefetched (jax 0.11.2,
# 51d1294, b128 L4096, CUPTI kernel. H100: h32 238.1 -> 191.1 us and h16 Sq 2 238.1 -> 194.7 with 4 pages ahead.
# H200: h32 231.2 -> 183.0 with 2 pages ahead (188.2 with 4), h16 Sq 2 182.4 with 2 (189.3 with 4), h20 233.7 ->
# 184.1 with 4). At 16 rows one producer gains nothing (H100 h16: 137.6 off, 139.1 / 149.3 with 2 / 4 ahead), two
# do (H100, 464ff60, b128 L4096, CUPTI kernel: h16 139.4 off -> 132.3 / 134.2 / 144.2 with 1 / 2 / 4 pages ahead,
# b32 L16384 139.6 -> 134.4), so 16 rows a CTA take two producers; 8 rows gain nothing from them (h8 122.6 / 122.8)
PRODUCER_DEQUANT_MIN_ROWS = 16
TWO_PRODUCERS_ROWS = 16
DEFAULT_L2_PREFETCH_PAGES = 2
# make_plan's alternate and lookahead defaults: both on where the CTA has two producers (16 rows). One H100, jax
# 0.11.2, fp8 h16 b128 L4096, CUPTI kernel µs: default 135.6 / 135.8 / 134.7 (three runs), alternate 135.1 / 134.5,
# lookahead 138.1, both 131.5 / 131.3; with every page L2-resident (the on-chip bound) 127.7, 122.0, 129.9 and
# 111.5 (NOTES.md: the producers' load latency bound it, which lookahead hides only where alternate keeps two
# pages in flight)
ALTERNATE = True
# register_dequant's defaults: a 4-slot ring (two slots a compute warpgroup) with no L2 prefetch. One H100, jax
# 0.11.2, fp8 h16 b128 L4096, CUPTI kernel µs (0f2cf18, NOTES.md): 2 slots with 0 / 1 / 2 / 4 pages prefetched
# 141.5 / 136.4 / 151.4 / 200.1; 4 slots 130.5 / 136.4 / 144.3 (prefetch 0 / 1 / 2), 106.1 with every page
# L2-resident; the default plan beside them 131.0 (110.4 L2-resident)
REGISTER_DEQUANT_STAGES = 4
REGISTER_DEQUANT_L2_PREFETCH_PAGES = 0
ALTERNATE_MAX_ROWS = 16
LOOKAHEAD = True
# make_plan's fp8 plan at REGISTER_DEQUANT_ROWS rows a CTA (None: never by default): register_dequant, with its
# compute warpgroups running one copy of their code (SHARED_LOOP, the default wherever register_dequant is on).
# One H100, jax 0.11.2, 49f45c2, fp8 h16 b128 L4096 page 64, CUPTI kernel µs against the converting producers' plan
# in the same runs (three): 125.8-126.9 vs 126.3-127.3, ragged [1, 2L] 143.2 vs 144.4-144.5, b32 L16384 129.3-131.0
# vs 130.1-130.4, every page L2-resident (the on-chip bound) 93.8-94.8 vs 110.4-110.8 (NOTES.md)
REGISTER_DEQUANT_ROWS = 16
SHARED_LOOP = True
# register_dequant's QK scales applied to S (Plan.scale_on_s) by default. One H100, jax 0.11.2, 33c7bef, fp8 h16
# b128 L4096, CUPTI kernel µs, the same run: every page L2-resident 93.0 against 96.7, ragged [1, 2L] 146.3 against
# 148.3, HBM-bound 130.1 against 129.7, b32 L16384 134.2 against 133.6 (NOTES.md)
SCALE_ON_S = True


def _smem_bytes(n: int, stages: int, fp8: bool, split_p: bool = False, producer_dequant: bool = False,
                alternate: bool = False, register_dequant: bool = False) -> int:
  q = n * (LATENT_DIM + ROPE_DIM) * 2
  if fp8 and not producer_dequant:
    # the e4m3 ring; the f16 page the compute warpgroups convert into (none with register_dequant)
    ring = (stages * (PAGE * LATENT_DIM + PAGE * ROPE_DIM * 2 + PAGE * 4 * 4)
            + (0 if register_dequant else PAGE * LATENT_DIM * 2))
  else:
    ring = stages * (PAGE * LATENT_DIM * 2 + PAGE * ROPE_DIM * 2)
  # score swap; alternate: a handing warpgroup's max and sums (register_dequant: both in one [64, n] array)
  exchange = (1 if register_dequant else 2) * PAGE * n * 4
  p = 2 * n * PAGE * 2 * (2 if split_p else 1)
  # alternate: the handed-over O^T, and a reduction scratch region for warpgroup 1 (each warpgroup reduces its own
  # values)
  extra = LATENT_DIM * n * 4 + _reduction_scratch_bytes(n) if alternate else 0
  return q + ring + exchange + p + _reduction_scratch_bytes(n) + extra + 1024


def _reduction_scratch_bytes(n: int) -> int:
  """SMEM Mosaic needs to reduce a [64, n] f32 WGMMA-layout array over its 64 rows in ONE round.

  Mosaic's cross-warp reductions go through one scratch region shared by every warpgroup of the CTA, in rounds of
  as many registers as fit (4 warps x 32 lanes x 2 f32 = 1 KiB per register of 8 columns). The two compute
  warpgroups reduce the same (bit-identical) values at the same time, which is harmless only while each reduction
  is one round: with two rounds, one warpgroup's second round overwrites what the other still reads in its first.
  That was the fault of every >= 24-row CTA on the H200 (the default 2 KiB holds two registers = 16 columns).
  """
  return max(2048, (n // 8) * 1024)


def _num_sms() -> int:
  try:
    dev = jax.devices()[0]
    if dev.platform == "gpu":
      return int(dev.core_count)
  except Exception:  # noqa: BLE001 - no device info: fall back to a small split for interpret mode
    pass
  return 4


# Warpgroups per CTA: two compute, one TMA producer.
NUM_WARPGROUPS = 3

# Query rows (Sq*H packed) one CTA holds (wgmma N); more rows -> head groups in one launch (grid axis "g").
MAX_ROWS_PER_CTA = 32


def make_plan(rows: int, fp8: bool, *, num_parts: int | None = None, num_stages: int | None = None,
              rows_per_cta: int | None = None, split_p: bool | None = None, producer_dequant: bool | None = None,
              l2_prefetch: int | None = None, producers: int | None = None,
              alternate: bool | None = None, lookahead: bool | None = None,
              producer_registers: int | None = None, compute_registers: int | None = None,
              register_dequant: bool | None = None, loads_first: bool | None = None,
              shared_loop: bool | None = None, scale_on_s: bool | None = None) -> Plan:
  """Picks N, G, the split-KV width and the ring depth (deepest that fits SMEM, at most 4).

  split_p defaults to True for a bf16 cache. P rounded to bf16 (FlashMLA's choice) errs by up to 2^-9 sum p|v| / l
  per output element, which docs/architecture.md §3 admits only under a widened bound; the split keeps P at
  f32 grade and meets the plain bound, at one more MMA per P.V chunk. An fp8 cache computes P.V in f16 (2^-11).
  producer_dequant (fp8) defaults to on from PRODUCER_DEQUANT_MIN_ROWS rows per CTA where register_dequant is off,
  with l2_prefetch DEFAULT_L2_PREFETCH_PAGES and, at TWO_PRODUCERS_ROWS rows, two producers; l2_prefetch otherwise
  defaults to off.
  alternate and lookahead (None: on where the CTA has two producers, ALTERNATE / LOOKAHEAD) need producer_dequant;
  alternate also at most 16 rows a CTA and 2 ring slots (register_dequant: 4 by default, REGISTER_DEQUANT_STAGES).
  producer_registers / compute_registers (producer_dequant; None: producer_dequant_registers') set the register
  split, checked against what the CTA launches with.
  register_dequant (fp8, at most 16 rows a CTA): alternate pages with no f16 page (Plan.register_dequant; None: on
  at REGISTER_DEQUANT_ROWS rows a CTA unless num_stages or an option of the converting producers' plan is given);
  it excludes producer_dequant and its options; loads_first (Plan.loads_first) needs it. shared_loop
  (Plan.shared_loop; None: SHARED_LOOP with register_dequant, else off) needs alternate. scale_on_s
  (Plan.scale_on_s; None: SCALE_ON_S with register_dequant) needs register_dequant.
  """
  max_n = rows_per_cta or MAX_ROWS_PER_CTA
  if max_n % 8 or not 8 <= max_n <= 32:
    raise ValueError(f"rows_per_cta must be a multiple of 8 in [8, 32], got {max_n}")
  groups = -(-rows // max_n)
  n = max(8, 1 << (-(-rows // groups) - 1).bit_length())   # a power of two (the merge kernel's Triton blocks)
  if register_dequant is None:
    # auto: on where it is the default (fp8, REGISTER_DEQUANT_ROWS rows a CTA) unless an option of the converting
    # producers' plan asks for that plan
    producer_options = (producer_dequant, producers, lookahead, alternate, producer_registers, compute_registers)
    register_dequant = (fp8 and n == REGISTER_DEQUANT_ROWS and num_stages is None
                        and all(o is None for o in producer_options))
  register_dequant = bool(register_dequant)
  if shared_loop is None:
    shared_loop = SHARED_LOOP and register_dequant
  loads_first = bool(loads_first)
  scale_on_s = (SCALE_ON_S and register_dequant) if scale_on_s is None else bool(scale_on_s)
  if scale_on_s and not register_dequant:
    raise ValueError("mosaic_sm90: scale_on_s applies register_dequant's QK scales to S; pass register_dequant=True")
  if loads_first and not register_dequant:
    raise ValueError("mosaic_sm90: loads_first orders register_dequant's shared-memory loads; pass "
                     "register_dequant=True")
  if register_dequant:
    if not fp8:
      raise ValueError("mosaic_sm90: register_dequant converts an fp8 cache's pages in the compute warpgroups; "
                       "it needs an fp8_e4m3 cache")
    if producer_dequant or producers not in (None, 1) or lookahead or producer_registers \
        or compute_registers or alternate is False:
      raise ValueError("mosaic_sm90: register_dequant has one TMA producer and no f16 page: producer_dequant, "
                       "producers, lookahead and the producers' register split do not apply, and it always takes "
                       "alternate pages")
    if num_stages not in (None, 2, 4):
      raise ValueError(f"mosaic_sm90: register_dequant gives each of its 2 compute warpgroups one slot of a 2-slot "
                       f"ring or two of a 4-slot ring; got num_stages={num_stages}")
    if num_stages is None:
      num_stages = REGISTER_DEQUANT_STAGES
    producer_dequant, producers, lookahead = False, 1, False
    # its TMA producer may ask pages ahead into L2
    l2_prefetch = REGISTER_DEQUANT_L2_PREFETCH_PAGES if l2_prefetch is None else l2_prefetch
  split_p = (not fp8) if split_p is None else bool(split_p)
  if split_p and fp8:
    raise ValueError("split_p applies to a bf16 cache only (an fp8 cache already computes P.V in f16)")
  if producer_dequant and not fp8:
    raise ValueError("producer_dequant applies to an fp8 cache only (a bf16 page has nothing to convert)")
  if producer_dequant is None:
    producer_dequant = fp8 and n >= PRODUCER_DEQUANT_MIN_ROWS
  producer_dequant = bool(producer_dequant)
  if l2_prefetch is None:
    l2_prefetch = DEFAULT_L2_PREFETCH_PAGES if producer_dequant else 0
  l2_prefetch = check_l2_prefetch(l2_prefetch, MAX_L2_PREFETCH_PAGES, "pages")
  if l2_prefetch and not (producer_dequant or register_dequant):
    raise ValueError("mosaic_sm90: the swapped kernel's l2_prefetch needs producer_dequant or register_dequant "
                     "(its TMA producer otherwise streams pages ahead through a deeper ring)")
  if producers is None:
    producers = 2 if producer_dequant and n == TWO_PRODUCERS_ROWS else 1
  if producers not in (1, 2) or isinstance(producers, bool):
    raise ValueError(f"mosaic_sm90: producers must be 1 or 2, got {producers!r}")
  if producers > 1 and not (producer_dequant and n <= 16):
    raise ValueError(f"mosaic_sm90: producers={producers} splits producer_dequant's page conversion between "
                     f"{producers} warpgroups; it needs producer_dequant (fp8) and at most 16 rows a CTA "
                     f"(registers), got producer_dequant={producer_dequant} with {n} rows a CTA")
  if lookahead is None:
    lookahead = LOOKAHEAD and producer_dequant and producers >= 2
  lookahead = bool(lookahead)
  if lookahead and not producer_dequant:
    raise ValueError("mosaic_sm90: lookahead is the converting producer's (producer_dequant, fp8 cache)")
  if alternate is None:
    alternate = register_dequant or (ALTERNATE and producer_dequant and producers >= 2 and n <= ALTERNATE_MAX_ROWS
                                     and num_stages in (None, 2))
  alternate = bool(alternate)
  if register_dequant and n > ALTERNATE_MAX_ROWS:
    raise ValueError(f"mosaic_sm90: register_dequant takes alternate pages, at most {ALTERNATE_MAX_ROWS} rows a CTA "
                     f"(a whole [512, N] f32 accumulator a warpgroup), got {n}; pass rows_per_cta=16")
  if alternate and not ((producer_dequant or register_dequant) and n <= ALTERNATE_MAX_ROWS):
    raise ValueError(f"mosaic_sm90: alternate (the compute warpgroups take alternate pages of the f16 ring) needs "
                     f"producer_dequant (fp8) and at most {ALTERNATE_MAX_ROWS} rows a CTA (a whole [512, N] f32 "
                     f"accumulator a warpgroup), got producer_dequant={producer_dequant} with {n} rows a CTA")
  if alternate and num_stages not in (None, 2) and not register_dequant:
    raise ValueError(f"mosaic_sm90: alternate gives each compute warpgroup one slot of a 2-slot ring; got "
                     f"num_stages={num_stages}")
  if num_parts is None:
    num_parts = max(1, _num_sms() // groups)
  fits = lambda stages: _smem_bytes(n, stages, fp8, split_p, producer_dequant, alternate,
                                    register_dequant) <= SMEM_LIMIT
  if num_stages is None:
    num_stages = 2 if alternate else max((s for s in range(1, 5) if fits(s)), default=0)
  if num_stages < 1 or not fits(num_stages):
    need = _smem_bytes(n, max(num_stages, 1), fp8, split_p, producer_dequant, alternate, register_dequant)
    raise ValueError(f"mosaic_sm90: {num_stages} page stages with {n} rows per CTA need {need} bytes of SMEM, over "
                     f"{SMEM_LIMIT}")
  register_split = None
  if producer_registers is not None or compute_registers is not None:
    if not producer_dequant:
      raise ValueError("mosaic_sm90: producer_registers / compute_registers split the registers of the swapped "
                       "kernel's converting producers (producer_dequant, fp8 cache); without it the split is fixed")
    derived = producer_dequant_registers(n, producers, lookahead)
    register_split = (int(producer_registers or derived[0]), int(compute_registers or derived[1]))
  plan = Plan(rows=rows, n=n, groups=groups, num_parts=int(num_parts), num_stages=int(num_stages), fp8=fp8,
              split_p=split_p, producer_dequant=producer_dequant, l2_prefetch=l2_prefetch,
              producers=producers, alternate=alternate, lookahead=lookahead, register_split=register_split,
              register_dequant=register_dequant, loads_first=loads_first, shared_loop=bool(shared_loop),
              scale_on_s=scale_on_s)
  if plan.shared_loop and not plan.alternate:
    raise ValueError("mosaic_sm90: shared_loop runs the compute warpgroups of alternate pages from one copy of "
                     "their code; it needs alternate (producer_dequant at 16 rows a CTA, or register_dequant)")
  if producer_dequant:
    producer, compute = plan.registers
    check_register_split([producer] * producers + [compute] * 2,
                         f"mosaic_sm90 swapped kernel ({producers} converting producers, 2 compute warpgroups)")
  return plan


# ---- split-KV schedule and merge in plain XLA: the references of split_kv's kernels (tests) --------------
def share_pages(cu: jax.Array, num_parts: int, cut_pages: int = 0) -> jax.Array:
  """Pages per split-KV share (>= 1) for page prefix sums cu [B+1]: share p covers [p, p + 1) * this.

  The payload is the one of base, base + 1, ..., base + SNAP_CANDIDATES - 1 (base = ceil(total / num_parts), the
  smallest that covers the batch) with the lowest modelled time of a share, `payload + (SEGMENT_PAGES * segments
  + cut_pages * cuts) / shares` (the first of equals): every (share, sequence) segment costs its CTA a Q load, a
  prologue, a partial write and a merge entry, about SEGMENT_PAGES pages' work. At batch 64 and 64 pages a
  sequence the base is 63 and cuts almost every sequence in two; 64 gives one sequence a share (fp8 h128 b64 on an
  H200: 211.9 -> 204.4 µs, NOTES.md). cuts = segments - sequences with pages: where the kernel writes the output
  of a sequence a share holds whole (split_kv.CUT_PAGES_DIRECT), each cut sequence costs a merge on top. Integer
  arithmetic, compared by cross-multiplication, so split_kv.schedule_kernel gets the same."""
  total = cu[-1]
  cand = jnp.maximum(1, (total + num_parts - 1) // num_parts) + jnp.arange(SNAP_CANDIDATES, dtype=cu.dtype)
  first, last = cu[:-1, None] // cand, (cu[1:, None] - 1) // cand                 # [B, candidates]
  nonempty = cu[1:] > cu[:-1]
  segments = jnp.sum(jnp.where(nonempty[:, None], last - first + 1, 0), axis=0)
  shares = jnp.maximum(1, (total + cand - 1) // cand)
  cuts = segments - jnp.sum(nonempty.astype(cu.dtype))
  nums = cand * shares + SEGMENT_PAGES * segments + cut_pages * cuts   # a share's modelled time x shares
  best = 0
  for i in range(1, SNAP_CANDIDATES):                            # the first candidate of the lowest time
    best = jnp.where(nums[i] * shares[best] < nums[best] * shares[i], i, best)
  return cand[best]


def schedule(page_counts: jax.Array, num_parts: int, cut_pages: int = 0) -> tuple[jax.Array, jax.Array]:
  """Cuts the batch's pages (in sequence order) into num_parts equal contiguous shares.

  Returns cu int32 [B+1] (page prefix sums) and sched int32 [num_parts, 4] = (begin, end, b_first, b_last):
  share p covers flat pages [begin, end) and sequences b_first..b_last (b_last < b_first when empty).
  """
  b = page_counts.shape[0]
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(page_counts, dtype=jnp.int32)])
  total = cu[b]
  payload = share_pages(cu, num_parts, cut_pages)
  p = jnp.arange(num_parts, dtype=jnp.int32)
  begin = jnp.minimum(p * payload, total)
  end = jnp.minimum(begin + payload, total)
  # sequence holding flat page f: the last b with cu[b] <= f (zero-page sequences never match)
  # compare_all: one fused compare-and-count (the default 'scan' method is a loop of tiny kernels)
  find = functools.partial(jnp.searchsorted, side="right", method="compare_all")
  b_first = jnp.clip(find(cu, begin).astype(jnp.int32) - 1, 0, b - 1)
  b_last = jnp.clip(find(cu, end - 1).astype(jnp.int32) - 1, 0, b - 1)
  b_last = jnp.where(end > begin, b_last, b_first - 1)
  return cu, jnp.stack([begin, end, b_first, b_last], axis=-1).astype(jnp.int32)


def _combine(o_part, lse2_part, sched, batch: int):
  """Merges the partials: o_part f32 [E, G, 512, N] (normalized), lse2_part f32 [E, G, N] (log2 domain).

  Returns out f32 [B, G, 512, N] and lse f32 [B, G, N] (natural log; +inf where a row saw no key).
  """
  e_total = o_part.shape[0]
  num_parts = sched.shape[0]
  begin, end, b_first, b_last = (sched[:, i] for i in range(4))
  p = jnp.arange(num_parts, dtype=jnp.int32)
  start = jnp.where(end > begin, p + b_first, e_total)            # first entry of each share (empty ones last)
  e = jnp.arange(e_total, dtype=jnp.int32)
  part_of_e = jnp.searchsorted(start, e, side="right", method="compare_all").astype(jnp.int32) - 1
  pe = jnp.clip(part_of_e, 0, num_parts - 1)
  b_of_e = e - pe
  valid = (part_of_e >= 0) & (b_of_e <= b_last[pe]) & (end[pe] > begin[pe])
  seg = jnp.where(valid, b_of_e, batch)
  lse2 = jnp.where(valid[:, None, None], lse2_part, -jnp.inf)
  m = jax.ops.segment_max(lse2, seg, num_segments=batch + 1, indices_are_sorted=True)   # [B+1, G, N]
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp2(lse2 - m_safe[seg])                                   # 0 for invalid entries / empty rows
  den = jax.ops.segment_sum(w, seg, num_segments=batch + 1, indices_are_sorted=True)
  o = jnp.where(valid[:, None, None, None], o_part, 0.0) * w[:, :, None, :]
  num = jax.ops.segment_sum(o, seg, num_segments=batch + 1, indices_are_sorted=True)
  den, num, m = den[:batch], num[:batch], m[:batch]
  seen = den > 0
  out = num / jnp.where(seen, den, 1.0)[:, :, None, :]
  lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, den, 1.0))) * LN2, jnp.inf)
  return out, lse


# ---- the kernel ------------------------------------------------------------------------------------------
def _build_call(plan: Plan, *, batch: int, sq: int, heads: int, causal: bool, softmax_scale: float,
                num_pages: int, interpret: bool):
  n, g_count, parts, stages, fp8 = plan.n, plan.groups, plan.num_parts, plan.num_stages, plan.fp8
  pd = fp8 and plan.producer_dequant             # the producer converts: an f16 ring, no fp8 slot, no kbuf
  rd = plan.register_dequant                      # the compute warpgroups convert into registers: no kbuf
  producers = plan.producers                      # warpgroups 0, 1 compute; the producers follow
  entries = parts + batch
  dt = jnp.float16 if fp8 else jnp.bfloat16        # dtype of the latent MMAs (Q nope, K/V tile, P)
  scale_log2 = float(softmax_scale) * LOG2E
  causal_rows = bool(causal) and sq > 1

  # SMEM scratch, by name (the kernel receives them in this order after the operands)
  scratch = dict(
      qn_smem=plgpu.SMEM((2, n, HALF), dt, transforms=SWZ16),                     # Q latent, by half
      qr_smem=plgpu.SMEM((n, ROPE_DIM), jnp.bfloat16, transforms=SWZ16))          # Q rope
  if fp8 and not pd:
    scratch.update(
        ring_lat=plgpu.SMEM((stages, 2, PAGE, HALF), jnp.float8_e4m3fn, transforms=_SWZ8),
        ring_rope=plgpu.SMEM((stages, PAGE, ROPE_DIM), jnp.bfloat16, transforms=SWZ16),
        ring_sc=plgpu.SMEM((stages, PAGE, 4), jnp.float32))
    if not rd:
      # the f16 page: each compute warpgroup dequantizes its half
      scratch.update(kbuf=plgpu.SMEM((2, PAGE, HALF), jnp.float16, transforms=SWZ16))
    elif interpret:
      # interpret mode has no A operand in registers: each compute warpgroup's converted operand goes through SMEM
      scratch.update(a_smem=plgpu.SMEM((2, PAGE, CHUNK), jnp.float16, transforms=SWZ16))
  else:
    scratch.update(
        ring_lat=plgpu.SMEM((stages, 2, PAGE, HALF), dt, transforms=SWZ16),
        ring_rope=plgpu.SMEM((stages, PAGE, ROPE_DIM), jnp.bfloat16, transforms=SWZ16))
  scratch.update(
      # score swap; alternate: a handing warpgroup's row maxima and sums at a segment's end (broadcast over 64 rows;
      # register_dequant: the maxima in rows 0-31 of one array, the sums in rows 32-63)
      sx=plgpu.SMEM((1 if rd else 2, PAGE, n), jnp.float32),
      pbuf=plgpu.SMEM((2, 2 if plan.split_p else 1, n, PAGE), dt, transforms=SWZ16),    # P [wg, hi|lo]
      # a page landed: its TMA copies (latent halves, rope, fp8 scales), or (producer_dequant) the producer's
      # converted stores and the rope's TMA
      loaded=plgpu.Barrier(num_arrivals=1 + producers if pd else 4 if fp8 else 3, num_barriers=stages),
      # ring slot free again (alternate: released by the one warpgroup that read it)
      consumed=plgpu.Barrier(num_arrivals=1 if plan.alternate else 2, num_barriers=stages))
  if plan.alternate:
    if plan.shared_loop:
      # each compute warpgroup's cross-warp reductions, all of them (the kernel reserves no Mosaic scratch)
      scratch.update(red=plgpu.SMEM((2, _reduction_scratch_bytes(n) // 4), jnp.float32))
    scratch.update(
        obuf=plgpu.SMEM((LATENT_DIM, n), jnp.float32),                             # warpgroup 1's O^T
        handed=plgpu.Barrier(num_arrivals=1),                                      # its state written
        taken=plgpu.Barrier(num_arrivals=1))                                       # ... and read by warpgroup 0
  else:
    scratch.update(
        xbar=plgpu.Barrier(num_arrivals=2),                                        # scores written
        xread=plgpu.Barrier(num_arrivals=2),                                       # scores read
        lsync=plgpu.Barrier(num_arrivals=2))                                       # see the final row sums
  scratch.update(qbar=plgpu.Barrier(num_arrivals=1, num_barriers=3))               # Q halves + rope landed
  names = list(scratch)

  def body(*refs):
    n_io = 11 if fp8 else 10                     # operands + the two outputs, then the scratch
    if fp8:
      qn_ref, qr_ref, lat_ref, rope_ref, sc_ref, bt_ref, lens_ref, cu_ref, sched_ref, o_ref, lse_ref = refs[:11]
    else:
      qn_ref, qr_ref, lat_ref, rope_ref, bt_ref, lens_ref, cu_ref, sched_ref, o_ref, lse_ref = refs[:10]
      sc_ref = None
    r = dict(zip(names, refs[n_io:]))
    qn_smem, qr_smem, ring_lat, ring_rope, sx, pbuf = (r[k] for k in
                                                       ("qn_smem", "qr_smem", "ring_lat", "ring_rope", "sx", "pbuf"))
    ring_sc, kbuf = r.get("ring_sc"), r.get("kbuf")
    loaded, consumed, qbar = r["loaded"], r["consumed"], r["qbar"]
    xbar, xread, lsync = r.get("xbar"), r.get("xread"), r.get("lsync")
    obuf, handed, taken = r.get("obuf"), r.get("handed"), r.get("taken")        # alternate
    wg = lax.axis_index("wg")
    part = lax.axis_index("part")
    grp = lax.axis_index("g")
    b_first, b_last, seq_pages = share_of_part(sched_ref, cu_ref, part)   # split_kv.schedule_kernel's share

    def dequant(slot, w, n_valid):
      """Warpgroup w's half of the page: fp8 [64, 128] tiles t = 2w, 2w+1 of the ring slot -> f16 * scale[:, t]
      into kbuf[w] (exact: power-of-two scales); on a partial last page the rows past the length -> 0 by select
      (they may hold NaN), full pages skip the select."""
      sc_all = plgpu.load(ring_sc.at[slot], layout=scale_layout(), optimized=False)
      col4 = plgpu.broadcasted_iota(jnp.int32, (PAGE, 4), 1, layout=scale_layout())

      def convert(masked: bool):
        if masked:
          row4 = plgpu.broadcasted_iota(jnp.int32, (PAGE, 4), 0, layout=scale_layout())
          ok = (row4 < n_valid).astype(jnp.float32)
        for t in (2 * w, 2 * w + 1):
          s_t = jnp.where(col4 == t, sc_all, 0.0).sum(axis=1).astype(jnp.float16)
          x = plgpu.load(ring_lat.at[slot, t // 2, :, pl.ds((t % 2) * 128, 128)], layout=dequant_layout(),
                         optimized=True).astype(jnp.float16)
          x = x * lax.broadcast_in_dim(s_t, x.shape, [0])
          if masked:
            ok_t = jnp.where(col4 == t, ok, 0.0).sum(axis=1)
            x = jnp.where(lax.broadcast_in_dim(ok_t, x.shape, [0]) > 0, x, jnp.zeros_like(x))
          kbuf[w, :, pl.ds((t % 2) * 128, 128)] = x

      pl.when(n_valid >= PAGE)(lambda: convert(False))
      pl.when(n_valid < PAGE)(lambda: convert(True))

    def produce_converted_pages(mine: tuple[int, ...]):
      """producer_dequant: every page of the share, in order, into f16 ring slot c % stages: the e4m3 latent
      halves `mine` from GMEM (the first, or both, loaded before the slot's wait), converted and stored by this
      warpgroup; the rope by TMA (from the producer that owns half 0); with l2_prefetch, the pages that far ahead
      are read from the table (a queue in the loop carry, so no load waits on the table) and their halves `mine`
      brought into L2 by TMA."""
      plgpu.set_max_registers(plan.registers[0], action="decrease")
      ahead = plan.l2_prefetch
      lookahead = plan.lookahead
      whole_page_ahead = n <= 16              # see producer_dequant_registers
      rope_here = 0 in mine
      load = lambda pg, h: load_fp8_part(lat_ref, sc_ref, pg, h)

      page_id = lambda b, j: page_ahead(bt_ref, b, j, num_pages)

      def prefetch(pg, j, hi):
        @pl.when(j < hi)
        def _():
          for h in mine:
            plgpu.async_prefetch(lat_ref.at[pg, :, pl.ds(h * HALF, HALF)])
          if rope_here:
            plgpu.async_prefetch(sc_ref.at[pg])

      def seg(b, ctr):
        lo, hi = seq_pages(b)
        length = lens_ref[b]
        queue = tuple(page_id(b, lo + j) for j in range(ahead))
        for j, pg in enumerate(queue):
          prefetch(pg, lo + j, hi)

        def page(j, carry):
          c, queue, *held = carry
          slot = lax.rem(c, stages)
          pg = queue[0] if ahead else jnp.clip(bt_ref[b, j], 0, num_pages - 1)
          if ahead:
            new = page_id(b, j + ahead)
          if lookahead:
            # this page's halves were loaded during the previous page's conversion; the next page's now (the
            # page itself again past the segment's end: no table entry past the length is used)
            parts = dict(zip(mine, held[0]))
            nxt = queue[1] if ahead >= 2 else page_id(b, j + 1)
            nxt = jnp.where(j + 1 < hi, nxt, pg)
            held = [tuple(load(nxt, h) for h in mine)]
          else:
            # latency under the wait: the whole page, or its first half (the second after the first is stored)
            parts = {h: load(pg, h) for h in mine[:2 if whole_page_ahead else 1]}

          @pl.when(c >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])

          if rope_here:
            plgpu.copy_gmem_to_smem(rope_ref.at[pg], ring_rope.at[slot], loaded.at[slot])
          # (a run-time zero in the slot: the store addresses are computed in the loop, not hoisted and spilled)
          slot_z = slot + lax.shift_right_logical(c, 31)
          for h in mine:
            def store(x, t, th, h=h):
              ring_lat[slot_z, h, pl.ds(th * TOK, TOK), pl.ds((t % 2) * FP8_TILE, FP8_TILE)] = x
            if h not in parts:
              parts[h] = load(pg, h)
            convert_fp8_part(parts[h], h, length - j * PAGE, store)
          if ahead:
            prefetch(new, j + ahead, hi)
            queue = queue[1:] + (new,)
          plgpu.commit_smem()                 # the f16 page visible to the compute warpgroups' wgmmas
          plgpu.barrier_arrive(loaded.at[slot])
          return (c + 1, queue, *held)

        held = []
        if lookahead:                         # the segment's first page (any valid page if it has none)
          held = [tuple(load(page_id(b, lo), h) for h in mine)]
        return lax.fori_loop(lo, jnp.maximum(lo, hi), page, (ctr, queue, *held))[0]

      done = lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))
      for i in range(stages):                 # the last pages' releases, so no barrier phase is left pending
        @pl.when(done + i >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[lax.rem(done + i, stages)])

    # -------- warpgroup 2 (and 3 with two producers, each converting one latent half): the page producer --------
    def converted_halves(k: int):
      """The latent halves producer k converts."""
      return (0, 1) if producers == 1 else (k,)

    def producer():
      if pd:
        return produce_converted_pages(converted_halves(0))
      produce_pages(b_first=b_first, b_last=b_last, seq_pages=seq_pages, bt_ref=bt_ref, lat_ref=lat_ref,
                    rope_ref=rope_ref, sc_ref=sc_ref if fp8 else None, ring_lat=ring_lat, ring_rope=ring_rope,
                    ring_sc=ring_sc, loaded=loaded, consumed=consumed, stages=stages, num_pages=num_pages,
                    half=HALF, l2_prefetch=plan.l2_prefetch if rd else 0,
                    registers=TMA_PRODUCER_REGISTERS)

    # -------- warpgroups 0, 1: scores, softmax, P.V over one half of the latent dims --------
    def compute(w: int):
      plgpu.set_max_registers(plan.registers[1] if pd else COMPUTE_REGISTERS, action="increase")
      row_iota = plgpu.broadcasted_iota(jnp.int32, (PAGE, n), 0, layout=plgpu.Layout.WGMMA)
      col_iota = plgpu.broadcasted_iota(jnp.int32, (PAGE, n), 1, layout=plgpu.Layout.WGMMA)
      q_index = lax.div(grp * n + col_iota, jnp.int32(heads))   # query token s of each column (row = s*H+h)
      chunks = range(HALF // CHUNK)           # 64-wide chunks of this warpgroup's half

      def zero_tail(slot, n_valid):
        # bf16 cache: rows past the length of a partial last page -> 0 before any product
        @pl.when(n_valid < PAGE)
        def _():
          for c in chunks:
            x = ring_lat[slot, w, :, pl.ds(c * CHUNK, CHUNK)]
            rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
            ring_lat[slot, w, :, pl.ds(c * CHUNK, CHUNK)] = jnp.where(rows < n_valid, x, jnp.zeros_like(x))
          plgpu.commit_smem()

      def seg(b, ctr):
        lo, hi = seq_pages(b)
        length = lens_ref[b]

        @pl.when(hi > lo)
        def _segment():
          plgpu.commit_smem()                 # every thread is done with the previous Q before the TMA
          bg = b * g_count + grp              # (sequence, head group) row of q: a leading-dim TMA index
          plgpu.copy_gmem_to_smem(qn_ref.at[bg, :, pl.ds(w * HALF, HALF)], qn_smem.at[w], qbar.at[w])
          if w == 0:
            # rope: the last 64 columns of qr (q whole, or its rope part alone)
            plgpu.copy_gmem_to_smem(q_rope_of(qr_ref, bg), qr_smem, qbar.at[2])
          plgpu.barrier_wait(qbar.at[w])
          if w == 0:
            plgpu.barrier_wait(qbar.at[2])
          if causal_rows:
            limit = length - sq + 1 + q_index                   # keys [0, L - Sq + s] are visible
          else:
            limit = length

          def page(j, carry):
            acc, m_i, l_acc = carry
            c = ctr + (j - lo)
            slot = lax.rem(c, stages)
            n_valid = length - j * PAGE
            plgpu.barrier_wait(loaded.at[slot])
            release = consumed.at[slot]
            rope_tile = ring_rope.at[slot]
            if fp8 and not pd:
              dequant(slot, w, n_valid)
              plgpu.commit_smem()
              tile = kbuf.at[w]
            else:
              if not fp8:
                zero_tail(slot, n_valid)      # (producer_dequant: the producer zeroed them)
              tile = ring_lat.at[slot, w]

            def qk(acc_ref):
              for cc in chunks:
                plgpu.wgmma(acc_ref, tile.at[:, pl.ds(cc * CHUNK, CHUNK)],
                            qn_smem.at[w, :, pl.ds(cc * CHUNK, CHUNK)].T)
              if w == 0:
                plgpu.wgmma(acc_ref, rope_tile, qr_smem.T)
              plgpu.wgmma_wait(0)
              return acc_ref[...]

            s_mine = pl.run_scoped(qk, plgpu.ACC((PAGE, n), jnp.float32))
            if fp8 and not pd:
              plgpu.barrier_arrive(release)            # latent dequantized, rope read: slot free

            # swap partial scores with the other warpgroup (sx[w] is rewritten only after both read it)
            @pl.when(c > 0)
            def _():
              plgpu.barrier_wait(xread)

            sx[w] = s_mine
            plgpu.barrier_arrive(xbar)
            plgpu.barrier_wait(xbar)
            s_other = sx[1 - w]
            plgpu.barrier_arrive(xread)
            s = (s_mine + s_other) if w == 0 else (s_other + s_mine)   # identical bits in both warpgroups

            # online softmax over the 64 keys (axis 0) of each query row (axis 1), log2 domain
            s = s * scale_log2
            s = jnp.where(j * PAGE + row_iota < limit, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=0))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [1]))
            # row sums stay per thread ([64, N], no cross-warp reduction per page); reduced once per segment
            l_acc = l_acc * lax.broadcast_in_dim(alpha, l_acc.shape, [1]) + p
            p_hi = p.astype(dt)
            pbuf.at[w, 0].T[...] = p_hi
            if plan.split_p:
              pbuf.at[w, 1].T[...] = (p - p_hi.astype(jnp.float32)).astype(dt)
            plgpu.commit_smem()

            def pv(acc_ref):
              for i, cc in enumerate(chunks):
                for kk in range(2 if plan.split_p else 1):
                  plgpu.wgmma(acc_ref.at[pl.ds(i * CHUNK, CHUNK)], tile.at[:, pl.ds(cc * CHUNK, CHUNK)].T,
                              pbuf.at[w, kk].T)
              plgpu.wgmma_wait(0)
              return acc_ref[...]

            # this page's P.V in a fresh accumulator, folded in with the rescale as one FMA per element
            o_page = pl.run_scoped(pv, plgpu.ACC((HALF, n), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) + o_page
            if not fp8 or pd:
              plgpu.barrier_arrive(release)
            return acc, m_new, l_acc

          acc0 = plgpu.layout_cast(jnp.zeros((HALF, n), jnp.float32), plgpu.Layout.WGMMA)
          m0 = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
          l0 = plgpu.layout_cast(jnp.zeros((PAGE, n), jnp.float32), plgpu.Layout.WGMMA)
          acc, m_i, l_acc = lax.fori_loop(lo, hi, page, (acc0, m0, l0))
          # both warpgroups past the last page's max reduction before this sum reuses Mosaic's shared reduction
          # scratch (see _reduction_scratch_bytes)
          plgpu.barrier_arrive(lsync)
          plgpu.barrier_wait(lsync)
          l_i = l_acc.sum(axis=0)
          seen = l_i > 0
          inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
          eg = (part + b) * g_count + grp     # partial entry (share + sequence) of this head group
          o_ref[eg, pl.ds(w * HALF, HALF)] = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
          if w == 0:
            lse_ref[eg] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)

        return ctr + jnp.maximum(hi - lo, 0)

      done = lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))

      @pl.when(done > 0)
      def _():
        plgpu.barrier_wait(xread)            # the last swap's read-release, so no phase is left pending

    def compute_alternate(w):
      """Plan.alternate: warpgroup w takes the pages c of the CTA's walk with c % 2 == w (ring slot c % stages: w,
      or w and w + 2 in register_dequant's 4-slot ring), each whole:
      S^T over all 576 dims, its own online softmax, O^T [512, N] += V^T P^T. At the end of a segment warpgroup 1
      hands (max, row sums, O^T) to warpgroup 0 through SMEM; warpgroup 0 merges it with its own and writes the
      partial. Mosaic's cross-warp reductions (each page's max, the row sums) share one SMEM scratch region; the
      warpgroups reduce different values at unrelated times here, so warpgroup 1 runs inside a scoped allocation
      that moves its reductions to a region of its own. Plan.shared_loop: w is the run-time warpgroup index (one
      traced copy for both) and each warpgroup reduces through its own region of `red`."""
      plgpu.set_max_registers(COMPUTE_REGISTERS if rd else plan.registers[1], action="increase")

      def branch(cond, f):
        """f() where cond holds: a Python bool (w a trace-time constant) or a traced one (Plan.shared_loop)"""
        if isinstance(cond, bool):
          if cond:
            f()
        else:
          pl.when(cond)(f)

      def over_rows(op: str, x):
        """x [64, n] reduced over its rows ("max" / "add"): through this warpgroup's region of `red` with the
        shared loop on the GPU, else through Mosaic's scratch (this warpgroup's, by the scoped allocations)"""
        if plan.shared_loop and on_gpu:
          return reduce_rows(op, x, r["red"].at[w])
        return x.max(axis=0) if op == "max" else x.sum(axis=0)
      row_iota = plgpu.broadcasted_iota(jnp.int32, (PAGE, n), 0, layout=plgpu.Layout.WGMMA)
      col_iota = plgpu.broadcasted_iota(jnp.int32, (PAGE, n), 1, layout=plgpu.Layout.WGMMA)
      q_index = lax.div(grp * n + col_iota, jnp.int32(heads))   # query token s of each column (row = s*H+h)
      chunks = range(HALF // CHUNK)
      bcast = lambda v, shape: lax.broadcast_in_dim(v, shape, [1])
      safe = lambda m: jnp.where(m == -jnp.inf, 0.0, m)             # exp2(x - safe(m)): no -inf - -inf
      on_gpu = not interpret
      tok_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, PAGE), 1, layout=plgpu.Layout.WGMMA)

      def qk_raw(slot, t: int):
        """register_dequant: column tile t of the slot's page, e4m3, as the QK conversion reads it."""
        cols = pl.ds((t % 2) * FP8_TILE, FP8_TILE)
        if on_gpu:
          return plgpu.load(ring_lat.at[slot, t // 2, :, cols], layout=fp8_ops.QK_TILE_LAYOUT, optimized=True)
        return ring_lat[slot, t // 2, :, cols]

      def qk_operands(slot, t: int, raw):
        """register_dequant: the two [64 tok, 64] f16 A operands of column tile t of the slot's page (scale_on_s:
        unscaled)."""
        if on_gpu:
          return fp8_ops.qk_operands_gpu(t, not plan.scale_on_s)(raw, ring_sc.at[slot])
        scales = jnp.ones((PAGE,), jnp.float32) if plan.scale_on_s else ring_sc[slot][:, t]
        return fp8_ops.qk_operands_jnp(raw, scales)

      def pv_raw(slot, h: int):
        """register_dequant: latent half h of the slot's page, e4m3, as the P.V conversion reads it."""
        if on_gpu:
          return plgpu.load(ring_lat.at[slot, h], layout=fp8_ops.PV_HALF_LAYOUT, optimized=True)
        return ring_lat[slot, h]

      def pv_operands(slot, h: int, raw):
        """register_dequant: the four [64 dims, 64 tok] f16 A operands of latent half h of the slot's page."""
        if on_gpu:
          return fp8_ops.pv_operands_gpu(h)(raw, ring_sc.at[slot])
        return fp8_ops.pv_operands_jnp(raw, ring_sc[slot][:, 2 * h:2 * h + 2])

      def wgmma_a(acc_ref, a, b_ref):
        """wgmma with A from registers (interpret mode: through this warpgroup's SMEM slot). One such group stays in
        flight while the next operand is converted: the one before retires first, so its registers are free (with
        every group of a product in flight ptxas spilled 136 B; with two, it serialized the wgmmas: C7515)."""
        if on_gpu:
          plgpu.wgmma(acc_ref, a, b_ref)
          plgpu.wgmma_wait(1)
        else:
          r["a_smem"][w] = a
          plgpu.wgmma(acc_ref, r["a_smem"].at[w], b_ref)

      def seg(b, ctr):
        lo, hi = seq_pages(b)
        length = lens_ref[b]

        @pl.when(hi > lo)
        def _segment():
          bg = b * g_count + grp

          def load_q():
            # warpgroup 1 is past the previous segment's Q (its hand-over came after its last page)
            plgpu.commit_smem()
            for h in range(2):
              plgpu.copy_gmem_to_smem(qn_ref.at[bg, :, pl.ds(h * HALF, HALF)], qn_smem.at[h], qbar.at[h])
            plgpu.copy_gmem_to_smem(q_rope_of(qr_ref, bg), qr_smem, qbar.at[2])

          branch(w == 0, load_q)
          for h in range(3):
            plgpu.barrier_wait(qbar.at[h])
          limit = (length - sq + 1 + q_index) if causal_rows else length

          def page(i, carry):
            acc, m_i, l_acc = carry
            j = first + 2 * i
            # = w; with register_dequant's 4-slot ring w or w + 2 (each warpgroup waits for every phase of its
            # two slots' barriers)
            slot = lax.rem(ctr + (j - lo), stages)
            plgpu.barrier_wait(loaded.at[slot])

            # (Q's half index plus a run-time zero: its wgmma descriptors are built in the loop, not hoisted
            # out of it into 72 registers that spill)
            z = lax.shift_right_logical(j, 31)

            def qk(acc_ref, *tile_accs):
              # (scale_on_s: column tile t into tile_accs[t], the rope into acc_ref; else all into acc_ref)
              acc_of = lambda t: tile_accs[t] if tile_accs else acc_ref
              raws = {t: qk_raw(slot, t) for t in range(4)} if rd and plan.loads_first else {}
              for h in range(2):
                if rd:
                  for t in (2 * h, 2 * h + 1):   # column tile t of the page: its two chunks (Q permuted to match)
                    raw = raws[t] if t in raws else qk_raw(slot, t)
                    for cc, a in zip((2 * t, 2 * t + 1), qk_operands(slot, t, raw)):
                      wgmma_a(acc_of(t), a, qn_smem.at[h + z, :, pl.ds((cc % 4) * CHUNK, CHUNK)].T)
                  continue
                for cc in chunks:
                  plgpu.wgmma(acc_ref, ring_lat.at[slot, h, :, pl.ds(cc * CHUNK, CHUNK)],
                              qn_smem.at[h + z, :, pl.ds(cc * CHUNK, CHUNK)].T)
              plgpu.wgmma(acc_ref, ring_rope.at[slot], qr_smem.T)
              plgpu.wgmma_wait(0)
              return (acc_ref[...], *(a[...] for a in tile_accs)) if tile_accs else acc_ref[...]

            if plan.scale_on_s:
              rope_s, *tiles = pl.run_scoped(qk, *[plgpu.ACC((PAGE, n), jnp.float32)] * 5)
              scales = (fp8_ops.tile_scales_gpu(n)(ring_sc.at[slot]) if on_gpu else
                        [lax.broadcast_in_dim(ring_sc[slot][:, t], (PAGE, n), [0]) for t in range(4)])
              for t in range(4):
                rope_s = rope_s + tiles[t] * scales[t]
              s = rope_s * scale_log2
            else:
              s = pl.run_scoped(qk, plgpu.ACC((PAGE, n), jnp.float32)) * scale_log2
            s = jnp.where(j * PAGE + row_iota < limit, s, -jnp.inf)
            m_page = over_rows("max", s)
            m_new = jnp.maximum(m_i, m_page)
            m_use = safe(m_new)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s - bcast(m_use, s.shape))
            l_acc = l_acc * bcast(alpha, l_acc.shape) + p
            pbuf.at[w, 0].T[...] = p.astype(dt)
            plgpu.commit_smem()

            def pv(acc_ref):
              if rd:
                # O^T rows in sm90_fp8_operands.pv_rows order; tokens past the length (a partial last page) -> 0
                # by select in the operand (they may hold NaN): only that page pays the select
                def blocks(masked: bool):
                  raws = {h: pv_raw(slot, h) for h in range(2)} if plan.loads_first else {}
                  for h in range(2):
                    for b, a in enumerate(pv_operands(slot, h, raws[h] if h in raws else pv_raw(slot, h))):
                      if masked:
                        a = jnp.where(tok_iota < length - j * PAGE, a, jnp.zeros_like(a))
                      wgmma_a(acc_ref.at[pl.ds((4 * h + b) * CHUNK, CHUNK)], a, pbuf.at[w, 0].T)
                  plgpu.wgmma_wait(0)

                pl.when(length - j * PAGE >= PAGE)(lambda: blocks(False))
                pl.when(length - j * PAGE < PAGE)(lambda: blocks(True))
                return
              for h in range(2):
                for i2, cc in enumerate(chunks):
                  plgpu.wgmma(acc_ref.at[pl.ds((h * len(chunks) + i2) * CHUNK, CHUNK)],
                              ring_lat.at[slot, h, :, pl.ds(cc * CHUNK, CHUNK)].T, pbuf.at[w, 0].T)
              plgpu.wgmma_wait(0)

            if on_gpu:
              # onto the rescaled O in place (a second [512, N] accumulator would not fit the registers)
              acc = pl.run_state(pv)(plgpu.ACC.init(acc * bcast(alpha, acc.shape)))
            else:
              # interpret mode runs no preinitialized accumulator: a fresh one, added to the rescaled O
              o_page = pl.run_scoped(lambda r: (pv(r), r[...])[1], plgpu.ACC((LATENT_DIM, n), jnp.float32))
              acc = acc * bcast(alpha, acc.shape) + o_page
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_new, l_acc

          # this warpgroup's first page of the segment: page c of the walk (c = ctr + j - lo) with c % 2 == w
          first = lo + lax.rem(ctr + w, 2)
          count = jnp.maximum(hi - first + 1, 0) // 2
          acc0 = plgpu.layout_cast(jnp.zeros((LATENT_DIM, n), jnp.float32), plgpu.Layout.WGMMA)
          m0 = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
          l0 = plgpu.layout_cast(jnp.zeros((PAGE, n), jnp.float32), plgpu.Layout.WGMMA)
          acc, m_i, l_acc = lax.fori_loop(0, count, page, (acc0, m0, l0))
          l_i = over_rows("add", l_acc)

          def hand_over():
            # the buffers are free once warpgroup 0 read the previous segment's hand-over
            pl.when(ctr > 0)(lambda: plgpu.barrier_wait(taken))
            if rd:                                            # m in rows 0-31, l in rows 32-63
              sx[0] = jnp.where(row_iota < PAGE // 2, bcast(m_i, (PAGE, n)), bcast(l_i, (PAGE, n)))
            else:
              sx[0] = bcast(m_i, (PAGE, n))
              sx[1] = bcast(l_i, (PAGE, n))
            obuf[...] = acc
            plgpu.barrier_arrive(handed)

          def merge_and_write(acc, m_i, l_i):
            plgpu.barrier_wait(handed)
            if rd:
              both = plgpu.load(sx.at[0], layout=plgpu.Layout.WGMMA)
              m_k = over_rows("max", jnp.where(row_iota < PAGE // 2, both, -jnp.inf))
              l_k = over_rows("max", jnp.where(row_iota < PAGE // 2, -jnp.inf, both))
            else:
              m_k = over_rows("max", plgpu.load(sx.at[0], layout=plgpu.Layout.WGMMA))
              l_k = over_rows("max", plgpu.load(sx.at[1], layout=plgpu.Layout.WGMMA))
            m = jnp.maximum(m_i, m_k)
            m_use = jnp.where(m == -jnp.inf, 0.0, m)
            a_0, a_k = jnp.exp2(m_i - m_use), jnp.exp2(m_k - m_use)
            acc = (acc * bcast(a_0, acc.shape)
                   + plgpu.load(obuf, layout=plgpu.Layout.WGMMA) * bcast(a_k, acc.shape))
            plgpu.barrier_arrive(taken)
            l = a_0 * l_i + a_k * l_k
            seen = l > 0
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            eg = (part + b) * g_count + grp     # partial entry (share + sequence) of this head group
            o_ref[eg] = acc * bcast(inv, acc.shape)
            lse_ref[eg] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)

          branch(w > 0, hand_over)
          branch(w == 0, lambda: merge_and_write(acc, m_i, l_i))

        return ctr + jnp.maximum(hi - lo, 0)

      done = lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))
      # the last hand-over read: no phase left pending
      branch(w == 1, lambda: pl.when(done > 0)(lambda: plgpu.barrier_wait(taken)))

    if plan.shared_loop:
      # one copy of the compute warpgroups' code, the warpgroup index at run time
      pl.when(wg < 2)(lambda: compute_alternate(wg))
    elif plan.alternate:
      # warpgroup 1 first, inside a scoped SMEM allocation the size of the reduction scratch: its reductions then
      # use the region after the start, warpgroup 0's the region at the start. (A scoped SMEM allocation is made by
      # every warpgroup, behind a CTA-wide barrier at its entry, so the entry comes before any warpgroup waits on
      # another.)
      pl.run_scoped(lambda _: pl.when(wg == 1)(functools.partial(compute_alternate, 1)),
                    plgpu.SMEM((_reduction_scratch_bytes(n) // 4,), jnp.float32), collective_axes="wg")
    pl.when(wg == 2)(producer)
    for k in range(1, producers):
      pl.when(wg == 2 + k)(functools.partial(produce_converted_pages, converted_halves(k)))
    if not plan.alternate:
      for w in range(2):
        pl.when(wg == w)(functools.partial(compute, w))
    elif not plan.shared_loop:
      pl.when(wg == 0)(functools.partial(compute_alternate, 0))

  out_type = (jax.ShapeDtypeStruct((entries * g_count, LATENT_DIM, n), jnp.float32),
              jax.ShapeDtypeStruct((entries * g_count, n), jnp.float32))
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=list(scratch.values()), grid=(g_count, parts),
      grid_names=("g", "part"), num_threads=plan.num_warpgroups, thread_name="wg",
      # No automatic warpgroup barrier around SMEM stores: every SMEM hand-off here is already ordered by an
      # mbarrier (each thread arrives with release semantics) or by commit_smem, and the automatic barriers cost
      # 2 warpgroup syncs per store (they made the fp8 h16 kernel ~10% slower on the H200, bench/HISTORY.md).
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           # (the shared loop reduces through `red` alone)
                                           reduction_scratch_bytes=0 if plan.shared_loop
                                           else _reduction_scratch_bytes(n)),
      interpret=_interpret_params(interpret))


def _interpret_params(interpret):
  """interpret: False (compile for the GPU), True (GPU interpret mode on CPU) or an InterpretGPUParams."""
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  return plgpu.InterpretGPUParams() if interpret else False


KERNELS = ("auto", "swapped", "rows", "seesaw")
# the kernels with 64 query rows per CTA on wgmma M, by name
ROWS_KERNELS = {"rows": mosaic_sm90_rows, "seesaw": mosaic_sm90_seesaw}


def choose_kernel(rows: int, fp8: bool, kernel: str = "auto") -> str:
  """Which of the backend's three kernels runs: "swapped" (mosaic_sm90.py; tokens on wgmma M, <= 32 rows per CTA),
  "rows" (mosaic_sm90_rows.py; 64 query rows per CTA on wgmma M) or "seesaw" (mosaic_sm90_seesaw.py; 64 rows per
  CTA as rows, FlashMLA's staggered two-page schedule). "auto", when Sq * H is a multiple of 64 (h64 / h128
  decode: no padded rows): seesaw for both caches (H100, jax 0.11.2, b128 h128 L4096, CUPTI kernel: bf16 seesaw 287
  us vs rows 309; fp8 at 51d1294, seesaw with its default L2 prefetch 357.8 vs rows 376.0, b64 186.7 vs 190.9, Sq 2
  715.0 vs 733.2; NOTES.md); otherwise swapped (H200, the same shape: rows 428 vs swapped 202 TFLOP/s bf16, 281 vs
  163 fp8). Forcing "rows" or "seesaw" pads the rows to a multiple of 64 with zero queries (the padding is computed
  and dropped)."""
  if kernel not in KERNELS:
    raise ValueError(f"mosaic_sm90: kernel must be one of {KERNELS}, got {kernel!r}")
  if kernel == "auto":
    if rows >= mosaic_sm90_rows.ROWS and rows % mosaic_sm90_rows.ROWS == 0:
      return "seesaw"
    return "swapped"
  return kernel


def make_schedule(seq_lens: jax.Array, max_pages: int, *, rows: int, fp8: bool, interpret: bool = False,
                  kernel: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
  """The split-KV schedule (cu, sched, payload) of a call with `rows` = Sq * H query rows per sequence, a block
  table `max_pages` wide and these lengths: what mla_decode computes when it is not given one. It depends only on
  seq_lens and the shapes, so one decode step computes it once for all its layers (FlashMLA's get_mla_metadata).
  kernel: as mla_decode's (the swapped kernel splits the pages into other numbers of shares than the two 64-row
  kernels)."""
  num_parts, cut_pages = schedule_shares(rows, fp8, kernel)
  lens = jnp.clip(seq_lens.astype(jnp.int32), 0, max_pages * PAGE)
  return schedule_kernel(lens, num_parts, page=PAGE, interpret=bool(interpret), cut_pages=cut_pages)


def schedule_shares(rows: int, fp8: bool, kernel: str = "auto") -> tuple[int, int]:
  """(num_parts, cut_pages) of the split-KV schedule of a call with `rows` = Sq * H query rows per sequence on this
  GPU, for the kernel `kernel` (as mla_decode's) picks: its default plan's share count and the payload rule's cost
  of a cut sequence."""
  which = choose_kernel(rows, fp8, kernel)
  plan = (ROWS_KERNELS[which].make_plan(rows, num_sms=_num_sms(), fp8=fp8) if which in ROWS_KERNELS
          else make_plan(rows, fp8))
  return plan.num_parts, _cut_pages(plan)


def _cut_pages(plan) -> int:
  """The payload rule's cost of a cut sequence for this plan (split_kv.CUT_PAGES_DIRECT where the kernel writes
  whole sequences' outputs itself)."""
  return CUT_PAGES_DIRECT if getattr(plan, "direct_write", False) else 0


def _check_schedule(schedule, batch: int, num_parts: int):
  cu, sched, payload = schedule
  parts_padded = 1 << (num_parts - 1).bit_length()
  if sched.shape != (4, parts_padded) or cu.shape[0] < batch + 1:
    raise ValueError(f"mosaic_sm90: the schedule (cu {cu.shape}, sched {sched.shape}) was made for another "
                     f"shape than this call's (batch {batch}, {num_parts} shares); compute it with "
                     "pallas_kernels.mla_decode_schedule for these arguments")
  return cu, sched, payload


def _as_rows(x, rows_per_cta: int, groups: int):
  """[B, Sq, H, D] -> [B*G, rows_per_cta, D] (row b*G + g: sequence b, row group g; rows past Sq*H are zero
  queries whose outputs are dropped)."""
  batch, sq, heads, d = x.shape
  rows_padded = rows_per_cta * groups
  x = x.reshape(batch, sq * heads, d)
  if rows_padded != sq * heads:
    x = jnp.pad(x, ((0, 0), (0, rows_padded - sq * heads), (0, 0)))
  return x.reshape(batch * groups, rows_per_cta, d)


def q_operands(q, q_rope, rows_per_cta: int, groups: int):
  """Q as the kernels read it: two [B*G, rows, D] operands, Q's latent part the first 512 columns of the first and
  its rope part the last 64 columns of the second. q whole [.., 576] (q_rope None) is both, read where it is (a
  reshape, no copy unless rows are padded); apart, q [.., 512] and q_rope [.., 64] (the model's two products, so
  their concatenation is never written: V3 slice on an H200, ad387e9, 7.3 µs a layer)."""
  first = _as_rows(q, rows_per_cta, groups)
  return first, (first if q_rope is None else _as_rows(q_rope, rows_per_cta, groups))


def fp8_q_operands(q, q_rope, rows_per_cta: int, groups: int):
  """Q for the swapped kernel with an fp8 cache: (latent part in f16 [B*G, rows, 512], an operand whose last 64
  columns are the rope part: q whole where no row is padded (no copy), else the rope part alone). The f16 cast of
  the latent part is the one copy (with q the model's two products apart, XLA fuses it into the first)."""
  latent = _as_rows(q[..., :LATENT_DIM], rows_per_cta, groups).astype(jnp.float16)
  if q_rope is None and rows_per_cta * groups != q.shape[1] * q.shape[2]:
    q_rope = q[..., LATENT_DIM:]                   # pad only the rope columns
  return latent, _as_rows(q if q_rope is None else q_rope, rows_per_cta, groups)


def _lens_and_schedule(block_table, seq_lens, *, num_parts: int, schedule, interpret, cut_pages: int = 0):
  """The clipped lengths and the split-KV schedule (computed here, or checked if given)."""
  batch = seq_lens.shape[0]
  lens = jnp.clip(seq_lens.astype(jnp.int32), 0, block_table.shape[1] * PAGE)
  if schedule is None:
    cu, sched, payload = schedule_kernel(lens, num_parts, page=PAGE, interpret=bool(interpret), cut_pages=cut_pages)
  else:
    cu, sched, payload = _check_schedule(schedule, batch, num_parts)
  return lens, cu, sched, payload


def _mla_decode_rows(q, cache: MLAKVCache, block_table, seq_lens, *, softmax_scale: float, causal: bool,
                     interpret, num_parts, num_stages, schedule, kernel="rows", q_rope=None, **rows_plan):
  """mla_decode through a kernel with 64 query rows per CTA, bf16 or fp8 cache: rows (mosaic_sm90_rows.py) or seesaw
  (mosaic_sm90_seesaw.py)."""
  batch, sq, heads, _ = q.shape
  fp8 = cache.dtype == "fp8_e4m3"
  module = ROWS_KERNELS[kernel]
  plan = module.make_plan(sq * heads, num_sms=_num_sms(), num_parts=num_parts, num_stages=num_stages, fp8=fp8,
                          **rows_plan)
  if interpret:
    gpu_interpret.check_cpu_threads(module.NUM_WARPGROUPS)   # else interpret mode can deadlock (gpu_interpret.py)
  lens, cu, sched, payload = _lens_and_schedule(block_table, seq_lens, num_parts=plan.num_parts, schedule=schedule,
                                                interpret=interpret, cut_pages=_cut_pages(plan))
  call = module.build_call(plan, batch=batch, sq=sq, heads=heads, causal=causal, softmax_scale=softmax_scale,
                           num_pages=cache.num_pages, interpret=_interpret_params(interpret))
  # Q read where it is (reshapes at h128): q whole, or the model's two parts apart; with an fp8 cache the kernel
  # converts the latent part to f16 itself
  operands = (*q_operands(q, q_rope, mosaic_sm90_rows.ROWS, plan.groups), cache.latent, cache.rope)
  if fp8:
    operands += (cache.scale,)
  o_part, lse2_part, *direct = call(*operands, block_table, lens, cu, sched)
  if direct:         # the seesaw kernel's own output for the sequences one share held whole: [B, G, 64, 512], ..
    out_bits = lax.bitcast_convert_type(direct[0], jnp.bfloat16)           # fp8: bf16 bits as float16
    direct = (out_bits.reshape(batch, -1, LATENT_DIM), direct[1].reshape(batch, -1))
  out, lse = merge_partials(o_part, lse2_part, cu, payload, batch=batch, groups=plan.groups, out_dtype=q.dtype,
                            interpret=bool(interpret), rows_major=True,
                            direct=direct or None)                     # [B, G*64, 512], [B, G*64]
  out = out[:, :plan.rows].reshape(batch, sq, heads, LATENT_DIM)
  lse = jnp.swapaxes(lse[:, :plan.rows].reshape(batch, sq, heads), 1, 2)
  return out, lse


def mla_decode(q: jax.Array, cache: MLAKVCache, block_table: jax.Array, seq_lens: jax.Array, *,
               softmax_scale: float, causal: bool, interpret: bool = False, num_parts: int | None = None,
               num_stages: int | None = None, rows_per_cta: int | None = None,
               split_p: bool | None = None, schedule=None, kernel: str = "auto",
               prefetch_tiles: int | None = None, rebase_per_page: bool | None = None,
               registers: dict | None = None, early_p0: bool | None = None, l2_prefetch: int | None = None,
               producer_dequant: bool | None = None, producers: int | None = None,
               direct_write: bool | None = None, b0_before_a1: bool | None = None, p0_first: bool | None = None,
               tile_release: tuple[str, ...] | None = None, alternate: bool | None = None,
               lookahead: bool | None = None, register_dequant: bool | None = None,
               loads_first: bool | None = None, shared_loop: bool | None = None, scale_on_s: bool | None = None,
               q_rope: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """q [B, Sq, H, 576] bf16 -> out [B, Sq, H, 512] bf16, lse f32 [B, H, Sq]. Inputs validated by api.py. q_rope:
  Q's two parts apart, q [B, Sq, H, 512] and q_rope [B, Sq, H, 64] (api.mla_decode's q_rope).

  num_parts / num_stages / rows_per_cta / split_p override the plan (tests and tuning); None (the production path,
  what api.py calls) lets make_plan pick them. schedule: make_schedule's (cu, sched, payload) for these lengths and
  shapes (None: computed here). kernel: "auto" | "swapped" | "rows" | "seesaw" (choose_kernel; the rows and seesaw
  kernels take num_parts and num_stages, not rows_per_cta or split_p: their P is bf16, f16 with an fp8 cache).
  prefetch_tiles: the rows kernel with an fp8 cache and one slot converts that many of a page's 4 dequant tiles while
  the previous page's P.V runs; rebase_per_page: loop-variant operand addresses in the rows kernel (None: its default,
  mosaic_sm90_rows.Plan). registers: the seesaw kernel's register split, {"producer_registers": n,
  "compute_registers": n} (None: mosaic_sm90_seesaw.REGISTERS), or the swapped kernel's with producer_dequant
  (make_plan). early_p0: the seesaw kernel's warpgroup 0 hands P0 to warpgroup 1 while its own P0 V0_L is in flight
  (mosaic_sm90_seesaw.Plan.early_p0; None: on for a bf16 cache, off for fp8). l2_prefetch: page pairs ahead the seesaw
  kernel's producer prefetches into L2 (mosaic_sm90_seesaw.Plan; None: its default), or pages ahead for the swapped
  kernel with producer_dequant. producer_dequant: the swapped kernel with an fp8 cache has its producer warpgroup
  convert each page into an f16 ring (Plan.producer_dequant; None: make_plan's default). producers: 2
  splits that conversion between two producer warpgroups, 4 between four, one column tile each (Plan.producers; None:
  2 at 16 rows per CTA with producer_dequant, else 1). direct_write: the seesaw kernel writes the output of each
  sequence one share holds whole itself, and the merge runs only for the others (mosaic_sm90_seesaw.Plan.direct_write;
  None: mosaic_sm90_seesaw.DIRECT_WRITE). b0_before_a1: the seesaw kernel's producer fills slot 0's part B before slot
  1's part A (mosaic_sm90_seesaw.Plan.b0_before_a1; None: B0_BEFORE_A1). p0_first: the seesaw kernel's warpgroup 1
  runs P0 V0_R before P1 V1_R (mosaic_sm90_seesaw.Plan.p0_first; None: P0_FIRST). tile_release: page parts ("b0",
  "a1") the seesaw kernel's fp8 producer releases to their QK in two column tiles
  (mosaic_sm90_seesaw.Plan.tile_release; None: TILE_RELEASE). alternate: the swapped kernel's compute warpgroups take
  alternate pages (Plan.alternate; None: ALTERNATE where it applies). lookahead: its converting producers load the
  next page before converting this one (Plan.lookahead; None: LOOKAHEAD). register_dequant: the swapped kernel with an
  fp8 cache converts each page into its compute warpgroups' wgmma A registers, with no f16 page (Plan.register_dequant;
  None: make_plan's default); loads_first: its shared-memory loads of a product issued before the first conversion
  (Plan.loads_first; None: off); shared_loop: the compute warpgroups of alternate pages run one copy of their code
  (Plan.shared_loop; None: on with register_dequant); scale_on_s: register_dequant's QK scales applied to S, one
  accumulator a scale tile (Plan.scale_on_s; None: SCALE_ON_S).
  """
  if cache.page_size != PAGE:
    raise ValueError(f"mosaic_sm90 needs page_size {PAGE}, got {cache.page_size}; use backend='triton' or 'xla'")
  if cache.dtype not in ("bfloat16", "fp8_e4m3"):
    raise ValueError(f"mosaic_sm90 supports bfloat16 and fp8_e4m3 caches, got {cache.dtype}")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"mosaic_sm90 needs bfloat16 q, got {q.dtype}")
  batch, sq, heads, _ = q.shape
  fp8 = cache.dtype == "fp8_e4m3"
  which = choose_kernel(sq * heads, fp8, kernel)
  if which == "seesaw":
    if (rows_per_cta is not None or split_p is not None or prefetch_tiles is not None or rebase_per_page is not None
        or producer_dequant is not None or producers is not None or alternate is not None
        or lookahead is not None or register_dequant is not None or loads_first is not None
        or shared_loop is not None or scale_on_s is not None):
      raise ValueError("mosaic_sm90: the seesaw kernel does not take rows_per_cta / split_p / producer_dequant / "
                       "producers / alternate / lookahead / register_dequant / loads_first / shared_loop / "
                       "scale_on_s (the swapped kernel's) or prefetch_tiles / rebase_per_page (the rows kernel's)")
    return _mla_decode_rows(q, cache, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal,
                            interpret=interpret, num_parts=num_parts, num_stages=num_stages, schedule=schedule,
                            kernel="seesaw", early_p0=early_p0, l2_prefetch=l2_prefetch,
                            direct_write=direct_write, b0_before_a1=b0_before_a1, p0_first=p0_first,
                            tile_release=tile_release, q_rope=q_rope, **(registers or {}))
  if (early_p0 is not None or direct_write is not None
      or b0_before_a1 is not None or p0_first is not None or tile_release is not None):
    raise ValueError("mosaic_sm90: early_p0, direct_write, b0_before_a1, p0_first and tile_release "
                     "apply to the seesaw kernel (kernel='seesaw')")
  if registers is not None and (which != "swapped"
                                or not set(registers) <= {"producer_registers", "compute_registers"}):
    raise ValueError(f"mosaic_sm90: registers ({{'producer_registers': n, 'compute_registers': n}}) applies to the "
                     f"seesaw kernel and to the swapped kernel with producer_dequant, got {registers!r} for the "
                     f"{which} kernel")
  if which != "swapped" and (l2_prefetch is not None or producer_dequant is not None or producers is not None
                             or alternate is not None or lookahead is not None or register_dequant is not None
                             or loads_first is not None or shared_loop is not None or scale_on_s is not None):
    raise ValueError("mosaic_sm90: l2_prefetch applies to the seesaw kernel and, with producer_dequant (and "
                     "producers, alternate, lookahead), to the swapped kernel, as does register_dequant (and "
                     "loads_first, shared_loop, scale_on_s) (kernel='seesaw' or 'swapped')")
  if which == "rows":
    if rows_per_cta is not None or split_p is not None:
      raise ValueError("mosaic_sm90: rows_per_cta and split_p apply to the swapped kernel only; the rows kernel "
                       "holds 64 rows per CTA and rounds P to bf16 (pass kernel='swapped' to use them)")
    return _mla_decode_rows(q, cache, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal,
                            interpret=interpret, num_parts=num_parts, num_stages=num_stages, schedule=schedule,
                            prefetch_tiles=prefetch_tiles, rebase_per_page=rebase_per_page, q_rope=q_rope)
  if prefetch_tiles is not None or rebase_per_page is not None:
    raise ValueError("mosaic_sm90: prefetch_tiles and rebase_per_page apply to the rows kernel (kernel='rows')")
  plan = make_plan(sq * heads, fp8, num_parts=num_parts, num_stages=num_stages, rows_per_cta=rows_per_cta,
                   split_p=split_p, producer_dequant=producer_dequant, l2_prefetch=l2_prefetch,
                   producers=producers, alternate=alternate, lookahead=lookahead, register_dequant=register_dequant,
                   loads_first=loads_first, shared_loop=shared_loop, scale_on_s=scale_on_s, **(registers or {}))
  if interpret:
    gpu_interpret.check_cpu_threads(plan.num_warpgroups)     # else interpret mode can deadlock (gpu_interpret.py)
  lens, cu, sched, payload = _lens_and_schedule(block_table, seq_lens, num_parts=plan.num_parts, schedule=schedule,
                                                interpret=interpret)
  # the kernel's TMA reads Q's latent (f16 for an fp8 cache, else q itself) and the last 64 (rope) columns of the
  # second array straight from these
  q_nope, q_rope = (fp8_q_operands if fp8 else q_operands)(q, q_rope, plan.n, plan.groups)
  if plan.register_dequant:
    q_nope = fp8_ops.q_in_qk_order(q_nope)          # the dims in the order of the kernel's QK A operands
  call = _build_call(plan, batch=batch, sq=sq, heads=heads, causal=causal, softmax_scale=softmax_scale,
                     num_pages=cache.num_pages, interpret=interpret)
  cache_arrays = (cache.latent, cache.rope) + ((cache.scale,) if fp8 else ())
  o_part, lse2_part = call(q_nope, q_rope, *cache_arrays, block_table, lens, cu, sched)
  # (register_dequant: O's rows come in the order of its P.V A operands; the merge gathers them in dim order,
  # computing each program's rows itself)
  row_of_dim = fp8_ops.row_of_dim if plan.register_dequant else None
  out, lse = merge_partials(o_part, lse2_part, cu, payload, batch=batch, groups=plan.groups, out_dtype=q.dtype,
                            interpret=bool(interpret), row_of_dim=row_of_dim)  # [B, G*N, 512], [B, G*N]
  out = out[:, :plan.rows].reshape(batch, sq, heads, LATENT_DIM)
  lse = jnp.swapaxes(lse[:, :plan.rows].reshape(batch, sq, heads), 1, 2)
  return out, lse
