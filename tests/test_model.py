"""The NNX model and the HF safetensors loader against HF transformers golden logits (tests/fixtures)."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import mla_jax
from conftest import HF_FIXTURES, fixture_path, load_golden
from mla_jax.checkpoint.hf import hf_param_map, read_tensor_index
from mla_jax.model.moe import Experts


@functools.lru_cache(maxsize=None)
def logits_of(name: str, dtype: str) -> np.ndarray:
    model, _ = mla_jax.load_model(fixture_path(name), dtype=dtype)
    return np.asarray(model(load_golden(name)["input_ids"]))


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_fp32_logits_match_hf(name):
    g = load_golden(name)
    out = logits_of(name, "float32")
    assert out.dtype == np.float32 and out.shape == g["logits_fp32"].shape
    assert rel_err(out, g["logits_fp32"]) <= 1e-4


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_bf16_logits_match_hf(name):
    g = load_golden(name)
    out = logits_of(name, "bfloat16")
    assert out.dtype == np.float32
    assert rel_err(out, g["logits_bf16"]) <= 3e-2   # vs HF run in bf16
    assert rel_err(out, g["logits_fp32"]) <= 3e-2   # and vs the fp32 truth


def test_golden_files_record_versions():
    for name in HF_FIXTURES:
        meta = json.loads(str(load_golden(name)["meta"]))
        assert meta["transformers"] and meta["torch"] and meta["attn_implementation"] == "eager"


def test_fixtures_stay_small():
    total = sum(os.path.getsize(os.path.join(dp, f)) for n in HF_FIXTURES
                for dp, _, fs in os.walk(fixture_path(n)) for f in fs)
    assert total < 4 * 2**20, f"HF fixtures take {total} bytes; keep them < 4 MiB"


def test_param_dtypes_and_structure():
    model, cfg = mla_jax.load_model(fixture_path("v3_yarn"), dtype="bfloat16")
    assert isinstance(model.layers, nnx.List) and len(model.layers) == cfg.num_hidden_layers == 3
    moe = model.layers[1].mlp
    assert moe.gate.kernel[...].dtype == jnp.float32                    # router stays fp32
    assert moe.gate.e_score_correction_bias[...].dtype == jnp.float32
    assert moe.experts.w_gate[...].shape == (8, 32, 16) and moe.experts.w_gate[...].dtype == jnp.bfloat16
    assert moe.experts.w_down[...].shape == (8, 16, 32)
    assert model.layers[0].mlp.gate_proj.kernel[...].shape == (32, 64)  # dense first layer, [in, out]
    assert model.lm_head.kernel[...].shape == (32, 128)
    graphdef, state = nnx.split(model)
    assert all(not isinstance(v.get_value(), jax.ShapeDtypeStruct) for _, v in nnx.to_flat_state(state))


def test_expert_stacking_and_transpose_follow_hf_names():
    model, cfg = mla_jax.load_model(fixture_path("v3_yarn"), dtype="float32")
    t = load_file(os.path.join(fixture_path("v3_yarn"), "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(model.layers[2].mlp.experts.w_up[...][5]),
                                  t["model.layers.2.mlp.experts.5.up_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.layers[1].self_attn.kv_b_proj.kernel[...]),
                                  t["model.layers.1.self_attn.kv_b_proj.weight"].T)


def test_param_map_covers_fixture_exactly():
    for name in HF_FIXTURES:
        cfg = mla_jax.ModelConfig.from_pretrained(fixture_path(name))
        names = set(read_tensor_index(fixture_path(name)))
        mtp = {n for n in names if int(n.split(".")[2] if n.startswith("model.layers.") else -1)
               >= cfg.num_hidden_layers}
        assert set(hf_param_map(cfg)) == names - mtp
        assert all(n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in mtp)
        assert bool(mtp) == (name == "v3_yarn")  # the fixture that ships an MTP layer


def test_loader_logs_skipped_mtp_tensors(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="mla_jax"):
        mla_jax.load_model(fixture_path("v3_yarn"))
    assert "skipped 5 tensors of 1 multi-token-prediction layer" in caplog.text


def test_absorbed_mla_equals_plain_attention():
    """The engine's absorbed form (q_nope·W_UK against the latent, o = (P·latent)·W_UVᵀ) equals the forward."""
    model, cfg = mla_jax.load_model(fixture_path("real_dims"), dtype="float32")
    attn = model.layers[1].self_attn
    B, S = 2, 5
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, cfg.hidden_size), np.float32))
    pos = jnp.asarray(np.broadcast_to(np.arange(S, dtype=np.int32) + 3, (B, S)))  # non-zero start positions
    o, plain, w_uk, w_uv = nnx.jit(_absorbed_vs_plain, static_argnums=2)(attn, x, cfg, pos)
    np.testing.assert_allclose(np.asarray(o), np.asarray(plain), rtol=2e-5, atol=2e-5)
    assert w_uk.shape == (cfg.num_attention_heads, 128, 512) and w_uv.shape == (cfg.num_attention_heads, 128, 512)


def _absorbed_vs_plain(attn, x, cfg, pos):
    S = x.shape[1]
    q_nope, q_rope = attn.project_q(x, pos)
    latent, k_rope = attn.project_kv(x, pos)
    w_uk, w_uv = attn.absorbed_weights()
    hp = jax.lax.Precision.HIGHEST
    q_lat = jnp.einsum("bshn,hnc->bshc", q_nope, w_uk, precision=hp)
    s = (jnp.einsum("bqhc,bkc->bhqk", q_lat, latent, precision=hp)
         + jnp.einsum("bqhr,bkr->bhqk", q_rope, k_rope, precision=hp)) * cfg.softmax_scale
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    o_lat = jnp.einsum("bhqk,bkc->bqhc", jax.nn.softmax(s, -1), latent, precision=hp)
    o = attn.output(jnp.einsum("bqhc,hvc->bqhv", o_lat, w_uv, precision=hp))
    return o, attn(x, pos), w_uk, w_uv


def test_experts_ragged_dot_equals_per_token_loop_and_dense():
    E, D, I, T, K = 6, 16, 8, 13, 3
    rng = np.random.default_rng(0)
    ex = nnx.eval_shape(lambda: Experts(E, D, I, dtype=jnp.float32, rngs=nnx.Rngs(1)))
    for p in ("w_gate", "w_up", "w_down"):
        getattr(ex, p).set_value(jnp.asarray(rng.standard_normal(getattr(ex, p).shape, np.float32) / 3))
    x = jnp.asarray(rng.standard_normal((T, D), np.float32))
    idx = jnp.asarray(np.argsort(rng.random((T, E)), -1)[:, :K].astype(np.int32))  # distinct experts per token
    w = jnp.asarray(rng.random((T, K), np.float32))
    wg, wu, wd = (np.asarray(ex.w_gate[...], np.float64), np.asarray(ex.w_up[...], np.float64),
                  np.asarray(ex.w_down[...], np.float64))
    xn, idn, wn = np.asarray(x, np.float64), np.asarray(idx), np.asarray(w, np.float64)
    ref = np.zeros((T, D))
    for t in range(T):  # fp64 loop over (token, choice)
        for k in range(K):
            e = idn[t, k]
            g, u = xn[t] @ wg[e], xn[t] @ wu[e]
            ref[t] += wn[t, k] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    call = nnx.jit(lambda m, a, i, ww: m(a, i, ww))
    np.testing.assert_allclose(np.asarray(call(ex, x, idx, w)), ref, rtol=1e-5, atol=1e-5)
    ex.impl = "dense"
    np.testing.assert_allclose(np.asarray(call(ex, x, idx, w)), ref, rtol=1e-5, atol=1e-5)
    # The dense form composes with vmap (ragged_dot cannot be vmapped in jax 0.11).
    xb = jnp.stack([x, x[::-1]])
    yb = nnx.jit(lambda m, *a: jax.vmap(m)(*a))(ex, xb, jnp.stack([idx, idx[::-1]]), jnp.stack([w, w[::-1]]))
    np.testing.assert_allclose(np.asarray(yb[1]), ref[::-1], rtol=1e-5, atol=1e-5)


def test_moe_layer_is_differentiable():
    model, cfg = mla_jax.load_model(fixture_path("v3_plain"), dtype="float32")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, cfg.hidden_size), np.float32))
    grads = nnx.jit(nnx.grad(lambda mlp: mlp(x).sum()))(model.layers[1].mlp)
    for g in (grads.experts.w_gate[...], grads.gate.kernel[...], grads.shared_experts.up_proj.kernel[...]):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


def test_bad_inputs_raise():
    model, _ = mla_jax.load_model(fixture_path("v3_plain"), dtype="float32")
    with pytest.raises(ValueError, match="input_ids"):
        model(np.zeros((5,), np.int32))
    with pytest.raises(ValueError, match="input_ids"):
        model(np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match="float16"):
        mla_jax.load_model(fixture_path("v3_plain"), dtype="float16")
    with pytest.raises(FileNotFoundError):
        mla_jax.load_model(fixture_path("v3_plain") + "_missing")


# ---- loader errors on edited copies of a fixture ----------------------------------------------------------------
@pytest.fixture
def ckpt_copy(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture_path("v3_plain"), dst)
    return dst


def _edit(ckpt, fn):
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt_copy):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    _edit(ckpt_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*" + name.replace(".", r"\.") + r".*\(32, 12\)"):
        mla_jax.load_model(ckpt_copy)


def test_extra_tensor_is_named(ckpt_copy):
    _edit(ckpt_copy, lambda t: t.__setitem__("model.layers.0.mlp.bias", np.zeros((7, 3), np.float32)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.bias.*\(7, 3\).*expected shape: none"):
        mla_jax.load_model(ckpt_copy)


def test_extra_layer_is_not_mtp_without_nextn(ckpt_copy):
    # num_nextn_predict_layers is 0 here, so a model.layers.{L}.* tensor is an error, not a skipped MTP layer.
    _edit(ckpt_copy, lambda t: t.__setitem__("model.layers.2.enorm.weight", np.ones((32,), np.float32)))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.enorm\.weight"):
        mla_jax.load_model(ckpt_copy)


def test_misshaped_tensor_names_both_shapes(ckpt_copy):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _edit(ckpt_copy, lambda t: t.__setitem__(name, np.zeros((32, 15), np.float32)))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(32, 15\).*\(32, 16\)"):
        mla_jax.load_model(ckpt_copy)


def test_unsupported_tensor_dtype_is_named(ckpt_copy):
    name = "model.norm.weight"
    _edit(ckpt_copy, lambda t: t.__setitem__(name, np.ones((32,), np.int32)))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*I32"):
        mla_jax.load_model(ckpt_copy)


def test_sharded_index_with_missing_shard(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture_path("v2_lite"), dst)
    shard = sorted(f for f in os.listdir(dst) if f.startswith("model-"))[0]
    os.remove(dst / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        mla_jax.load_model(dst)


def test_real_configs_build_abstractly_with_published_param_counts():
    """DeepSeek-V3 (671B without its MTP layer) and V2-Lite (15.7B) built with nnx.eval_shape (no memory)."""
    from test_config import V2_LITE_REAL, V3_REAL

    from mla_jax.model.transformer import DeepseekV3

    for d, billions in ((V3_REAL, 671.0), (V2_LITE_REAL, 15.7)):
        cfg = mla_jax.ModelConfig.from_hf_dict(d)
        model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        n = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model)))
        assert round(n / 1e9, 1) == billions
        # The HF-name table covers exactly the model's parameters.
        assert sum(int(np.prod(t.hf_shape)) for t in hf_param_map(cfg).values()) == n
