"""The converted (orbax + manifest) format: converted == direct, overwrite rules, manifest checks, the CLI."""
from __future__ import annotations

import json
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax
from mla_jax.checkpoint import converted
from mla_jax.quant import awq, pack

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
V3 = os.path.join(FIXTURES, "v3_yarn")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

call = nnx.jit(lambda module, ids: module(ids))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    src = str(root / "hf")
    shutil.copytree(V3, src)
    with open(os.path.join(src, "tokenizer.json"), "w") as f:     # a side file that must travel
        f.write('{"model": {"type": "BPE"}}')
    awq_src = str(root / "awq")
    pack.quantize_checkpoint(src, awq_src, group_size=8)
    out = {"root": root, "hf": src, "awq": awq_src, "hf_conv": str(root / "hf_conv"),
           "awq_conv": str(root / "awq_conv")}
    converted.convert_checkpoint(src, out["hf_conv"], progress=False)
    converted.convert_checkpoint(awq_src, out["awq_conv"], progress=False)
    return out


def flat_params(model) -> dict:
    return {converted.param_name(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("kind,dtype", [("hf", "float32"), ("awq", "float32"), ("awq", "bfloat16")])
def test_converted_equals_direct(dirs, kind, dtype):
    direct, cfg_d = mla_jax.load_model(dirs[kind], dtype)
    conv, cfg_c = mla_jax.load_model(dirs[kind + "_conv"], dtype)
    assert cfg_c == cfg_d
    a, b = flat_params(direct), flat_params(conv)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if kind == "awq":
        assert isinstance(conv.layers[1].mlp.experts, awq.AWQExperts)
        assert b["layers.1.mlp.experts.w2_packed"].dtype == np.int32
    ids = jnp.asarray(np.load(os.path.join(V3, "golden.npz"))["input_ids"])
    np.testing.assert_array_equal(np.asarray(call(direct, ids)), np.asarray(call(conv, ids)))


def test_int4_nibble_storage_and_custom_put(dirs):
    rng = np.random.default_rng(0)
    a = rng.integers(-8, 8, (3, 5, 16)).astype(jnp.int4)
    b = converted.pack_nibbles(a)
    assert b.dtype == np.uint8 and b.shape == (3, 5, 8)
    np.testing.assert_array_equal(converted.unpack_nibbles_host(b), a)
    # the same bytes XLA holds for an int4 array: a bitcast of the packed bytes gives the values back
    import jax
    as_int4 = jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.int4).reshape(a.shape)
    np.testing.assert_array_equal(np.asarray(as_int4), a)
    # a caller's put sees host arrays in the model's layout (the packed w4a16 layout), as with the HF loader
    seen = {}

    def put(path, arr):
        seen[converted.param_name(path)] = arr.dtype
        return jnp.asarray(arr)

    model, _ = converted.load_converted(dirs["awq_conv"], "float32", put=put)
    assert seen["layers.1.mlp.experts.w13_packed"] == np.int32
    assert seen["layers.1.mlp.experts.w13_zeros"] == np.uint8
    ref, _ = mla_jax.load_model(dirs["awq_conv"], "float32")
    a, b = flat_params(model), flat_params(ref)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_layout_and_manifest(dirs):
    d = dirs["awq_conv"]
    assert converted.is_converted(d) and not converted.is_converted(dirs["awq"])
    side = {f for f in os.listdir(dirs["awq"]) if not f.endswith(".safetensors")}
    assert {"config.json", "tokenizer.json"} <= side
    assert set(os.listdir(d)) == side | {"manifest.json", "weights"}
    assert open(os.path.join(d, "tokenizer.json")).read() == open(os.path.join(dirs["hf"], "tokenizer.json")).read()
    assert json.load(open(os.path.join(d, "config.json"))) == json.load(open(os.path.join(dirs["awq"], "config.json")))
    m = json.load(open(os.path.join(d, "manifest.json")))
    assert m["format"] == "mla_jax.converted" and m["storage_dtype"] == "float32" and m["quantization"]
    assert sorted(os.listdir(os.path.join(d, "weights"))) == ["layers.0", "layers.1", "layers.2", "model"]
    assert m["version"] == converted.VERSION == 3
    # q_a_proj [in 32, out 24]: K padded to one 256-row chunk (32 words), N to 64 columns
    e = m["tensors"]["layers.1.self_attn.q_a_proj.packed"]
    assert e["shape"] == [32, 64] and e["dtype"] == "int32" and e["group"] == "layers.1" and "stored_as" not in e
    assert m["tensors"]["layers.1.mlp.gate.kernel"]["dtype"] == "float32"
    # 8 experts, gate|up [D 32 -> 2 x 16 columns, each half padded to 64], 256/8 groups of 8 rows
    assert m["tensors"]["layers.1.mlp.experts.w13_scales"]["shape"] == [8, 32, 128]
    # no temporary directories left next to the output
    assert not [p for p in os.listdir(dirs["root"]) if ".tmp-" in p]


def convert_as_version_2(src: str, dst: str) -> None:
    """convert_checkpoint as the version 2 converter wrote: AWQ words in the packed layout's version 2 order and a
    version 2 manifest (also used by tests/sharding_8dev_cases.py)."""
    from pallas_kernels.w4a16 import layout
    v3_pack_q = layout.pack_q
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(converted, "VERSION", 2)
        mp.setattr(layout, "pack_q", lambda q, xp=np: layout.swap_word_halves(v3_pack_q(q, xp=xp), xp=xp))
        converted.convert_checkpoint(src, dst, progress=False)


def test_version_2_directory_is_repacked_at_load(dirs, tmp_path, caplog):
    """A directory written by the version 2 converter (AWQ words in the layout's version 2 order) loads to the
    same parameters as a version 3 one, on the host path and through the sharded (orbax-into-shardings) path."""
    import jax
    v2 = str(tmp_path / "awq_v2")
    convert_as_version_2(dirs["awq"], v2)
    m = json.load(open(os.path.join(v2, "manifest.json")))
    assert m["version"] == 2
    ref = flat_params(mla_jax.load_model(dirs["awq_conv"], "float32")[0])
    words = "layers.1.mlp.experts.w13_packed"
    group = [n for n, e in m["tensors"].items() if e["group"] == "layers.1"]
    stored = converted._restore_group(os.path.join(v2, "weights", "layers.1"), group)[words]
    assert not np.array_equal(stored, ref[words])           # the stored words really are in the other order
    with caplog.at_level("INFO", logger="mla_jax.checkpoint.converted"):
        host = flat_params(converted.load_converted(v2, "float32")[0])
    assert "repacked to version 3" in caplog.text
    sharded = flat_params(converted.load_converted(
        v2, "float32", verify_checksums=False,
        sharding_for=lambda _p, _shape: jax.sharding.SingleDeviceSharding(jax.devices()[0]))[0])
    for loaded in (host, sharded):
        assert loaded.keys() == ref.keys()
        for name in ref:
            np.testing.assert_array_equal(loaded[name], ref[name], err_msg=name)
    m["version"] = 1
    json.dump(m, open(os.path.join(v2, "manifest.json"), "w"))
    with pytest.raises(ValueError, match="re-run scripts/convert.py"):
        converted.load_converted(v2, "float32")


def test_overwrite_rules_and_failed_conversion(dirs, tmp_path):
    with pytest.raises(FileExistsError, match="--force"):
        converted.convert_checkpoint(dirs["hf"], dirs["hf_conv"], progress=False)
    dst = str(tmp_path / "again")
    os.makedirs(dst)
    with open(os.path.join(dst, "stale.txt"), "w") as f:
        f.write("old")
    converted.convert_checkpoint(dirs["hf"], dst, force=True, progress=False)
    assert converted.is_converted(dst) and not os.path.exists(os.path.join(dst, "stale.txt"))
    # A source that fails to load leaves no output and no temporary directory behind.
    bad = str(tmp_path / "bad_src")
    shutil.copytree(dirs["hf"], bad)
    from safetensors.numpy import load_file, save_file
    t = load_file(os.path.join(bad, "model.safetensors"))
    t.pop("model.layers.2.self_attn.o_proj.weight")
    save_file(t, os.path.join(bad, "model.safetensors"))
    out = str(tmp_path / "never")
    with pytest.raises(ValueError, match="model.layers.2.self_attn.o_proj.weight"):
        converted.convert_checkpoint(bad, out, progress=False)
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    with pytest.raises(ValueError, match="already a converted directory"):
        converted.convert_checkpoint(dirs["hf_conv"], str(tmp_path / "x"), progress=False)


def _copy(dirs, tmp_path, name):
    d = str(tmp_path / name)
    shutil.copytree(dirs["awq_conv"], d)
    return d


def test_manifest_mismatch_names_the_tensor(dirs, tmp_path):
    bad_name = "layers.2.self_attn.kv_b_proj.scales"
    # 1. data differs from the manifest: rewrite one group with one tensor changed
    d = _copy(dirs, tmp_path, "corrupt")
    gdir = os.path.join(d, "weights", "layers.2")
    names = [n for n, e in json.load(open(os.path.join(d, "manifest.json")))["tensors"].items()
             if e["group"] == "layers.2"]
    arrays = converted._restore_group(gdir, names)
    arrays[bad_name] = arrays[bad_name].copy()
    arrays[bad_name].flat[3] += np.float16(1)
    shutil.rmtree(gdir)
    converted._save_group(gdir, arrays)
    with pytest.raises(ValueError, match=rf"{bad_name}.*checksum"):
        mla_jax.load_model(d)
    # 2. a manifest that disagrees with the model
    d = _copy(dirs, tmp_path, "shape")
    mpath = os.path.join(d, "manifest.json")
    m = json.load(open(mpath))
    m["tensors"][bad_name]["shape"] = [3, 80]
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ValueError, match=rf"{bad_name}.*shape \(3, 80\)"):
        mla_jax.load_model(d)
    m["tensors"].pop(bad_name)
    json.dump(m, open(mpath, "w"))
    with pytest.raises(ValueError, match=rf"lacks tensor '{bad_name}'"):
        mla_jax.load_model(d)
    # 3. a weights group that is gone
    d = _copy(dirs, tmp_path, "nogroup")
    shutil.rmtree(os.path.join(d, "weights", "layers.1"))
    with pytest.raises(ValueError, match=r"weights/layers.1 is missing.*layers\.1\."):
        mla_jax.load_model(d)


def test_cli(dirs, tmp_path, capsys):
    import convert as cli

    dst = str(tmp_path / "cli")
    assert cli.main([dirs["hf"], dst, "--quiet", "--awq-group-size", "16", "--awq-exclude", "q_b_proj"]) == 0
    assert "AWQ int4" in capsys.readouterr().out
    model, cfg = mla_jax.load_model(dst)
    assert cfg.quantization.group_size == 16 and cfg.quantization.modules_to_not_convert == ("q_b_proj",)
    assert isinstance(model.layers[0].self_attn.q_a_proj, awq.AWQLinear)
    assert not isinstance(model.layers[0].self_attn.q_b_proj, awq.AWQLinear)
    assert cli.main([dirs["hf"], dst, "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main([dirs["hf"], dst, "--quiet", "--force"]) == 0
    assert mla_jax.load_model(dst)[1].quantization is None
