"""The packed int4 weight format the w4a16 kernels read (docs/architecture.md §4), version 3 ("paired").

A quantized linear y = x @ W, W [K, N] = (q - z[g]) * s[g] with q, z unsigned 4-bit and g = k // G (AutoAWQ's
zero-point scheme), is stored as three arrays. K is cut into chunks of CHUNK_K = 256 rows, each chunk into 8
planes of 32 rows (plane j = rows [32 j, 32 j + 32) of the chunk, h = j // 4, m = j % 4):

  packed  int32   [..., K_pad/8, N_pad]   word (32 c + 2 i + h, n) holds, in bits 4 m + 16 u .. + 3 (u = 0, 1),
                                          q[256 c + 32 j + 2 i + u, n]
  scales  float16 [..., K_pad/G, N_pad]   s[g, n]
  zeros   uint8   [..., K_pad/G, N_pad]   z[g, n]

Why this order: a kernel reads a chunk as a [32, BN] tile of words (rows of BN contiguous words). The even word
rows hold planes 0..3, the odd ones planes 4..7, and each 16-bit half of a word holds one of two neighbouring K
rows. So one shift and one lop3 turn a word into the bf16 pair (128 + q) of K rows (2 i, 2 i + 1) of one plane,
which is what one register of a wgmma A fragment holds (mosaic_sm90.py): no byte permute. Every plane lies inside
one quantization group for G in 32, 64, 128. K is padded to a multiple of 256 and N to a multiple of 64 with
q = z = s = 0 (those rows and columns contribute exactly 0). Leading dimensions (experts) are kept.
Bytes per weight: 1/2 + 3/G (fp16 scale and one zero byte per group and column; AutoAWQ: 1/2 + 5/(2G)).

Version 2 (converted directories written before 2026-12-04) held q[256 c + 32 j + r, n] in bits 4 j of word
(32 c + r, n). The two orders differ by a transpose of 16-bit halves within each pair of word rows
(`swap_word_halves`, its own inverse), so a version 2 directory is repacked at load without unpacking.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

CHUNK_K = 256                   # K rows per packed chunk
NIBBLES = 8                     # 4-bit values per int32 word
PLANE_K = CHUNK_K // NIBBLES    # 32 K rows decoded from one nibble of a chunk's words
ALIGN_N = 64                    # N is padded to a multiple of this
KERNEL_GROUP_SIZES = (32, 64, 128)   # group sizes the Triton kernels are built for (AWQ checkpoints use 64 or 128)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W4A16Weight:
  """int4 weights of one linear (or a stack of them, e.g. [E] experts) in the kernels' layout."""
  packed: jax.Array                               # int32 [..., K_pad/8, N_pad]
  scales: jax.Array                               # float16 [..., K_pad/G, N_pad]
  zeros: jax.Array                                # uint8 [..., K_pad/G, N_pad]
  k: int = dataclasses.field(metadata=dict(static=True))           # logical input rows K <= K_pad
  n: int = dataclasses.field(metadata=dict(static=True))           # logical output columns N <= N_pad
  group_size: int = dataclasses.field(metadata=dict(static=True))

  @property
  def k_pad(self) -> int:
    return self.packed.shape[-2] * NIBBLES

  @property
  def n_pad(self) -> int:
    return self.packed.shape[-1]

  @property
  def lead_shape(self) -> tuple[int, ...]:
    return tuple(self.packed.shape[:-2])

  def nbytes(self) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in (self.packed, self.scales, self.zeros))


def padded_k(k: int) -> int:
  return -(-k // CHUNK_K) * CHUNK_K


def padded_n(n: int) -> int:
  return -(-n // ALIGN_N) * ALIGN_N


def check_shapes(k: int, n: int, group_size: int, where: str = "w4a16") -> None:
  """The layout holds any group size that divides both K and a chunk (256 rows): 16, 32, 64, 128, 256, ...
  The kernels are narrower (KERNEL_GROUP_SIZES); api.resolve_backend says so."""
  if group_size <= 0 or CHUNK_K % group_size:
    raise ValueError(f"{where}: group size {group_size} does not divide the {CHUNK_K}-row chunk of the packed "
                     f"layout; supported group sizes divide {CHUNK_K} (AWQ checkpoints use 64 or 128).")
  if k % group_size:
    raise ValueError(f"{where}: group size {group_size} does not divide K = {k}.")
  if n <= 0:
    raise ValueError(f"{where}: N = {n} output columns; need at least one.")


def _check_nibbles(name: str, a) -> None:
  a = np.asarray(a)
  if a.size and (a.min() < 0 or a.max() > 15):
    raise ValueError(f"w4a16 pack: {name} holds values outside 0..15 (min {a.min()}, max {a.max()}).")


def swap_word_halves(words, xp=jnp):
  """Words [..., 2 P, N] -> the same shape with the 16-bit halves of each pair of rows (2 i, 2 i + 1) transposed:
  row 2 i becomes (low half of row 2 i | low half of row 2 i + 1 << 16), row 2 i + 1 (high half of 2 i | high
  half of 2 i + 1 << 16). Maps packed format version 2 to 3 and back (it is its own inverse); int32 or uint32."""
  *lead, rows, n = words.shape
  if rows % 2:
    raise ValueError(f"w4a16 swap_word_halves: {rows} word rows; the halves pair rows, so need an even count.")
  u = words.view(np.uint32) if xp is np else jax.lax.bitcast_convert_type(words, jnp.uint32)
  u = u.reshape(*lead, rows // 2, 2, n)
  even, odd = u[..., 0, :], u[..., 1, :]
  lo16 = xp.uint32(0xFFFF)
  new_even = (even & lo16) | (odd << xp.uint32(16))
  new_odd = (even >> xp.uint32(16)) | (odd & xp.uint32(0xFFFF0000))
  out = xp.stack([new_even, new_odd], axis=-2).reshape(*lead, rows, n)
  if xp is np:
    return out.view(words.dtype)
  return jax.lax.bitcast_convert_type(out, words.dtype)


def pack_q(q, xp=jnp):
  """q [..., K, N] (integers 0..15) -> packed int32 words [..., K_pad/8, N_pad] (the module docstring's order)."""
  *lead, k, n = q.shape
  if xp is np:
    _check_nibbles("q", q)
  k_pad, n_pad = padded_k(k), padded_n(n)
  qp = xp.pad(xp.asarray(q).astype(xp.uint32), [(0, 0)] * len(lead) + [(0, k_pad - k), (0, n_pad - n)])
  qp = qp.reshape(*lead, k_pad // CHUNK_K, NIBBLES, PLANE_K, n_pad)       # row 256 c + 32 j + r
  shifts = (xp.arange(NIBBLES, dtype=xp.uint32) * 4)[:, None, None]       # [8, 1, 1]
  words = (qp << shifts).sum(axis=-3, dtype=xp.uint32)                    # version 2: bits 4 j of row r
  words = words.reshape(*lead, k_pad // NIBBLES, n_pad)
  words = words.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(words, jnp.int32)
  return swap_word_halves(words, xp=xp)


def pad_groups(a, k: int, group_size: int, dtype, xp=jnp):
  """Per-group scales or zeros [..., K/G, N] -> [..., K_pad/G, N_pad] in `dtype`, zero-padded."""
  *lead, g, n = a.shape
  if g * group_size != k:
    raise ValueError(f"w4a16 pack: {g} groups of {group_size} rows do not make K = {k}.")
  pad = [(0, 0)] * len(lead) + [(0, padded_k(k) // group_size - g), (0, padded_n(n) - n)]
  return xp.pad(xp.asarray(a).astype(dtype), pad)


def pack(q, z, s, group_size: int, xp=jnp) -> W4A16Weight:
  """q [..., K, N], z and s [..., K/G, N] (q, z integers in 0..15, s float16) -> W4A16Weight.

  xp = numpy packs on the host (loaders, one tensor at a time); xp = jax.numpy packs on a device, under jit.
  Values outside 0..15 raise on the host; on a device they would corrupt neighbouring nibbles, so callers that
  pack traced values must have checked them.
  """
  *lead, k, n = q.shape
  check_shapes(k, n, group_size)
  ng = k // group_size
  if tuple(z.shape) != (*lead, ng, n) or tuple(s.shape) != (*lead, ng, n):
    raise ValueError(f"w4a16 pack: q {tuple(q.shape)} needs zeros and scales of shape {(*lead, ng, n)}; "
                     f"got {tuple(z.shape)} and {tuple(s.shape)}.")
  if xp is np:
    _check_nibbles("z", z)
  return W4A16Weight(packed=pack_q(q, xp=xp), scales=pad_groups(s, k, group_size, xp.float16, xp=xp),
                     zeros=pad_groups(z, k, group_size, xp.uint8, xp=xp), k=int(k), n=int(n),
                     group_size=int(group_size))


def pack_gate_up(gate, up, group_size: int, xp=jnp) -> W4A16Weight:
  """Gate and up projections (each (q, z, s) as for `pack`, [..., K, I]) -> one weight [K, 2 I_pad]: columns
  [0, I_pad) are the gate, [I_pad, 2 I_pad) the up projection (I_pad = padded_n(I)); a gated kernel program reads
  column tile t of both halves."""
  wg, wu = pack(*gate, group_size, xp=xp), pack(*up, group_size, xp=xp)
  if wg.packed.shape != wu.packed.shape:
    raise ValueError(f"w4a16 pack_gate_up: gate {wg.packed.shape} and up {wu.packed.shape} differ in shape.")
  cat = lambda a, b: xp.concatenate([a, b], axis=-1)
  return W4A16Weight(packed=cat(wg.packed, wu.packed), scales=cat(wg.scales, wu.scales),
                     zeros=cat(wg.zeros, wu.zeros), k=wg.k, n=2 * wg.n_pad, group_size=int(group_size))


def as_stack(w: W4A16Weight) -> W4A16Weight:
  """One weight as a stack of one ([1, ...]): how the grouped kernels take a dense linear (every block on expert 0)."""
  return W4A16Weight(packed=w.packed[None], scales=w.scales[None], zeros=w.zeros[None], k=w.k, n=w.n,
                     group_size=w.group_size)


def unpack(w: W4A16Weight):
  """W4A16Weight -> (q int32 [..., K, N], z int32 [..., K/G, N], s float16 [..., K/G, N]) (jnp; tests and the
  reference)."""
  lead, k_pad, n_pad = w.lead_shape, w.k_pad, w.n_pad
  words = jax.lax.bitcast_convert_type(swap_word_halves(w.packed), jnp.uint32)      # version 2 order
  words = words.reshape(*lead, k_pad // CHUNK_K, 1, PLANE_K, n_pad)
  shifts = (jnp.arange(NIBBLES, dtype=jnp.uint32) * 4)[:, None, None]
  q = ((words >> shifts) & 0xF).reshape(*lead, k_pad, n_pad)[..., :w.k, :w.n]
  ng = w.k // w.group_size
  return q.astype(jnp.int32), w.zeros[..., :ng, :w.n].astype(jnp.int32), w.scales[..., :ng, :w.n]


def dequantize(w: W4A16Weight, dtype=jnp.float32) -> jax.Array:
  """W [..., K, N] = (q - z) * s in float32, cast to dtype."""
  q, z, s = unpack(w)
  g = w.group_size
  *lead, k, n = q.shape
  qg = q.astype(jnp.float32).reshape(*lead, k // g, g, n)
  out = (qg - z.astype(jnp.float32)[..., :, None, :]) * s.astype(jnp.float32)[..., :, None, :]
  return out.reshape(*lead, k, n).astype(dtype)


def random_weight(key, lead: tuple, k: int, n: int, group: int, gate_up: bool = False) -> W4A16Weight:
  """Random packed weights made on the device (any int32 is a valid word of 8 nibbles); benchmarks and profiling."""
  n_pad = padded_n(n) * (2 if gate_up else 1)
  k_pad = padded_k(k)
  kp, ks, kz = jax.random.split(key, 3)
  packed = jax.random.bits(kp, (*lead, k_pad // NIBBLES, n_pad), jnp.uint32)
  packed = jax.lax.bitcast_convert_type(packed, jnp.int32)
  scales = (jax.random.uniform(ks, (*lead, k_pad // group, n_pad), jnp.float32, 0.5, 1.5)
            / (4.6 * np.sqrt(k))).astype(jnp.float16)
  zeros = jax.random.randint(kz, (*lead, k_pad // group, n_pad), 0, 16, jnp.int32).astype(jnp.uint8)
  return W4A16Weight(packed=packed, scales=scales, zeros=zeros, k=k, n=(n_pad if gate_up else n),
                            group_size=group)
