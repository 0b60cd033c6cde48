"""AWQ 4-bit layers (AutoAWQ GEMM checkpoints, docs/architecture.md §6) with the weights resident as int4 on the
device.

Storage (per quantized Linear [in, out], group size G):
  qweight  jnp.int4 [in, out]      q - 8, logical column order (unpacked from the checkpoint's int32 [in, out/8])
  qzeros   jnp.int4 [in/G, out]    z - 8
  scales   float16  [in/G, out]    as stored in the checkpoint
  W = (q - z) · s = ((q-8) - (z-8)) · s, so the offset cancels exactly.
Why unpacked signed int4 and not the checkpoint's packed int32: XLA stores int4 arrays packed two per byte on
GPU (the same 0.5 B/weight as the int32 packing), and an s4 operand is what XLA's GPU GEMM emitter knows how to
fuse (convert → subtract → multiply → dot) without materialising W; the int32 layout would need shifts and an
interleaved [.., 8] -> [..] reshape in front of every dot. Signed rather than unsigned because s4 is XLA's
well-trodden int4 type, and orbax/tensorstore can write int4 but not uint4. Scales stay fp16 (the checkpoint's
values, no rounding to bf16): the dequantization is computed in fp32 and W is rounded once, to the model dtype.

Resident bytes of one quantized Linear [in, out]:
  in·out/2 (int4 weights) + (in/G)·out·2 (fp16 scales) + (in/G)·out/2 (int4 zeros)  =  in·out·(1/2 + 5/(2G)).
For a full DeepSeek-V3 MoE layer (D=7168, H=128, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, E=256
experts and 1 shared expert of I=2048), `layer_resident_bytes(cfg)` sums:
  attention  D·1536 + 1536·H·192 + D·576 + 512·H·256 + H·128·D          =    187,105,280 weights
  experts    (E + 1) · 3·D·I                                               = 11,318,329,344 weights
  × (1/2 + 5/(2G)) bytes:  G=128 → 5,977,432,832 B (5.57 GiB);  G=64 → 6,202,148,352 B (5.78 GiB)
plus unquantized: router kernel fp32 D·E + bias fp32 E and four RMSNorm weights (D, D, 1536, 512) in 2 bytes:
7,373,824 B. Without quantization the same layer in bf16 is 2·11,505,434,624 B = 21.4 GiB (3.7× more).

Routed experts (`AWQExperts`): stacked [E, ...] int4 params; the forward never dequantizes more than
`tiles_per_step` experts at a time. (token, expert) assignments are sorted by expert and cut into tiles of C
rows of one expert each (C <= T; an expert with more than C tokens gets several tiles). A loop over the tiles that
exist, `tiles_per_step` per iteration, gathers those experts' int4 weights, dequantizes them and runs the gated
MLP on the tile's rows; results are weighted and scatter-added into the output. Cost per decode step: the int4
bytes of the experts the tokens route to (each read once per tile) plus a transient bf16 copy of at most
`tiles_per_step` experts (8 × 3·D·I·2 B = 704 MB for V3 at the default 8); compute is C rows per tile, so no
T-times dense work over all experts. Tiles are bounded statically by ceil(T·K/C) + min(E, T·K); only the used
ones are iterated (a while loop with a data-dependent trip count).
"""
from __future__ import annotations

import functools
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.checkpoint.targets import ParamTarget
from mla_jax.quant.pack import PACK, unpack_int4

INT4_OFFSET = 8  # stored int4 value = unsigned 4-bit value - 8


class QuantWeight(nnx.Param):
    """int4 weights/zeros and fp16 scales of an AWQ layer: Params (loaded, saved, sharded like any weight) that a
    trainer can leave out of differentiation with `nnx.All(nnx.Param, nnx.Not(QuantWeight))`."""


# ----------------------------------------------------------------------------------------------------------------
# validation


def check_awq_config(quant, where: str = "") -> None:
    """Raise ValueError unless `quant` (mla_jax.config.AWQConfig) describes what we implement."""
    at = f"{where}: " if where else ""
    if quant.bits != 4:
        raise ValueError(f"{at}AWQ bits={quant.bits} is not supported; only 4-bit AutoAWQ GEMM checkpoints are.")
    if not quant.zero_point:
        raise ValueError(f"{at}AWQ zero_point=false (symmetric) is not supported; only zero-point AWQ "
                         f"(AutoAWQ's default) checkpoints are.")
    if str(quant.version).lower() != "gemm":
        raise ValueError(f"{at}AWQ version={quant.version!r} is not supported; only the 'gemm' packing is.")
    if quant.group_size <= 0:
        raise ValueError(f"{at}AWQ group_size={quant.group_size} must be positive.")


def check_linear_shape(hf_name: str, in_features: int, out_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(f"{hf_name}: AWQ group_size {group_size} does not divide in_features {in_features}; "
                         f"this layer cannot be AWQ-quantized with that group size (list it in "
                         f"modules_to_not_convert or re-quantize with a group size that divides {in_features}).")
    if out_features % PACK:
        raise ValueError(f"{hf_name}: out_features {out_features} is not a multiple of 8; the AWQ GEMM format "
                         f"packs 8 output columns per int32, so this layer cannot be AWQ-quantized.")


def validate_checkpoint_tensors(hf_name: str, in_features: int, out_features: int, group_size: int,
                                tensors: Mapping[str, np.ndarray]) -> None:
    """Check one AWQ linear's checkpoint tensors {qweight, qzeros, scales} (names without the module prefix)."""
    check_linear_shape(hf_name, in_features, out_features, group_size)
    ng = in_features // group_size
    want = {
        "qweight": ((in_features, out_features // PACK), ("int32",)),
        "qzeros": ((ng, out_features // PACK), ("int32",)),
        "scales": ((ng, out_features), ("float16", "bfloat16", "float32")),
    }
    for leaf, (shape, dtypes) in want.items():
        if leaf not in tensors:
            have = ", ".join(sorted(tensors)) or "nothing"
            raise ValueError(f"{hf_name}.{leaf} is missing from the AWQ checkpoint (found {have} for this module); "
                             f"an AutoAWQ GEMM linear needs qweight, qzeros and scales.")
        t = tensors[leaf]
        if tuple(t.shape) != shape:
            raise ValueError(f"{hf_name}.{leaf} has shape {tuple(t.shape)}, expected {shape} for an AWQ linear "
                             f"[{in_features} -> {out_features}] with group_size {group_size}.")
        if str(t.dtype) not in dtypes:
            raise ValueError(f"{hf_name}.{leaf} has dtype {t.dtype}, expected {' or '.join(dtypes)}.")


def _int4_from_packed(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols/8] AWQ-packed unsigned 4-bit values -> int4 [rows, cols] holding value - 8."""
    return (unpack_int4(packed).astype(np.int8) - INT4_OFFSET).astype(jnp.int4)


def _scales_to_f16(scales: np.ndarray) -> np.ndarray:
    """AWQ scales as float16, bit-exact; raises if a bf16/fp32 value is not exactly a float16."""
    s = np.asarray(scales)
    if s.dtype != np.float16:
        s16 = s.astype(np.float16)
        if not np.array_equal(s16.astype(np.float32), s.astype(np.float32)):
            raise ValueError(f"AWQ scales of dtype {s.dtype} are not exactly representable in float16; "
                             f"mla_jax keeps AWQ scales in float16")
        s = s16
    return s


def checkpoint_to_params(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray):
    """Checkpoint tensors -> host arrays in our layout: (q-8 int4 [in, out], z-8 int4 [in/G, out], scales fp16).

    fp16 scales are kept bit-exact; bf16/fp32 scales (some exporters) are converted to fp16 only when that is
    exact, otherwise this raises rather than change the weights."""
    return _int4_from_packed(qweight), _int4_from_packed(qzeros), _scales_to_f16(scales)


def _convert_packed(arr: np.ndarray, *, name: str, kind: str) -> np.ndarray:
    """Loader conversion of one checkpoint tensor (int32 packed qweight/qzeros, or scales) to our layout."""
    if kind == "scales":
        if arr.dtype not in (np.float16, np.float32) and str(arr.dtype) != "bfloat16":
            raise ValueError(f"{name} has dtype {arr.dtype}; AWQ scales must be float16 (or exactly "
                             f"float16-representable bf16/fp32)")
        try:
            return _scales_to_f16(arr)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if arr.dtype != np.int32:
        raise ValueError(f"{name} has dtype {arr.dtype}; AWQ {kind} must be int32 (eight packed 4-bit values)")
    return _int4_from_packed(arr)


def awq_linear_targets(quant, hf_module: str, module: tuple, param: str, in_features: int, out_features: int,
                       expert: Optional[int] = None) -> dict:
    """The loader hook (mla_jax.checkpoint.hf._linear): HF tensor name -> ParamTarget for one AWQ linear.

    AWQLinear params are qweight/qzeros/scales; an expert's go to the stacked AWQExperts params
    `{param}_qweight` etc. (param = w_gate / w_up / w_down) at index `expert`."""
    check_awq_config(quant, hf_module)
    check_linear_shape(hf_module, in_features, out_features, quant.group_size)
    ng = in_features // quant.group_size
    shapes = {"qweight": (in_features, out_features // PACK), "qzeros": (ng, out_features // PACK),
              "scales": (ng, out_features)}
    out = {}
    for leaf, shape in shapes.items():
        name = f"{hf_module}.{leaf}"
        out[name] = ParamTarget(module, leaf if expert is None else f"{param}_{leaf}", shape, expert=expert,
                                quantizable=True, convert=functools.partial(_convert_packed, name=name, kind=leaf))
    return out


# ----------------------------------------------------------------------------------------------------------------
# dequantization


def dequantize(q: jax.Array, z: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """(q - z[g]) · s[g] for q [..., in, out] int4 and z, s [..., in/G, out]; fp32 math, result in `dtype`."""
    *lead, n_in, n_out = q.shape
    ng = z.shape[-2]
    qg = q.astype(jnp.float32).reshape(*lead, ng, n_in // ng, n_out)
    w = (qg - z.astype(jnp.float32)[..., :, None, :]) * s.astype(jnp.float32)[..., :, None, :]
    return w.reshape(*lead, n_in, n_out).astype(dtype)


def _precision(dtype):
    # fp32 models get true fp32 matmuls (no TF32) so that they match fp32 references; 16-bit ones the default.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_awq(key, lead: tuple, n_in: int, n_out: int, group_size: int):
    """Random int4 weights with realistic zero points and scales (std(W) ~ 1/sqrt(in)); used as the init."""
    kq, kz, ks = jax.random.split(key, 3)
    ng = n_in // group_size
    q = jax.random.randint(kq, (*lead, n_in, n_out), -8, 8, jnp.int32).astype(jnp.int4)
    z = jax.random.randint(kz, (*lead, ng, n_out), -2, 2, jnp.int32).astype(jnp.int4)  # z ≈ 8 ± 2
    s = jax.random.uniform(ks, (*lead, ng, n_out), jnp.float32, 0.5, 1.5) / (4.6 * math.sqrt(n_in))
    return q, z, s.astype(jnp.float16)


class AWQLinear(nnx.Module):
    """AWQ 4-bit Linear: y = x @ W, W = (q - z[g]) · s[g] [in, out]; fp32 accumulation, output in x.dtype.

    Same call contract as `mla_jax.model.layers.Linear`: x is cast to the model dtype `dtype`, W is dequantized
    (in fp32, rounded once to `dtype`) and multiplied. Plain XLA: dequantize then dot (XLA may fuse the int4
    convert into the GEMM on GPU; scripts/bench_awq_layer.py measures it).
    """

    def __init__(self, quant, in_features: int, out_features: int, *, hf_name: str = "AWQLinear",
                 dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None):
        check_awq_config(quant, hf_name)
        check_linear_shape(hf_name, in_features, out_features, quant.group_size)
        self.hf_name = hf_name
        self.in_features, self.out_features = in_features, out_features
        self.group_size = quant.group_size
        self.dtype = jnp.dtype(dtype)
        key = rngs.params() if rngs is not None else jax.random.key(0)
        q, z, s = _random_awq(key, (), in_features, out_features, quant.group_size)
        self.qweight = QuantWeight(q)
        self.qzeros = QuantWeight(z)
        self.scales = QuantWeight(s)

    def dequantized_kernel(self, dtype=None) -> jax.Array:
        """W [in, out] in `dtype` (default: the model dtype)."""
        return dequantize(self.qweight[...], self.qzeros[...], self.scales[...], dtype or self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.dequantized_kernel()
        y = jnp.dot(x.astype(self.dtype), w, preferred_element_type=jnp.float32, precision=_precision(self.dtype))
        return y.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# routed experts


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_plan(num_tokens: int, top_k: int, num_experts: int, tiles_per_step: int) -> tuple[int, int]:
    """Static (rows_per_tile C, number of tile slots) for T tokens, K experts each, E experts.

    C <= T (an expert sees each token at most once); about 2·T·K/E rows per tile, at least 8, at most 256, so
    decode tiles are small (weight-read bound) and prefill tiles are GEMM-sized. Tile slots:
    ceil(T·K/C) + min(E, T·K) bounds Σ_e ceil(count_e / C), rounded up to a multiple of tiles_per_step."""
    P = num_tokens * top_k
    C = max(1, min(num_tokens, 256, max(8, _pow2ceil(-(-2 * P // num_experts)))))
    n_tiles = -(-P // C) + min(num_experts, P)
    B = max(1, min(tiles_per_step, n_tiles))
    return C, -(-n_tiles // B) * B


def route_tiles(topk_idx: jax.Array, topk_w: jax.Array, num_experts: int, rows_per_tile: int, n_tiles: int):
    """Sort (token, expert) pairs by expert and cut them into tiles of `rows_per_tile` rows of one expert.

    Returns expert [n_tiles] int32, token [n_tiles, C] int32, weight [n_tiles, C] fp32 (0 for padding rows),
    valid [n_tiles, C] bool, n_used (number of real tiles; tiles >= n_used are padding)."""
    T, K = topk_idx.shape
    E, C, P = num_experts, rows_per_tile, T * K
    e = topk_idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(e, stable=True)                        # pair indices grouped by expert
    count = jnp.bincount(e, length=E).astype(jnp.int32)        # [E] rows per expert
    row_start = jnp.cumsum(count) - count                      # first sorted row of each expert
    n_chunks = (count + C - 1) // C                            # tiles per expert
    tile_end = jnp.cumsum(n_chunks)                            # inclusive end (in tiles) per expert
    tile_start = tile_end - n_chunks
    n_used = tile_end[-1]
    j = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), E - 1).astype(jnp.int32)
    first_row = row_start[expert] + (j - tile_start[expert]) * C
    rows = first_row[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]          # [n_tiles, C] sorted rows
    valid = (rows < (row_start[expert] + count[expert])[:, None]) & (j < n_used)[:, None]
    pair = order[jnp.clip(rows, 0, P - 1)]
    token = (pair // K).astype(jnp.int32)
    weight = jnp.where(valid, topk_w.reshape(-1).astype(jnp.float32)[pair], 0.0)
    return expert, token, weight, valid, n_used


class AWQExperts(nnx.Module):
    """Routed experts of one MoE layer, AWQ 4-bit, stacked: {gate,up}_* [E, D, I], down_* [E, I, D].

    Params per projection p in (gate, up, down): w_p_qweight int4 [E, in, out], w_p_qzeros int4 [E, in/G, out],
    w_p_scales fp16 [E, in/G, out] (layouts as AWQLinear; `Experts.w_p` is the unquantized counterpart).
    Same call contract as `mla_jax.model.moe.Experts`.
    See the module docstring for the tiling strategy and its cost.
    """


    def __init__(self, quant, num_experts: int, hidden: int, intermediate: int, *,
                 hf_prefix: str = "AWQExperts", dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None,
                 tiles_per_step: int = 8):
        check_awq_config(quant, hf_prefix)
        check_linear_shape(f"{hf_prefix}.*.gate_proj", hidden, intermediate, quant.group_size)
        check_linear_shape(f"{hf_prefix}.*.down_proj", intermediate, hidden, quant.group_size)
        self.hf_prefix = hf_prefix
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.group_size = quant.group_size
        self.dtype = jnp.dtype(dtype)
        self.tiles_per_step = int(tiles_per_step)
        key = rngs.params() if rngs is not None else jax.random.key(0)
        for name, k, (n_in, n_out) in zip(("gate", "up", "down"), jax.random.split(key, 3),
                                          ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))):
            q, z, s = _random_awq(k, (num_experts,), n_in, n_out, quant.group_size)
            setattr(self, f"w_{name}_qweight", QuantWeight(q))
            setattr(self, f"w_{name}_qzeros", QuantWeight(z))
            setattr(self, f"w_{name}_scales", QuantWeight(s))

    @property
    def padding_expert_index(self) -> int:
        """The expert index for (token, expert) pairs this module must not compute (under expert parallelism: pairs
        routed to another device's experts): num_experts, which route_tiles' per-expert counts leave out, so such a
        pair lands in no tile and costs nothing."""
        return self.num_experts

    def _weights(self, name: str, experts: jax.Array) -> jax.Array:
        """Dequantized weights of the given experts: [len(experts), in, out] in the model dtype."""
        take = lambda p: jnp.take(getattr(self, f"w_{name}_{p}")[...], experts, axis=0)
        return dequantize(take("qweight"), take("qzeros"), take("scales"), self.dtype)

    def dequantized_expert(self, e: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(w_gate [D, I], w_up [D, I], w_down [I, D]) of expert e in the model dtype (tests, debugging)."""
        idx = jnp.asarray([e])
        return tuple(self._weights(n, idx)[0] for n in ("gate", "up", "down"))

    def __call__(self, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array) -> jax.Array:
        """x [T, D], topk_idx int [T, K], topk_w [T, K] -> Σ_k w·down(silu(gate x)·up x)  [T, D] in x.dtype."""
        T, K = topk_idx.shape
        D = x.shape[-1]
        if T == 0:
            return jnp.zeros((0, D), x.dtype)
        C, n_tiles = tile_plan(T, K, self.num_experts, self.tiles_per_step)
        B = min(self.tiles_per_step, n_tiles)
        expert, token, weight, valid, n_used = route_tiles(topk_idx, topk_w, self.num_experts, C, n_tiles)
        xc = x.astype(self.dtype)
        prec = _precision(self.dtype)

        def step(i, acc):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * B, B, axis=0)
            ex, tok, w, ok = sl(expert), sl(token), sl(weight), sl(valid)   # [B], [B, C] ...
            xb = xc[tok]                                                      # [B, C, D]
            g = jnp.einsum("bcd,bdi->bci", xb, self._weights("gate", ex),
                           preferred_element_type=jnp.float32, precision=prec).astype(x.dtype)
            u = jnp.einsum("bcd,bdi->bci", xb, self._weights("up", ex),
                           preferred_element_type=jnp.float32, precision=prec).astype(x.dtype)
            h = (jax.nn.silu(g) * u).astype(self.dtype)
            y = jnp.einsum("bci,bid->bcd", h, self._weights("down", ex),
                           preferred_element_type=jnp.float32, precision=prec).astype(x.dtype)
            y = jnp.where(ok[..., None], y.astype(jnp.float32) * w[..., None], 0.0)
            return acc.at[tok.reshape(-1)].add(y.reshape(-1, D))

        n_steps = (n_used + B - 1) // B
        acc = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((T, D), jnp.float32))
        return acc.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# resident bytes


def linear_resident_bytes(in_features: int, out_features: int, group_size: int) -> int:
    """int4 weights + fp16 scales + int4 zeros of one AWQ linear [in, out]."""
    ng = in_features // group_size
    return in_features * out_features // 2 + ng * out_features * 2 + ng * out_features // 2


def layer_linear_shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """{name: (count, in, out)} of the quantized linears of one MoE decoder layer of `cfg` (a ModelConfig)."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    N, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    shapes = {}
    if cfg.q_lora_rank:
        shapes["q_a_proj"] = (1, D, cfg.q_lora_rank)
        shapes["q_b_proj"] = (1, cfg.q_lora_rank, H * (N + R))
    else:
        shapes["q_proj"] = (1, D, H * (N + R))
    shapes["kv_a_proj_with_mqa"] = (1, D, C + R)
    shapes["kv_b_proj"] = (1, C, H * (N + V))
    shapes["o_proj"] = (1, H * V, D)
    I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    shapes["experts.gate_up"] = (2 * E, D, I)
    shapes["experts.down"] = (E, I, D)
    if cfg.n_shared_experts:
        Is = I * cfg.n_shared_experts
        shapes["shared_experts.gate_up"] = (2, D, Is)
        shapes["shared_experts.down"] = (1, Is, D)
    return shapes


def layer_resident_bytes(cfg, group_size: Optional[int] = None) -> dict[str, int]:
    """Resident bytes of one AWQ MoE decoder layer: {"quantized", "unquantized", "total"} (unquantized = router
    kernel + bias in fp32, RMSNorm weights in 2 bytes)."""
    G = group_size or cfg.quantization.group_size
    quantized = sum(n * linear_resident_bytes(i, o, G) for n, i, o in layer_linear_shapes(cfg).values())
    D, E = cfg.hidden_size, cfg.n_routed_experts
    norms = 2 * D + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    unquantized = 4 * (D * E + E) + 2 * norms
    return {"quantized": quantized, "unquantized": unquantized, "total": quantized + unquantized}
