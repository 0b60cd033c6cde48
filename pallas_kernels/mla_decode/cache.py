"""Paged MLA KV cache: the storage format the decode kernels read (docs/architecture.md §2).

One cache holds one layer. Token slot s lives at page s // page_size, offset s % page_size.

  bfloat16  latent bf16 [P, ps, 512]           rope bf16 [P, ps, 64]   scale None        1152 B/token
  fp8_e4m3  latent float8_e4m3fn [P, ps, 512]  rope bf16 [P, ps, 64]   scale f32 [P, ps, 4]  656 B/token
  float32   latent f32 [P, ps, 512]            rope f32 [P, ps, 64]    scale None        2304 B/token
            (exactness tests with the xla backend only)

fp8: each token's 512-wide latent is cut into four 128-wide tiles; each tile gets its own power-of-two scale
2^ceil(log2(max(amax / 448, 1e-4))), stored value = e4m3(x / scale), dequantized = value * scale. A power of two
makes x / scale exact, so the only error is e4m3 rounding (relative 2^-4 of each value at most, plus values
under the e4m3 subnormal step of 2^-9 * scale). RoPE stays bf16: a shared scale would saturate it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LATENT_DIM = 512          # kv_lora_rank: the compressed latent every head reads
ROPE_DIM = 64             # qk_rope_head_dim: one RoPE key shared by all heads
FP8_TILE = 128            # width of one fp8 scale tile
FP8_MAX = 448.0           # largest finite float8_e4m3fn
FP8_MIN_SCALE_RATIO = 1e-4  # floor on amax / 448, so an all-zero tile still gets a finite scale

# name -> (latent dtype, rope dtype, has scale)
_FORMATS = {
    "bfloat16": (jnp.bfloat16, jnp.bfloat16, False),
    "fp8_e4m3": (jnp.float8_e4m3fn, jnp.bfloat16, True),
    "float32": (jnp.float32, jnp.float32, False),
}
CACHE_DTYPES = tuple(_FORMATS)
"""The cache format names, the one list every check of a cache dtype name uses."""


def check_cache_dtype(dtype: str) -> str:
  """Returns `dtype` if it names a cache format, else raises ValueError listing CACHE_DTYPES."""
  if not isinstance(dtype, str) or dtype not in _FORMATS:
    raise ValueError(f"MLAKVCache dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
  return dtype


def quantize_fp8(latent: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Quantizes latents [..., 512] to (float8_e4m3fn [..., 512], float32 scales [..., 4]).

  Pure function of its input; the same arithmetic MLAKVCache.write uses. Scale per 128-wide tile is the smallest
  power of two >= max(amax / 448, 1e-4), so |x / scale| <= 448 and the division is exact.
  """
  if latent.shape[-1] % FP8_TILE:
    raise ValueError(f"quantize_fp8: last dim must be a multiple of {FP8_TILE}, got shape {latent.shape}")
  x = latent.astype(jnp.float32)
  tiles = x.reshape(*x.shape[:-1], x.shape[-1] // FP8_TILE, FP8_TILE)
  amax = jnp.max(jnp.abs(tiles), axis=-1)
  ratio = jnp.maximum(amax / FP8_MAX, FP8_MIN_SCALE_RATIO)
  # Smallest power of two >= ratio, from the exponent (exact; log2 + ceil could be off by one ulp).
  mantissa, exponent = jnp.frexp(ratio)           # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
  exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
  scale = jnp.ldexp(jnp.ones_like(ratio), exponent)
  # amax / 448 was rounded, so a value can land a hair above 448; clip keeps it finite (e4m3fn has no inf).
  values = jnp.clip(tiles / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return values.reshape(latent.shape), scale


def dequantize_fp8(values: jax.Array, scale: jax.Array) -> jax.Array:
  """float8 values [..., 512] and scales [..., 4] -> float32 [..., 512]."""
  v = values.astype(jnp.float32)
  tiles = v.reshape(*v.shape[:-1], v.shape[-1] // FP8_TILE, FP8_TILE) * scale[..., None]
  return tiles.reshape(v.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAKVCache:
  """One layer's paged latent cache. A pytree: pass it through jit (donate it so writes update in place)."""

  latent: jax.Array              # [P, ps, 512] bf16 | float8_e4m3fn | f32
  rope: jax.Array                # [P, ps, 64]  bf16 | f32
  scale: jax.Array | None        # [P, ps, 4] f32 for fp8_e4m3, else None
  page_size: int = dataclasses.field(default=64, metadata=dict(static=True))

  # ---- construction -------------------------------------------------------------------------------------
  @classmethod
  def allocate(cls, num_pages: int, page_size: int = 64, dtype: str = "bfloat16") -> "MLAKVCache":
    """A zero-filled pool of num_pages pages of page_size tokens."""
    check_cache_dtype(dtype)
    if not isinstance(num_pages, int) or num_pages < 1:
      raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    if not isinstance(page_size, int) or page_size < 1:
      raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    lat_dt, rope_dt, has_scale = _FORMATS[dtype]
    return cls(
        latent=jnp.zeros((num_pages, page_size, LATENT_DIM), lat_dt),
        rope=jnp.zeros((num_pages, page_size, ROPE_DIM), rope_dt),
        scale=jnp.zeros((num_pages, page_size, LATENT_DIM // FP8_TILE), jnp.float32) if has_scale else None,
        page_size=page_size)

  # ---- properties ---------------------------------------------------------------------------------------
  @property
  def dtype(self) -> str:
    """Format name: 'bfloat16', 'fp8_e4m3' or 'float32'."""
    lat = jnp.dtype(self.latent.dtype)
    for name, (lat_dt, _, _) in _FORMATS.items():
      if lat == jnp.dtype(lat_dt):
        return name
    raise ValueError(f"MLAKVCache latent dtype {lat} is not a known cache format {CACHE_DTYPES}")

  @property
  def num_pages(self) -> int:
    return self.latent.shape[-3]

  @property
  def bytes_per_token(self) -> int:
    return cache_bytes_per_token(self.dtype)

  def validate(self) -> None:
    """Raises ValueError if the arrays do not form one of the formats above (shapes, dtypes, page_size)."""
    name = self.dtype
    lat_dt, rope_dt, has_scale = _FORMATS[name]
    lat, rope = self.latent, self.rope
    if lat.ndim != 3 or lat.shape[-1] != LATENT_DIM:
      raise ValueError(f"MLAKVCache.latent must be [num_pages, page_size, {LATENT_DIM}], got {lat.shape}")
    if lat.shape[1] != self.page_size:
      raise ValueError(f"MLAKVCache.latent page axis {lat.shape[1]} != page_size {self.page_size}")
    if rope.shape != (*lat.shape[:2], ROPE_DIM) or jnp.dtype(rope.dtype) != jnp.dtype(rope_dt):
      raise ValueError(f"MLAKVCache.rope must be {jnp.dtype(rope_dt).name} {(*lat.shape[:2], ROPE_DIM)} for a "
                       f"{name} cache, got {jnp.dtype(rope.dtype).name} {rope.shape}")
    if has_scale:
      want = (*lat.shape[:2], LATENT_DIM // FP8_TILE)
      if self.scale is None or self.scale.shape != want or jnp.dtype(self.scale.dtype) != jnp.float32:
        got = None if self.scale is None else (jnp.dtype(self.scale.dtype).name, self.scale.shape)
        raise ValueError(f"an fp8_e4m3 MLAKVCache needs scale float32 {want}, got {got}")
    elif self.scale is not None:
      raise ValueError(f"a {name} MLAKVCache has no scale array, got one of shape {self.scale.shape}")

  # ---- writing ------------------------------------------------------------------------------------------
  def write(self, slots: jax.Array, latent: jax.Array, rope: jax.Array) -> "MLAKVCache":
    """Returns the cache with tokens written at slots (page * page_size + offset); fp8 quantizes here.

    slots int32 [T]; latent [T, 512]; rope [T, 64] (any float dtype; cast to the cache's). A negative slot
    skips its token (padding rows of a batch). Pure XLA scatters: use it inside a jitted step with the cache
    donated and the update happens in place. Duplicate slots in one call: one of the writes wins (unspecified).
    """
    self.validate()
    slots = jnp.asarray(slots)
    if slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
      raise ValueError(f"slots must be an integer vector [T], got {slots.dtype} {slots.shape}")
    t = slots.shape[0]
    if latent.shape != (t, LATENT_DIM):
      raise ValueError(f"latent must be [T={t}, {LATENT_DIM}] to match slots, got {latent.shape}")
    if rope.shape != (t, ROPE_DIM):
      raise ValueError(f"rope must be [T={t}, {ROPE_DIM}] to match slots, got {rope.shape}")
    for nm, x in (("latent", latent), ("rope", rope)):
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{nm} must be floating point, got {x.dtype}")
    ps = self.page_size
    capacity = self.num_pages * ps
    # Negative (padding) slots -> out of range, which mode="drop" skips. Python-style wrap-around of negative
    # indices would otherwise overwrite the last page.
    slots = jnp.where(slots < 0, capacity, slots.astype(jnp.int32))
    page, off = slots // ps, slots % ps

    def put(buf, rows):
      rows = rows.astype(buf.dtype)
      if buf.dtype == jnp.float8_e4m3fn:
        # Scatter the bits: XLA:CPU widens an fp8 scatter to f16 over the whole pool (145 ms for 17 MB, against
        # 0.06 ms for these bytes; mla_jax/engine/NOTES.md). The same bytes land either way.
        bits = jax.lax.bitcast_convert_type(buf, jnp.uint8).at[page, off].set(
            jax.lax.bitcast_convert_type(rows, jnp.uint8), mode="drop")
        return jax.lax.bitcast_convert_type(bits, buf.dtype)
      return buf.at[page, off].set(rows, mode="drop")

    if self.dtype == "fp8_e4m3":
      values, scale = quantize_fp8(latent)
      return dataclasses.replace(self, latent=put(self.latent, values), rope=put(self.rope, rope),
                                 scale=put(self.scale, scale))
    return dataclasses.replace(self, latent=put(self.latent, latent), rope=put(self.rope, rope))

  # ---- reading (the xla backend, the engine's prefill, tests) ------------------------------------------
  def gather(self, block_table: jax.Array, dtype=None) -> tuple[jax.Array, jax.Array]:
    """The tokens of the pages block_table [..., n] names, in order: (latent [..., n·ps, 512], rope [..., n·ps,
    64]). fp8 latents are dequantized (value × its tile's scale, in float32); the other arrays come as stored.
    dtype: cast both to it. Only the named pages are read, not the whole pool; entries must lie in
    [0, num_pages) (clamp or mask padding entries first). The one place pages are gathered and dequantized."""
    latent = self.latent[block_table]                                  # [..., n, ps, 512]
    if self.scale is not None:
      latent = dequantize_fp8(latent, self.scale[block_table])
    rope = self.rope[block_table]                                      # [..., n, ps, 64]
    tokens = (*block_table.shape[:-1], block_table.shape[-1] * self.page_size)
    latent, rope = latent.reshape(*tokens, LATENT_DIM), rope.reshape(*tokens, ROPE_DIM)
    if dtype is not None:
      latent, rope = latent.astype(dtype), rope.astype(dtype)
    return latent, rope

  def dequantize(self) -> tuple[jax.Array, jax.Array]:
    """(latent f32 [P, ps, 512], rope f32 [P, ps, 64]): the values the kernels compute with."""
    every_page = jnp.arange(self.num_pages, dtype=jnp.int32)[:, None]   # one page per row: [P, 1]
    return self.gather(every_page, jnp.float32)


def cache_bytes_per_token(dtype: str) -> int:
  """Bytes one token occupies in a cache of the named format (656 for fp8_e4m3, 1152 for bfloat16)."""
  lat_dt, rope_dt, has_scale = _FORMATS[check_cache_dtype(dtype)]
  n = LATENT_DIM * jnp.dtype(lat_dt).itemsize + ROPE_DIM * jnp.dtype(rope_dt).itemsize
  return n + (LATENT_DIM // FP8_TILE * 4 if has_scale else 0)

