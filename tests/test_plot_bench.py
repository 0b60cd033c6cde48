"""scripts/plot_bench.py: the points it draws are the JSON's numbers (checked against the rows independently), and
with matplotlib installed (the `plot` extra) it writes the three PNGs, each under 200 KB."""
import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("plot_bench", os.path.join(REPO, "scripts", "plot_bench.py"))
plot_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_bench)


def _doc(name):
    with open(os.path.join(REPO, "bench", "results", name)) as f:
        return json.load(f)


def test_mla_points_are_the_records():
    doc = _doc(plot_bench.MLA_FILES[0])
    points = plot_bench.mla_points([doc])
    uniform = [r for r in doc["records"] if r["lengths"] == "uniform"]
    assert len(points) == len(uniform) > 0
    for p, r in zip(points, uniform):
        # intensity = FLOPs / bytes of the record: 2·b·Sq·h·L·1088 over b·L·(656 fp8 | 1152 bf16)
        per_token = 656 if r["dtype"] == "fp8_e4m3" else 1152
        assert p["intensity"] == pytest.approx(2 * r["sq"] * r["h"] * 1088 / per_token, rel=1e-6)
        assert p["tflops"] == r["tflops"] and p["backend"] == r["backend"]


def test_w4a16_points_are_the_rows():
    doc = _doc("w4a16_dense_h200.json")
    points = plot_bench.w4a16_points([doc])
    row = next(r for r in doc["rows"] if r["op"] == "dense" and r["m"] == 16 and r["k"] == 7168)
    mine = [p for p in points if p["shape"] == f"dense 7168->{row['n']} M16"]
    assert {p["backend"] for p in mine} == {"w4a16 triton", "xla dequant+dot"}
    kernel = next(p for p in mine if p["backend"] == "w4a16 triton")
    assert kernel["tflops"] == pytest.approx(2 * 16 * 7168 * row["n"] / row["us"] / 1e6)
    assert plot_bench.engine_points(_doc(plot_bench.ENGINE_FILE))[0][0] == 1


def test_renders_small_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot_bench.main(["--out", str(tmp_path)]) == 0
    names = sorted(os.listdir(tmp_path))
    assert names == ["engine_tok_s.png", "mla_decode_roofline.png", "w4a16_roofline.png"]
    for n in names:
        with open(tmp_path / n, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(tmp_path / n) < 200_000
