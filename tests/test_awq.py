"""AWQ 4-bit: packing against AutoAWQ's from_linear (re-implemented here independently), int4 AWQLinear and
AWQExperts against dense references, loading AWQ checkpoints made by our packer from the HF fixtures, and
validation errors."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mla_jax.checkpoint.load import load_model
from mla_jax.config import AWQConfig, ModelConfig
from mla_jax.model.layers import Linear
from mla_jax.model.moe import Experts
from mla_jax.quant import awq, pack
from pallas_kernels.w4a16 import layout

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
V3 = os.path.join(FIXTURES, "v3_yarn")


call = nnx.jit(lambda module, *args: module(*args))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------------------------
# An independent transcription of AutoAWQ (pseudo_quantize_tensor + WQLinear_GEMM.from_linear), loops and all,
# in numpy with the fp16 scales that from_linear stores.


def autoawq_reference(weight: np.ndarray, group_size: int):
    w = weight.astype(np.float32)
    out_f, in_f = w.shape
    g = w.reshape(-1, group_size)
    max_val, min_val = g.max(axis=1, keepdims=True), g.min(axis=1, keepdims=True)
    scales = (np.clip(max_val - min_val, 1e-5, None) / 15).astype(np.float16).astype(np.float32)
    zeros = np.clip(-np.round(min_val / scales), 0, 15)
    fake = ((np.clip(np.round(g / scales) + zeros, 0, 15) - zeros) * scales).reshape(out_f, in_f)
    scales = scales.reshape(out_f, -1).T.copy()              # [in/G, out]
    zeros = zeros.reshape(out_f, -1).T.copy()
    scale_zeros = zeros * scales
    intweight = np.stack([np.round((fake[:, i] + scale_zeros[i // group_size]) / scales[i // group_size])
                          for i in range(in_f)], axis=1).astype(np.int64).T      # [in, out]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = np.zeros((in_f, out_f // 8), np.int64)
    for col in range(out_f // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    qzeros = np.zeros((in_f // group_size, out_f // 8), np.int64)
    zi = zeros.astype(np.int64)
    for col in range(out_f // 8):
        for i in range(8):
            qzeros[:, col] |= zi[:, col * 8 + order_map[i]] << (i * 4)
    to_i32 = lambda a: a.astype(np.uint32).view(np.int32)
    return to_i32(qweight), to_i32(qzeros), scales.astype(np.float16)


def test_pack_order_known_answer():
    # docs/architecture.md §6: logical column n sits at bit shift 4·[0,4,1,5,2,6,3,7][n % 8].
    vals = np.arange(8, dtype=np.int64)[None, :]
    assert np.uint32(pack.pack_int4(vals)[0, 0].view(np.uint32)) == 0x75316420
    rng = np.random.default_rng(0)
    v = rng.integers(0, 16, (3, 16))
    p = pack.pack_int4(v).view(np.uint32)
    for n in range(16):
        shift = 4 * [0, 4, 1, 5, 2, 6, 3, 7][n % 8]
        np.testing.assert_array_equal((p[:, n // 8] >> shift) & 0xF, v[:, n])


def test_unpack_pack_exact():
    rng = np.random.default_rng(1)
    v = rng.integers(0, 16, (37, 64))
    v[0], v[1] = 0, 15
    np.testing.assert_array_equal(pack.unpack_int4(pack.pack_int4(v)), v)
    p = rng.integers(-2**31, 2**31, (5, 9), dtype=np.int64).astype(np.int32)   # every bit pattern
    np.testing.assert_array_equal(pack.pack_int4(pack.unpack_int4(p)), p)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack.pack_int4(np.zeros((2, 12), np.int64))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack.pack_int4(np.full((1, 8), 16))


@pytest.mark.parametrize("group_size", [8, 32])
def test_packer_matches_autoawq_from_linear(group_size):
    rng = np.random.default_rng(group_size)
    w = rng.normal(0.0, 0.05, (48, 64)).astype(np.float32)
    w[:, :group_size] *= 20          # one group with a much larger range
    w[3, :] = 0.125                  # constant rows: the 1e-5 clamp
    got = pack.pack_linear(w, group_size)
    qw, qz, s = autoawq_reference(w, group_size)
    np.testing.assert_array_equal(got["scales"], s)
    np.testing.assert_array_equal(got["qzeros"], qz)
    np.testing.assert_array_equal(got["qweight"], qw)
    assert got["qweight"].dtype == np.int32 and got["scales"].dtype == np.float16
    deq = pack.dequantize_packed(got["qweight"], got["qzeros"], got["scales"], group_size)   # [in, out]
    step = np.repeat(s.astype(np.float32), group_size, axis=0)
    straddle = np.repeat((w.reshape(48, -1, group_size).min(-1) < 0) & (w.reshape(48, -1, group_size).max(-1) > 0),
                         group_size, axis=1).T                      # [in, out]
    # Round-to-nearest error bound where a group straddles 0 (AutoAWQ clamps z to [0, 15], so one-signed
    # groups such as the constant row clip instead).
    assert np.all((np.abs(deq - w.T) <= step * 1.5 + 1e-7)[straddle])
    assert straddle.mean() > 0.9


def distinct_topk(rng, T: int, K: int, E: int, always=None) -> np.ndarray:
    """[T, K] int32 of distinct experts per token; `always` (if given) is every token's first choice."""
    rows = []
    for _ in range(T):
        perm = [e for e in rng.permutation(E) if e != always]
        rows.append(([always] if always is not None else []) + perm[: K - (always is not None)])
    return np.asarray(rows, np.int32).reshape(T, K)


def _awq_linear(w: np.ndarray, group_size: int, dtype=jnp.float32) -> awq.AWQLinear:
    n_out, n_in = w.shape
    layer = nnx.eval_shape(lambda: awq.AWQLinear(AWQConfig(group_size=group_size), n_in, n_out, dtype=dtype))
    t = pack.pack_linear(w, group_size)
    packed = awq.checkpoint_to_weight(t["qweight"], t["qzeros"], t["scales"], group_size)
    layer.packed.set_value(jnp.asarray(packed.packed))
    layer.zeros.set_value(jnp.asarray(packed.zeros))
    layer.scales.set_value(jnp.asarray(packed.scales))
    return layer, pack.dequantize_packed(t["qweight"], t["qzeros"], t["scales"], group_size)


def test_random_init_is_valid_awq():
    # The init (used by benchmarks that build layers on the device) gives 4-bit codes, zeros near 8 and scales
    # that make std(W) about 1/sqrt(in), in the packed layout.
    layer = awq.AWQLinear(AWQConfig(group_size=64), 256, 64, rngs=nnx.Rngs(0))
    assert layer.packed.dtype == jnp.int32 and layer.scales.dtype == jnp.float16 and layer.zeros.dtype == jnp.uint8
    z = np.asarray(layer.zeros[...])
    assert 6 <= z.min() and z.max() <= 9
    w = np.asarray(layer.dequantized_kernel())
    assert 0.5 < w.std() * np.sqrt(256) < 2.0


def test_awq_linear_matches_dequantized_matmul():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.1, (40, 96)).astype(np.float32)
    layer, W = _awq_linear(w, 32)
    # K = 96 padded to one 256-row chunk (32 words), N = 40 padded to 64 columns
    assert layer.packed.shape == (32, 64) and layer.packed.dtype == jnp.int32
    assert layer.zeros.shape == (8, 64) and layer.zeros.dtype == jnp.uint8
    assert layer.scales.shape == (8, 64) and layer.scales.dtype == jnp.float16
    x = rng.normal(size=(2, 5, 96)).astype(np.float32)
    y = layer(jnp.asarray(x))
    assert y.shape == (2, 5, 40) and y.dtype == jnp.float32
    assert rel_err(y, x.astype(np.float64) @ W) < 1e-6
    np.testing.assert_array_equal(np.asarray(layer.dequantized_kernel()), W)
    # bf16 model: W rounded once to bf16, bf16 inputs, fp32 accumulation, bf16 output.
    layer16, _ = _awq_linear(w, 32, dtype=jnp.bfloat16)
    y16 = layer16(jnp.asarray(x, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert rel_err(y16.astype(jnp.float32), x @ W) < 1e-2


def _experts_pair(E, D, I, G, dtype=jnp.float32, seed=0):
    """AWQExperts with random 4-bit params (built abstractly, filled from numpy: no per-op compiles) and the
    model's dense Experts holding the same weights dequantized in numpy."""
    rng = np.random.default_rng(seed)
    ex = nnx.eval_shape(lambda: awq.AWQExperts(AWQConfig(group_size=G), E, D, I, dtype=dtype))
    dense = nnx.eval_shape(lambda: Experts(E, D, I, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    qzs = {}
    for name, (n_in, n_out) in (("gate", (D, I)), ("up", (D, I)), ("down", (I, D))):
        q = rng.integers(0, 16, (E, n_in, n_out))
        z = rng.integers(5, 11, (E, n_in // G, n_out))
        s = (rng.uniform(0.5, 1.5, (E, n_in // G, n_out)) / (4.6 * np.sqrt(n_in))).astype(np.float16)
        qzs[name] = (q, z, s)
        w = (q - np.repeat(z, G, axis=1)) * np.repeat(s.astype(np.float32), G, axis=1)
        getattr(dense, f"w_{name}").set_value(jnp.asarray(w.astype(np.float32)))
    w13 = layout.pack_gate_up(qzs["gate"], qzs["up"], G, xp=np)
    w2 = layout.pack(*qzs["down"], G, xp=np)
    for name, w in (("w13", w13), ("w2", w2)):
        for leaf in ("packed", "scales", "zeros"):
            getattr(ex, f"{name}_{leaf}").set_value(jnp.asarray(getattr(w, leaf)))
    return ex, dense


@pytest.mark.parametrize("T,skew", [(0, False), (1, False), (3, False), (5, False), (37, True)])
def test_awq_experts_match_dense_experts(T, skew):
    E, D, I, K = 16, 32, 16, 2
    ex, dense = _experts_pair(E, D, I, 16)
    rng = np.random.default_rng(T)
    idx = distinct_topk(rng, T, K, E, always=2 if skew else None)   # skew: expert 2 gets more rows than a block
    w = rng.random((T, K)).astype(np.float32)
    x = rng.normal(size=(T, D)).astype(np.float32)
    got = call(ex, jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w))
    want = call(dense, jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w))
    assert got.shape == (T, D) and got.dtype == jnp.float32
    if T:
        assert rel_err(got, want) < 1e-6
    # the stored weights are the dense ones, expert by expert
    for e in (0, E - 1):
        for a, b in zip(ex.dequantized_expert(e), (dense.w_gate[e], dense.w_up[e], dense.w_down[e])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_awq_experts_triton_interpret_matches_xla():
    # The model's expert module through the Pallas Triton kernel (interpret mode) and through the XLA reference.
    E, D, I, K, T = 8, 64, 64, 2, 11
    ex, _ = _experts_pair(E, D, I, 32, dtype=jnp.bfloat16, seed=3)
    rng = np.random.default_rng(11)
    idx = jnp.asarray(distinct_topk(rng, T, K, E))
    w = jnp.asarray(rng.random((T, K)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32)).astype(jnp.bfloat16)
    ref = call(ex, x, idx, w)
    awq.configure_w4a16(ex, backend="triton", interpret=True)
    got = call(ex, x, idx, w)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2


def test_awq_experts_bf16_jit():
    E, D, I, K, T = 8, 32, 16, 2, 9
    ex, dense = _experts_pair(E, D, I, 8, dtype=jnp.bfloat16)
    rng = np.random.default_rng(7)
    idx = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32))
    w = jnp.asarray(rng.random((T, K)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
    got = call(ex, x.astype(jnp.bfloat16), idx, w)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), call(dense, x, idx, w)) < 2e-2


def test_resident_bytes_formula():
    d = json.load(open(os.path.join(V3, "config.json")))
    v3 = dict(d, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
              moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4, num_experts_per_tok=8)
    cfg = ModelConfig.from_hf_dict(v3)
    # V3's dimensions need no padding: (attention + expert weights) x (1/2 + 3/G) bytes
    assert awq.layer_resident_bytes(cfg, 128)["quantized"] == (187_105_280 + 11_318_329_344) * (64 + 3) // 128
    assert awq.layer_resident_bytes(cfg, 64)["quantized"] == 6_292_034_560
    # The formula counts exactly the AWQ params of a built layer (padding included).
    small = ModelConfig.from_hf_dict(dict(d, quantization_config={"quant_method": "awq", "bits": 4,
                                                                  "group_size": 8, "version": "gemm"}))
    from mla_jax.model.transformer import DecoderLayer
    layer = nnx.eval_shape(lambda: DecoderLayer(small, 1, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    held = 0
    for _, v in nnx.to_flat_state(nnx.state(layer, awq.QuantWeight)):
        a = v.get_value()
        held += a.size * a.dtype.itemsize
    assert held == awq.layer_resident_bytes(small)["quantized"]


# ---------------------------------------------------------------------------------------------------------------
# whole checkpoints


def dequantized_hf_dir(awq_dir: str, dst: str) -> str:
    """An HF directory whose Linear weights are the dequantized AWQ values (no quantization_config)."""
    cfg = json.load(open(os.path.join(awq_dir, "config.json")))
    G = cfg.pop("quantization_config")["group_size"]
    t = load_file(os.path.join(awq_dir, "model.safetensors"))
    out = {}
    for k, v in t.items():
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")]
            out[f"{m}.weight"] = np.ascontiguousarray(
                pack.dequantize_packed(v, t[f"{m}.qzeros"], t[f"{m}.scales"], G).T)
        elif not k.endswith((".qzeros", ".scales")):
            out[k] = v
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    g8 = str(root / "g8")
    pack.quantize_checkpoint(V3, g8, group_size=8)
    # group 16 does not divide q_b_proj's in_features (24): excluded via modules_to_not_convert.
    g16 = str(root / "g16")
    pack.quantize_checkpoint(V3, g16, group_size=16, modules_to_not_convert=["q_b_proj"])
    return {"g8": g8, "g16": g16, "g8_ref": dequantized_hf_dir(g8, str(root / "g8_ref")),
            "g16_ref": dequantized_hf_dir(g16, str(root / "g16_ref")), "root": root}


def test_packed_checkpoint_layout(awq_dirs):
    t = load_file(os.path.join(awq_dirs["g16"], "model.safetensors"))
    cfg = json.load(open(os.path.join(awq_dirs["g16"], "config.json")))["quantization_config"]
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": ["q_b_proj"]}
    a = "model.layers.1.self_attn"
    assert t[f"{a}.q_a_proj.qweight"].shape == (32, 3) and t[f"{a}.q_a_proj.qweight"].dtype == np.int32
    assert t[f"{a}.q_a_proj.qzeros"].shape == (2, 3) and t[f"{a}.q_a_proj.scales"].shape == (2, 24)
    assert f"{a}.q_b_proj.weight" in t and f"{a}.q_b_proj.qweight" not in t
    for keep in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", f"{a}.kv_a_layernorm.weight"):
        assert keep in t
    assert "model.layers.1.mlp.experts.7.down_proj.qweight" in t
    assert "model.layers.1.mlp.shared_experts.up_proj.qweight" in t
    assert "model.layers.0.mlp.down_proj.qweight" in t
    assert not [k for k in t if k.endswith(".weight") and pack.is_quantizable_linear(k[:-7])
                and "q_b_proj" not in k]


@pytest.mark.parametrize("which", ["g8", "g16"])
def test_awq_model_logits_match_dequantized_model(awq_dirs, which):
    ids = jnp.asarray(np.load(os.path.join(V3, "golden.npz"))["input_ids"])
    model, cfg = load_model(awq_dirs[which], "float32")
    assert cfg.quantization is not None and cfg.quantization.group_size == int(which[1:])
    attn = model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, awq.AWQLinear) and attn.q_a_proj.packed.dtype == jnp.int32
    assert isinstance(model.layers[1].mlp.experts, awq.AWQExperts)
    assert isinstance(model.layers[1].mlp.shared_experts.down_proj, awq.AWQLinear)
    assert isinstance(model.layers[0].mlp.up_proj, awq.AWQLinear)
    assert isinstance(attn.q_b_proj, awq.AWQLinear if which == "g8" else Linear)
    ref, _ = load_model(awq_dirs[which + "_ref"], "float32")
    got, want = call(model, ids), call(ref, ids)
    assert rel_err(got, want) < 1e-4
    # Quantization really changed the model (the reference is not the original fp32 fixture).
    assert rel_err(want, np.load(os.path.join(V3, "golden.npz"))["logits_fp32"]) > 1e-3
    # kv_b_proj dequantized for absorption equals the reference's weights.
    for a, b in zip(attn.absorbed_weights(), ref.layers[1].self_attn.absorbed_weights()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_awq_model_bf16(awq_dirs):
    ids = jnp.asarray(np.load(os.path.join(V3, "golden.npz"))["input_ids"])
    model, _ = load_model(awq_dirs["g8"], "bfloat16")
    assert model.layers[1].self_attn.o_proj.scales.dtype == jnp.float16
    ref, _ = load_model(awq_dirs["g8_ref"], "float32")
    got = call(model, ids)
    assert got.dtype == jnp.float32 and np.isfinite(np.asarray(got)).all()
    assert rel_err(got, call(ref, ids)) < 5e-2


# ---------------------------------------------------------------------------------------------------------------
# bad inputs


def _edit_copy(src: str, dst: str, *, config=None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        c = json.load(open(os.path.join(dst, "config.json")))
        config(c)
        json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    if tensors is not None:
        t = load_file(os.path.join(dst, "model.safetensors"))
        tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


def test_bad_awq_checkpoints_raise(awq_dirs):
    root, g8 = awq_dirs["root"], awq_dirs["g8"]
    qb = "model.layers.1.self_attn.q_b_proj"

    def qcfg(**kw):
        return lambda c: c["quantization_config"].update(kw)

    with pytest.raises(ValueError, match="bits=8"):
        load_model(_edit_copy(g8, str(root / "b8"), config=qcfg(bits=8)))
    with pytest.raises(ValueError, match=r"group_size 16 does not divide in_features 24.*|.*q_b_proj.*group_size 16"):
        load_model(_edit_copy(g8, str(root / "gs"), config=qcfg(group_size=16)))
    with pytest.raises(ValueError, match="zero_point"):
        load_model(_edit_copy(g8, str(root / "zp"), config=qcfg(zero_point=False)))
    with pytest.raises(ValueError, match="gemv"):
        load_model(_edit_copy(g8, str(root / "gemv"), config=qcfg(version="gemv")))
    with pytest.raises(ValueError, match=rf"{qb}\.qzeros"):
        load_model(_edit_copy(g8, str(root / "noz"), tensors=lambda t: t.pop(f"{qb}.qzeros")))
    with pytest.raises(ValueError, match=rf"{qb}\.scales.*shape \(3, 8\)"):
        load_model(_edit_copy(g8, str(root / "sc"), tensors=lambda t: t.update(
            {f"{qb}.scales": np.ones((3, 8), np.float16)})))
    with pytest.raises(ValueError, match=rf"{qb}\.qweight has dtype float32"):
        load_model(_edit_copy(g8, str(root / "qwf"), tensors=lambda t: t.update(
            {f"{qb}.qweight": t[f"{qb}.qweight"].astype(np.float32)})))
    with pytest.raises(ValueError, match="not exactly representable in float16"):
        load_model(_edit_copy(g8, str(root / "sc32"), tensors=lambda t: t.update(
            {f"{qb}.scales": t[f"{qb}.scales"].astype(np.float32) + np.float32(1e-7)})))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="out_features 12 is not a multiple of 8"):
        awq.AWQLinear(AWQConfig(group_size=8), 16, 12, hf_name="x.proj")
    with pytest.raises(ValueError, match="x.proj: AWQ group_size 32 does not divide in_features 48"):
        awq.AWQLinear(AWQConfig(group_size=32), 48, 16, hf_name="x.proj")
    with pytest.raises(ValueError, match="does not divide in_features 24"):
        awq.AWQExperts(AWQConfig(group_size=16), 4, 32, 24)
    with pytest.raises(ValueError, match="bits=8"):
        awq.AWQLinear(AWQConfig(bits=8), 16, 16)
    with pytest.raises(ValueError, match="out_features 12"):
        pack.pack_linear(np.zeros((12, 16), np.float32), 8)
    with pytest.raises(ValueError, match="does not divide in_features 20"):
        pack.pack_linear(np.zeros((8, 20), np.float32), 8)
    with pytest.raises(ValueError, match="qzeros is missing"):
        awq.validate_checkpoint_tensors("m", 16, 8, 8, {"qweight": np.zeros((16, 1), np.int32),
                                                         "scales": np.zeros((2, 8), np.float16)})
    with pytest.raises(ValueError, match=r"m.scales has shape \(2, 16\), expected \(2, 8\)"):
        awq.validate_checkpoint_tensors("m", 16, 8, 8, {"qweight": np.zeros((16, 1), np.int32),
                                                         "qzeros": np.zeros((2, 1), np.int32),
                                                         "scales": np.zeros((2, 16), np.float16)})
