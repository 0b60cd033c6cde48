"""scripts/run_full_v3.py end to end on a CPU: the tiny V3-shaped model (--small) cut to 2 layers, 1 and 2 simulated
devices at the same per-device batch, data-parallel attention under both expert dispatch paths, the per-layer
dispatch measurement; and the abstract full-width dry run at a reduced depth. Speeds are not checked (CPU)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "run_full_v3.py")


def run_script(args, tmp_path):
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the script sets the simulated devices
    r = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], cwd=os.path.dirname(HERE), env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text()), r.stdout


def test_small_model_on_1_and_2_devices_both_dispatch_paths(tmp_path):
    gen_len, per_device = 3, 2
    result, stdout = run_script(["--small", "--num-layers", "2", "--num-devices", "1", "2", "--per-device-batch",
                                 "--batches", str(per_device), "--modes", "dp", "--prompt-len", "8",
                                 "--gen-len", str(gen_len), "--measure-layer"], tmp_path)
    assert "2 layers (1 dense)" in result["config"]
    runs = [(r["devices"], r["mode"], r["dispatch"], r["batch"]) for r in result["rows"]]
    assert runs == [(1, "single", None, 2), (2, "dp", "all_gather", 4), (2, "dp", "all_to_all", 4)]
    for r in result["rows"]:
        assert r["output_tokens"] == r["batch"] * gen_len
        assert r["output_tok_per_s"] > 0 and r["decode_step_ms_median"] > 0 and r["decode_roofline_ms"] > 0
        assert r["planned_bytes_per_device"]["routed_experts"] > 0
    one, two = result["rows"][0], result["rows"][1]
    # experts split over 2 devices: half the routed-expert bytes per device
    assert two["planned_bytes_per_device"]["routed_experts"] * 2 == one["planned_bytes_per_device"]["routed_experts"]
    assert {(s["dispatch"], s["per_device_batch"]) for s in result["scaling"]} == {("all_gather", 2),
                                                                                  ("all_to_all", 2)}
    layer = {(m["what"], m.get("dispatch")) for m in result["layer_dispatch"]}
    assert layer == {("moe_layer_routed_experts", "all_gather"), ("moe_layer_routed_experts", "all_to_all"),
                     ("all_to_all_bf16", None), ("all_gather_bf16", None), ("reduce_scatter_fp32", None)}
    assert "scaling dp all_to_all at 2 sequences per device" in stdout
    assert result["skipped"] == []


def test_dry_run_full_width_at_reduced_depth(tmp_path):
    result, _ = run_script(["--dry-run", "--num-layers", "4", "--num-devices", "2", "--modes", "dp",
                            "--batches", "64"], tmp_path)
    (row,) = result["rows"]
    assert "4 layers" in result["config"] and result["devices"] == "2 simulated CPU devices"
    m = row["bytes_per_device"]
    # one MoE layer (V3's first 3 are dense) of 256 experts x 3 x 7168 x 2048 packed int4 weights (+ g64 fp16
    # scales and uint8 zeros: 3 bytes per group), half of them on each of the 2 devices
    weights = 256 * 3 * 7168 * 2048 // 2
    assert m["routed_experts"] == weights // 2 + weights // 64 * 3
