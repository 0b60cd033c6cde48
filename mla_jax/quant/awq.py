"""AWQ 4-bit layers (AutoAWQ GEMM checkpoints, docs/architecture.md §6) with the weights resident as int4 on the
device, in the packed layout of the w4a16 kernels (pallas_kernels/w4a16, docs/architecture.md §4).

Storage (per quantized Linear [in, out] = [K, N], group size G; K padded to K_pad (a multiple of 256), N to N_pad
(a multiple of 64), padding weights exactly 0):
  packed  int32   [K_pad/8, N_pad]   eight unsigned 4-bit q per word, ordered for the kernels' decode
  scales  float16 [K_pad/G, N_pad]   as stored in the checkpoint
  zeros   uint8   [K_pad/G, N_pad]   the unsigned 4-bit zero point z
  W = (q - z) · s, computed in fp32 and rounded once to the model dtype (the kernels apply s and z per group to
  partial products in fp32).
The AutoAWQ tensors (qweight / qzeros int32 packed along N, scales) are converted once, by the loaders: the HF
loader on the host as it reads each tensor, scripts/convert.py when it writes a converted directory (manifest
version 2). Scales stay fp16 bit-exact (bf16/fp32 scales are accepted only when exactly fp16-representable).

Resident bytes of one quantized Linear: K_pad·N_pad·(1/2 + 3/G) (AutoAWQ's own: K·N·(1/2 + 5/(2G))). For a full
DeepSeek-V3 MoE layer (D=7168, H=128, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, E=256 experts and one
shared expert of I=2048) every dimension is already aligned, so `layer_resident_bytes(cfg)` is
  (187,105,280 attention + 11,318,329,344 expert weights) × (1/2 + 3/G):
  G=128 → 6,022,375,936 B (5.61 GiB);  G=64 → 6,292,034,560 B (5.86 GiB)
plus unquantized: router kernel fp32 D·E + bias fp32 E and four RMSNorm weights (D, D, 1536, 512) in 2 bytes.

Forward: `AWQLinear` is pallas_kernels.w4a16_matmul; `AWQExperts` (routed experts, gate and up stacked as the
two column halves of one weight `w13`) is pallas_kernels.w4a16_moe, which groups tokens by expert on the device
and reads only the experts in use. Backends follow pallas_kernels' rules ("auto": the Triton kernels for bf16 on a
CUDA GPU, the XLA dequantize-and-dot reference elsewhere); `configure_w4a16` sets them for a model.
"""
from __future__ import annotations

import functools
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from mla_jax import sharding
from mla_jax.checkpoint.targets import ParamTarget
from mla_jax.quant.pack import PACK, unpack_int4
from pallas_kernels.w4a16 import layout


class QuantWeight(nnx.Param):
    """Packed int4 weights, uint8 zeros and fp16 scales of an AWQ layer: Params (loaded, saved, sharded like any
    weight) that a trainer can leave out of differentiation with `nnx.All(nnx.Param, nnx.Not(QuantWeight))`."""


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
    if quant.group_size <= 0 or layout.CHUNK_K % quant.group_size:
        raise ValueError(f"{at}AWQ group_size={quant.group_size} is not supported: the packed int4 layout needs a "
                         f"group size that divides {layout.CHUNK_K} (AWQ checkpoints use 64 or 128).")


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


def _nibbles_from_packed(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols/8] AWQ-packed unsigned 4-bit values -> uint8 [rows, cols] (0..15)."""
    return unpack_int4(packed).astype(np.uint8)


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


def checkpoint_to_weight(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
                         group_size: int) -> layout.W4A16Weight:
    """One linear's AutoAWQ tensors -> host arrays in the packed layout (numpy inside a W4A16Weight)."""
    q, z = _nibbles_from_packed(qweight), _nibbles_from_packed(qzeros)
    return layout.pack(q, z, _scales_to_f16(scales), group_size, xp=np)


def _convert_packed(arr: np.ndarray, *, name: str, kind: str, in_features: int, group_size: int) -> np.ndarray:
    """Loader conversion of one checkpoint tensor (int32 packed qweight/qzeros, or scales) to the packed layout."""
    if kind == "scales":
        if arr.dtype not in (np.float16, np.float32) and str(arr.dtype) != "bfloat16":
            raise ValueError(f"{name} has dtype {arr.dtype}; AWQ scales must be float16 (or exactly "
                             f"float16-representable bf16/fp32)")
        try:
            s = _scales_to_f16(arr)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        return layout.pad_groups(s, in_features, group_size, np.float16, xp=np)
    if arr.dtype != np.int32:
        raise ValueError(f"{name} has dtype {arr.dtype}; AWQ {kind} must be int32 (eight packed 4-bit values)")
    nibbles = _nibbles_from_packed(arr)
    if kind == "qweight":
        return layout.pack_q(nibbles, xp=np)
    return layout.pad_groups(nibbles, in_features, group_size, np.uint8, xp=np)


# AWQ tensor -> our parameter suffix
_LEAVES = {"qweight": "packed", "qzeros": "zeros", "scales": "scales"}


def awq_linear_targets(quant, hf_module: str, module: tuple, param: str, in_features: int, out_features: int,
                       expert: Optional[int] = None) -> dict:
    """The loader hook (mla_jax.checkpoint.hf._linear): HF tensor name -> ParamTarget for one AWQ linear.

    AWQLinear params are packed/zeros/scales; an expert's (param = w_gate / w_up / w_down) go to the stacked
    AWQExperts params at index `expert`: gate and up to the two column halves of `w13_*`, down to `w2_*`."""
    check_awq_config(quant, hf_module)
    check_linear_shape(hf_module, in_features, out_features, quant.group_size)
    G = quant.group_size
    ng = in_features // G
    shapes = {"qweight": (in_features, out_features // PACK), "qzeros": (ng, out_features // PACK),
              "scales": (ng, out_features)}
    prefix, columns = "", None
    if expert is not None:
        if param not in ("w_gate", "w_up", "w_down"):
            raise ValueError(f"internal: AWQ expert parameter {param!r}")
        half = layout.padded_n(out_features)
        prefix = "w2_" if param == "w_down" else "w13_"
        columns = {"w_gate": (0, half), "w_up": (half, half), "w_down": None}[param]
    out = {}
    for leaf, shape in shapes.items():
        name = f"{hf_module}.{leaf}"
        out[name] = ParamTarget(module, prefix + _LEAVES[leaf], shape, expert=expert, quantizable=True,
                                columns=columns,
                                convert=functools.partial(_convert_packed, name=name, kind=leaf,
                                                          in_features=in_features, group_size=G))
    return out


# ----------------------------------------------------------------------------------------------------------------
# layers


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_packed(key, lead: tuple, n_in: int, n_out: int, group_size: int) -> layout.W4A16Weight:
    """Random packed weights: uniform 4-bit codes (random words), zero points 8 ± 2 and scales that make
    std(W) ~ 1/sqrt(in); scales and zeros are 0 in the padding, so padded rows and columns are exactly 0. Built
    in the packed layout directly (an unpacked int32 copy of a V3 expert stack would need 15 GB); the init."""
    kq, kz, ks = jax.random.split(key, 3)
    k_pad, n_pad, ng = layout.padded_k(n_in), layout.padded_n(n_out), n_in // group_size
    packed = jax.lax.bitcast_convert_type(
        jax.random.bits(kq, (*lead, k_pad // layout.NIBBLES, n_pad), jnp.uint32), jnp.int32)
    z = jax.random.randint(kz, (*lead, ng, n_out), 6, 10, jnp.int32)
    s = jax.random.uniform(ks, (*lead, ng, n_out), jnp.float32, 0.5, 1.5) / (4.6 * math.sqrt(n_in))
    return layout.W4A16Weight(packed=packed, scales=layout.pad_groups(s, n_in, group_size, jnp.float16),
                              zeros=layout.pad_groups(z, n_in, group_size, jnp.uint8), k=n_in, n=n_out,
                              group_size=group_size)


def _check_backend(backend: str) -> str:
    if backend not in pallas_kernels.w4a16.BACKEND_NAMES:
        raise ValueError(f"w4a16 backend {backend!r}: expected one of {pallas_kernels.w4a16.BACKEND_NAMES}")
    return backend


class AWQLinear(nnx.Module):
    """AWQ 4-bit Linear: y = x @ W, W = (q - z[g]) · s[g] [in, out]; fp32 accumulation, output in x.dtype.

    Same call contract as `mla_jax.model.layers.Linear`: x is cast to the model dtype `dtype` and multiplied by
    pallas_kernels.w4a16_matmul (backend `backend`, see configure_w4a16).
    """

    def __init__(self, quant, in_features: int, out_features: int, *, hf_name: str = "AWQLinear",
                 dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None, backend: str = "auto"):
        check_awq_config(quant, hf_name)
        check_linear_shape(hf_name, in_features, out_features, quant.group_size)
        self.hf_name = hf_name
        self.in_features, self.out_features = in_features, out_features
        self.group_size = quant.group_size
        self.dtype = jnp.dtype(dtype)
        self.backend = _check_backend(backend)
        self.interpret = False
        self.island = None            # (mesh, sharding.Layout) when the weights are split over devices
        key = rngs.params() if rngs is not None else jax.random.key(0)
        w = _random_packed(key, (), in_features, out_features, quant.group_size)
        self.packed = QuantWeight(w.packed)
        self.scales = QuantWeight(w.scales)
        self.zeros = QuantWeight(w.zeros)

    def weight(self) -> layout.W4A16Weight:
        return layout.W4A16Weight(packed=self.packed[...], scales=self.scales[...], zeros=self.zeros[...],
                                  k=self.in_features, n=self.out_features, group_size=self.group_size)

    def dequantized_kernel(self, dtype=None) -> jax.Array:
        """W [in, out] in `dtype` (default: the model dtype)."""
        return layout.dequantize(self.weight(), dtype or self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        if self.island is None:
            y = pallas_kernels.w4a16_matmul(flat, self.weight(), backend=self.backend, interpret=self.interpret)
        else:
            y = self._island_matmul(flat)
        return y.reshape(*x.shape[:-1], self.out_features).astype(x.dtype)

    def _island_matmul(self, x: jax.Array) -> jax.Array:
        """The matmul on each device's shard of the weights (a Pallas call needs per-device arrays): replicated
        weights — every device computes all rows (decode reads the weights once either way); column split —
        each device its output columns; row split — each device its K range, partial sums added in float32."""
        mesh, lay = self.island
        n = mesh.shape[sharding.AXIS]
        k, cols = self.in_features, self.out_features
        x_spec, out_spec, w_spec, reduce = P(), P(), P(), False
        if lay is sharding.Layout.COLUMN:
            w_spec, out_spec, cols = P(None, sharding.AXIS), P(None, sharding.AXIS), cols // n
        elif lay is sharding.Layout.ROW:
            w_spec, x_spec, k, reduce = P(sharding.AXIS), P(None, sharding.AXIS), k // n, True

        def body(x, packed, scales, zeros):
            w = layout.W4A16Weight(packed=packed, scales=scales, zeros=zeros, k=k, n=cols,
                                   group_size=self.group_size)
            y = pallas_kernels.w4a16_matmul(x, w, backend=self.backend, interpret=self.interpret,
                                            out_dtype=jnp.float32 if reduce else None)
            return jax.lax.psum(y, sharding.AXIS).astype(x.dtype) if reduce else y

        w = self.weight()
        return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, w_spec, w_spec), out_specs=out_spec,
                             check_vma=False)(x, w.packed, w.scales, w.zeros)


class AWQExperts(nnx.Module):
    """Routed experts of one MoE layer, AWQ 4-bit, stacked over the leading expert axis [E].

    Params: w13_{packed,scales,zeros} — gate [D, I] and up [D, I] as the two column halves of one packed weight
    [D -> 2·I_pad] (I_pad = I rounded up to 64: columns [0, I) gate, [I_pad, I_pad + I) up); w2_{...} — down
    [I -> D]. Layouts as AWQLinear. Same call contract as `mla_jax.model.moe.Experts`; the forward is
    pallas_kernels.w4a16_moe.
    """

    def __init__(self, quant, num_experts: int, hidden: int, intermediate: int, *,
                 hf_prefix: str = "AWQExperts", dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None,
                 backend: str = "auto"):
        check_awq_config(quant, hf_prefix)
        check_linear_shape(f"{hf_prefix}.*.gate_proj", hidden, intermediate, quant.group_size)
        check_linear_shape(f"{hf_prefix}.*.down_proj", intermediate, hidden, quant.group_size)
        self.hf_prefix = hf_prefix
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.group_size = G = quant.group_size
        self.dtype = jnp.dtype(dtype)
        self.backend = _check_backend(backend)
        self.interpret = False
        key = rngs.params() if rngs is not None else jax.random.key(0)
        kg, ku, kd = jax.random.split(key, 3)
        lead = (num_experts,)
        gate, up = (_random_packed(k, lead, hidden, intermediate, G) for k in (kg, ku))
        w2 = _random_packed(kd, lead, intermediate, hidden, G)
        cat = lambda a, b: jnp.concatenate([a, b], axis=-1)      # gate | up column halves
        self.w13_packed = QuantWeight(cat(gate.packed, up.packed))
        self.w13_scales = QuantWeight(cat(gate.scales, up.scales))
        self.w13_zeros = QuantWeight(cat(gate.zeros, up.zeros))
        self.w2_packed = QuantWeight(w2.packed)
        self.w2_scales = QuantWeight(w2.scales)
        self.w2_zeros = QuantWeight(w2.zeros)

    @property
    def padding_expert_index(self) -> int:
        """The expert index for (token, expert) pairs this module must not compute (under expert parallelism: pairs
        routed to another device's experts): num_experts, which w4a16_moe's routing drops, so such a pair gets no
        row and costs nothing."""
        return self.num_experts

    def weights(self) -> tuple[layout.W4A16Weight, layout.W4A16Weight]:
        """(w13 [E] gate|up, w2 [E] down) as the w4a16 ops take them."""
        half = layout.padded_n(self.intermediate)
        w13 = layout.W4A16Weight(packed=self.w13_packed[...], scales=self.w13_scales[...],
                                 zeros=self.w13_zeros[...], k=self.hidden, n=2 * half, group_size=self.group_size)
        w2 = layout.W4A16Weight(packed=self.w2_packed[...], scales=self.w2_scales[...], zeros=self.w2_zeros[...],
                                k=self.intermediate, n=self.hidden, group_size=self.group_size)
        return w13, w2

    def dequantized_expert(self, e: int, dtype=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(w_gate [D, I], w_up [D, I], w_down [I, D]) of expert e (default: in the model dtype; tests)."""
        dtype = dtype or self.dtype
        take = lambda w: layout.W4A16Weight(packed=w.packed[e], scales=w.scales[e], zeros=w.zeros[e], k=w.k,
                                            n=w.n, group_size=w.group_size)
        w13, w2 = self.weights()
        gu = layout.dequantize(take(w13), dtype)
        half, inter = layout.padded_n(self.intermediate), self.intermediate
        return gu[:, :inter], gu[:, half: half + inter], layout.dequantize(take(w2), dtype)

    def __call__(self, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array) -> jax.Array:
        """x [T, D], topk_idx int [T, K], topk_w [T, K] -> Σ_k w·down(silu(gate x)·up x)  [T, D] in x.dtype."""
        w13, w2 = self.weights()
        y = pallas_kernels.w4a16_moe(x.astype(self.dtype), topk_idx, topk_w.astype(jnp.float32), w13, w2,
                                     backend=self.backend, interpret=self.interpret)
        return y.astype(x.dtype)


def configure_w4a16(model: nnx.Module, *, backend: str = "auto", interpret: bool = False,
                    plan: Optional[sharding.ShardingPlan] = None) -> None:
    """Sets the w4a16 backend (and Pallas interpret mode) of every AWQ layer of `model` (in place; before
    nnx.split / jit), and, with a sharding plan over several devices, how each dense AWQ linear runs on its
    weights' shards.

    A Pallas call cannot take arrays sharded outside shard_map, so under a plan each AWQLinear gets a shard_map
    island for its partition rule (`AWQLinear._island_matmul`) when its shards are whole kernel tiles: a column
    split needs N a multiple of 64·devices, a row split K a multiple of 256·devices (no padding inside a shard).
    Other shapes use the XLA reference (it dequantizes their weights transiently). The routed experts already
    run inside the expert-parallel island and keep `backend`.
    """
    _check_backend(backend)
    for path, m in nnx.iter_modules(model):
        if not isinstance(m, (AWQLinear, AWQExperts)):
            continue
        m.backend, m.interpret = backend, bool(interpret)
        if isinstance(m, AWQLinear):
            m.island = None if plan is None else island_for(plan, sharding.path_str(tuple(path)), m)
            if plan is not None and plan.num_devices > 1 and m.island is None:
                m.backend = "xla"


def island_for(plan: sharding.ShardingPlan, module_path: str, m: AWQLinear):
    """(mesh, layout) of the shard_map island AWQLinear `m` at `module_path` runs in under `plan`, or None: one
    device, or shards that are not whole kernel tiles (see configure_w4a16)."""
    n = plan.num_devices
    if n == 1:
        return None
    lay = sharding.layout_for(f"{module_path}/packed", plan.data_parallel_attention)
    fits = {sharding.Layout.REPLICATED: True,
            sharding.Layout.COLUMN: m.out_features % (layout.ALIGN_N * n) == 0,
            sharding.Layout.ROW: m.in_features % (layout.CHUNK_K * n) == 0}.get(lay, False)
    return (plan.mesh, lay) if fits else None


# ----------------------------------------------------------------------------------------------------------------
# resident bytes


def linear_resident_bytes(in_features: int, out_features: int, group_size: int) -> int:
    """Packed int4 weights + fp16 scales + uint8 zeros of one AWQ linear [in, out], padding included."""
    k, n = layout.padded_k(in_features), layout.padded_n(out_features)
    return k * n // 2 + (k // group_size) * n * 3


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
