"""The `triton` backend: int4-weight x bf16-activation GEMMs (Pallas Triton lowering; sm80+, CPU interpret).

One kernel serves the dense linear and both halves of the routed-expert MLP (docs/architecture.md §4).
Program (b, p, s) owns row block b (block_m rows of one expert; the dense matmul is one "expert" with contiguous
rows), output columns [p BN, (p+1) BN) and K split s (a contiguous run of 256-row chunks). Per chunk:

  words_h [16, BN] int32: the even (h = 0) or odd (h = 1) word rows of one chunk of one column tile (layout.py:
                   plane j = 4 h + m of the chunk is nibble m of those words, K row 2 i + u in half u)
  q_ju  [16, BN]   bf16 128 + q of K rows 32 j + 2 i + u: (nibble | 0x4300) is the bf16 bit pattern of 128 + q
  x_ju  [bm, 16]   bf16 rows of the block at those K rows (gathered by token id, 0 on padding rows / past K)
  per quantization group g of the chunk (one to eight planes j):
  acc   [bm, BN]   += s_g * Σ_j Σ_u x_ju . q_ju  -  (Σ_k x) * (z_g + 128) * s_g      (float32)

since Σ_k x (q - z) s = s Σ_k x (128 + q) - (z + 128) s Σ_k x. Scale and zero point touch the [bm, BN] partial
once per group, never a weight, so a weight costs only its decode (2-3 integer instructions per pair of values
with decode="ptx"); the products x . (128 + q) are exact in float32 on the tensor cores, and the offset 128 costs
precision only through the float32 sum (about 2^-16 relative at G = 128), far below bf16's.

Gated (gate and up in one pass): the program accumulates column tile p of both halves and writes
silu(gate) * up. Weighted: rows are multiplied by their router weight before the store. Stores are masked to
valid rows, so padding rows of a block are neither written nor read downstream. With K split over S programs
(to fill the GPU when blocks x column tiles are few), each writes float32 partials [S, rows, N] that XLA sums
(and gates) after the kernel.

decode = "jnp" (shift/and/or/truncate in jnp; what interpret mode runs) or "ptx" (inline PTX, _nibble_asm).

orient = "swap" (the default) computes the transposed products acc^T [BN, bm] += q_ju^T [BN, 16] . x_ju^T [16, bm]:
the decoded weights are the left (M-side) operand, which on Hopper Triton can feed to wgmma from registers, and
the few token rows sit on N. "mk" is the plain orientation above (x on the left), kept as a variant: on the H200
it was 1.5x slower for the MoE at T = 64 (NOTES.md).
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

with warnings.catch_warnings():
  # The Triton lowering is deprecated in favour of Mosaic GPU but is the portable (sm80) path; jax is pinned.
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as pltriton

from pallas_kernels.w4a16 import layout, routing

_MAGIC = 128.0                 # (nibble | 0x4300) as bf16 == 128 + nibble
_MAGIC_BITS = 0x4300
HALF_PLANE = layout.PLANE_K // 2   # K rows of one plane held in one half of the words: 16

# Defaults from the H200 sweeps in NOTES.md: both the grouped (MoE) and the dense kernels run best in the swapped
# orientation with 4 warps and 64-column tiles (the dense ones with more K splits). `config` overrides any key.
DEFAULT_CONFIG = dict(num_warps=4, num_stages=3, block_n=128, decode="ptx", target_programs=528, splits=None,
                      orient="mk")
MOE_CONFIG = dict(num_warps=4, orient="swap", block_n=64)
DENSE_CONFIG = dict(num_warps=4, orient="swap", block_n=64, target_programs=1056)


def _plane_jnp(words: jax.Array, j: int) -> jax.Array:
  """int32 words -> bf16 of the same shape: 128 + nibble j (bits 4 j .. 4 j + 3)."""
  v = (lax.shift_right_logical(words, 4 * j) & 0xF) | _MAGIC_BITS
  return lax.bitcast_convert_type(v.astype(jnp.int16), jnp.bfloat16)


def _nibble_asm(j: int) -> str:
  """Two int32 words ($1, $2: Triton packs pack=2 consecutive elements) -> one register of two bf16 ($0): 128 +
  nibble j of the first word in the low half, of the second word in the high half. `prmt` moves byte j//2 of
  each word into the low byte of its 16-bit lane, a shift brings an odd nibble down, and one `lop3` computes
  (t & 0x000F000F) | 0x43004300: two or three instructions per pair of values."""
  byte = j // 2
  selector = byte | (4 + byte) << 8
  shift = f"shr.u32 t, t, 4;\n" if j % 2 else ""
  return ("{\n.reg .b32 t;\n" f"prmt.b32 t, $1, $2, {selector:#06x};\n" + shift
          + "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;\n}")


def _plane_ptx(words: jax.Array, j: int) -> jax.Array:
  # One asm call per nibble: this jax version's Triton lowering of elementwise_inline_asm returns one result.
  return pltriton.elementwise_inline_asm(
      _nibble_asm(j), args=[words], constraints="=r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)])[0]


def _kernel(block_expert_ref, row_token_ref, row_weight_ref, x_ref, w_ref, s_ref, z_ref, o_ref, *,
            block_m: int, block_n: int, group: int, k: int, n_chunks: int, chunks_per_split: int, gated: bool,
            up_offset: int, weighted: bool, split: bool, decode: str, swap: bool):
  b, p, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  expert = block_expert_ref[b]
  plane_fn = _plane_ptx if decode == "ptx" else _plane_jnp
  planes_per_group = group // layout.PLANE_K if group >= layout.PLANE_K else 1
  groups_per_chunk = layout.CHUNK_K // group

  @pl.when(expert >= 0)
  def _():
    rows = row_token_ref[pl.ds(b * block_m, block_m)]                 # [bm] row of x, -1 = padding
    valid = rows >= 0
    safe = jnp.where(valid, rows, 0)
    cols = [p * block_n] + ([up_offset + p * block_n] if gated else [])
    c_lo = sp * chunks_per_split
    c_hi = jnp.minimum(c_lo + chunks_per_split, n_chunks)

    def body(c, accs):
      k0 = c * layout.CHUNK_K
      xs, xsums = {}, []           # xs[j, u]: K rows 32 j + 2 i + u of the chunk, i = 0..15
      for j in range(layout.NIBBLES):
        xsum = 0.0
        for u in range(2):
          kk = k0 + j * layout.PLANE_K + u + 2 * lax.broadcasted_iota(jnp.int32, (HALF_PLANE, 1), 0)  # [16, 1]
          if swap:   # x_ju^T [16, bm]: the small operand sits on the product's N side
            xju = pltriton.load(x_ref.at[safe[None, :], kk], mask=valid[None, :] & (kk < k), other=0.0)
            xsum = xsum + jnp.sum(xju.astype(jnp.float32), axis=0, keepdims=True)             # [1, bm]
          else:      # x_ju [bm, 16]
            kr = kk.reshape(1, HALF_PLANE)
            xju = pltriton.load(x_ref.at[safe[:, None], kr], mask=valid[:, None] & (kr < k), other=0.0)
            xsum = xsum + jnp.sum(xju.astype(jnp.float32), axis=1, keepdims=True)             # [bm, 1]
          xs[j, u] = xju
        xsums.append(xsum)
      new = []
      for acc, col in zip(accs, cols):
        planes = {}
        for h in range(2):         # the chunk's even / odd word rows: planes 4 h .. 4 h + 3
          # rows as an index array, not a strided pl.ds: interpret mode has no strided loads
          word_rows = c * layout.PLANE_K + h + 2 * lax.broadcasted_iota(jnp.int32, (HALF_PLANE, 1), 0)
          word_cols = col + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
          words = pltriton.load(w_ref.at[expert, word_rows, word_cols], eviction_policy="evict_first")  # [16, BN]
          if swap:
            words = words.T                                                                 # [BN, 16]
          for m in range(4):
            for u in range(2):     # bits 4 m + 16 u = nibble m + 4 u of the word
              planes[4 * h + m, u] = plane_fn(words, m + 4 * u)
        for gi in range(groups_per_chunk):
          js = range(gi * planes_per_group, (gi + 1) * planes_per_group)
          jus = [(j, u) for j in js for u in range(2)]
          if swap:   # [BN, 16] x [16, bm] -> [BN, bm]
            d = sum(pltriton.dot(planes[ju], xs[ju]) for ju in jus)
          else:      # [bm, 16] x [16, BN] -> [bm, BN]
            d = sum(pltriton.dot(xs[ju], planes[ju]) for ju in jus)
          xsum = sum(xsums[j] for j in js)
          g = c * groups_per_chunk + gi
          sc = s_ref[expert, pl.ds(g, 1), pl.ds(col, block_n)].astype(jnp.float32)         # [1, BN]
          zo = (z_ref[expert, pl.ds(g, 1), pl.ds(col, block_n)].astype(jnp.float32) + _MAGIC) * sc
          if swap:
            sc, zo = sc.T, zo.T                                                           # [BN, 1]
          acc = acc + d * sc - xsum * zo
        new.append(acc)
      return tuple(new)

    zero = jnp.zeros((block_n, block_m) if swap else (block_m, block_n), jnp.float32)
    accs = lax.fori_loop(c_lo, c_hi, body, (zero,) * len(cols))
    if swap:
      accs = tuple(a.T for a in accs)                                                     # [bm, BN]
    out_rows = pl.ds(b * block_m, block_m)
    if split:                                   # float32 partials: [S, rows, N_out(, both halves)]
      for acc, col in zip(accs, cols):
        y = acc * row_weight_ref[out_rows][:, None] if weighted else acc
        pltriton.store(o_ref.at[sp, out_rows, pl.ds(col, block_n)], y, mask=valid[:, None])
      return
    y = accs[0]
    if gated:
      y = (y * jax.nn.sigmoid(y)) * accs[1]
    if weighted:
      y = y * row_weight_ref[out_rows][:, None]
    pltriton.store(o_ref.at[out_rows, pl.ds(p * block_n, block_n)], y.astype(o_ref.dtype), mask=valid[:, None])


@functools.lru_cache(maxsize=None)
def _kernel_call(*, grid, out_rows: int, n_pad: int, out_dtype, num_warps: int, num_stages: int, interpret: bool,
                 **static):
  """The jitted pallas_call for one static configuration. One function object per configuration, so a model
  that calls the same shape in every layer traces the kernel once and lowers it once per program (jit's caches)
  instead of once per call site: ~0.1 s each on the GPU, which was most of a small model's start-up."""
  kernel = functools.partial(_kernel, **static)
  if static["split"]:
    out_shape = jax.ShapeDtypeStruct((grid[2], out_rows, n_pad), jnp.float32)
  else:
    out_shape = jax.ShapeDtypeStruct((out_rows, n_pad // 2 if static["gated"] else n_pad), out_dtype)

  def call(*arrays):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return pl.pallas_call(
          kernel, grid=grid, out_shape=out_shape, interpret=interpret,
          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
          name="w4a16_gated" if static["gated"] else "w4a16",
      )(*arrays)

  return jax.jit(call)


def grouped_matmul(x: jax.Array, w: layout.W4A16Weight, block_expert: jax.Array, row_token: jax.Array,
                   row_weight: jax.Array, *, block_m: int, gated: bool, weighted: bool, out_dtype,
                   busy_blocks: int, interpret: bool = False, config: dict | None = None) -> jax.Array:
  """Rows [NB*block_m, N_out] (N_out = N_pad/2 when gated, else N_pad); rows of unused blocks and padding rows
  are left unwritten (garbage). x [R, K] (rows picked by row_token); w stacked [E, ...] (a dense weight is passed
  with E = 1 and every block on expert 0). busy_blocks: how many blocks are expected in use (sizes the K split)."""
  cfg = dict(DEFAULT_CONFIG, **(config or {}))
  if interpret:
    cfg["decode"] = "jnp"                      # inline PTX has no CPU form
  n_out = w.n_pad // 2 if gated else w.n_pad
  block_n = cfg["block_n"] if n_out % cfg["block_n"] == 0 else layout.ALIGN_N
  n_chunks = w.k_pad // layout.CHUNK_K
  nb = block_expert.shape[0]
  tiles = n_out // block_n
  splits = cfg.get("splits") or routing.k_splits(n_chunks, busy_blocks * tiles, cfg["target_programs"])
  cps = -(-n_chunks // splits)
  split = splits > 1
  call = _kernel_call(block_m=block_m, block_n=block_n, group=w.group_size, k=w.k, n_chunks=n_chunks,
                      chunks_per_split=cps, gated=gated, up_offset=n_out, weighted=weighted, split=split,
                      decode=cfg["decode"], swap=cfg["orient"] == "swap", grid=(nb, tiles, splits),
                      out_rows=nb * block_m, n_pad=w.n_pad, out_dtype=jnp.dtype(out_dtype),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], interpret=bool(interpret))
  out = call(block_expert, row_token, row_weight, x, w.packed, w.scales, w.zeros)
  if not split:
    return out
  out = out.sum(axis=0)                        # garbage rows stay garbage; valid rows are complete sums
  if gated:
    g, u = out[:, :n_out], out[:, n_out:]
    out = jax.nn.silu(g) * u
  return out.astype(out_dtype)


def matmul(x: jax.Array, w: layout.W4A16Weight, *, interpret: bool = False, config: dict | None = None,
           out_dtype=None):
  """x [M, K] bf16 @ W [K, N] -> [M, N] in out_dtype (default bf16)."""
  return routing.dense_matmul(grouped_matmul, x, w, config={**DENSE_CONFIG, **(config or {})},
                              interpret=interpret, out_dtype=out_dtype)


def moe(x, routing_, w13: layout.W4A16Weight, w2: layout.W4A16Weight, *, busy_blocks: int,
        interpret: bool = False, config: dict | None = None):
  """Sorted, router-weighted rows [NB*block_m, D] float32 of the expert MLP (combine() sums them per token)."""
  bm = routing_.block_m
  config = dict(MOE_CONFIG, **(config or {}))
  h = grouped_matmul(x, w13, routing_.block_expert, routing_.row_token, routing_.row_weight, block_m=bm,
                     gated=True, weighted=False, out_dtype=x.dtype, busy_blocks=busy_blocks, interpret=interpret,
                     config=config)
  # The down projection reads h's rows in place: row r of block b is h[r] (valid where row_token >= 0).
  row_self = routing.in_place_rows(routing_)
  y = grouped_matmul(h, w2, routing_.block_expert, row_self, routing_.row_weight, block_m=bm, gated=False,
                     weighted=True, out_dtype=jnp.float32, busy_blocks=busy_blocks, interpret=interpret,
                     config=config)
  return y[:, :w2.n]
