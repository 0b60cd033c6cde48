"""scripts/bench_w4a16_clocks.py: how it reads nvidia-smi's samples (no GPU needed): settling samples dropped,
medians and extremes of what stays, clock-event reason bits named and counted, malformed lines skipped."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_w4a16_clocks",
                                              os.path.join(REPO, "scripts", "bench_w4a16_clocks.py"))
clocks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clocks)


def _sampler(lines):
  s = clocks.Sampler()
  s.lines = lines
  return s.summary()


def test_summary_drops_the_settling_fifth_and_names_the_reasons():
  # 2 settling samples (idle clocks, low power), then 8 under load: 4 capped (sw_power_cap 0x4), 1 also hw_slowdown
  lines = ["1980, 3201, 120.5, 40, 0x0000000000000001\n", "1980, 3201, 130.0, 40, 0x0000000000000000\n"]
  lines += [f"{mhz}, 3201, {w}, 55, {r}\n" for mhz, w, r in
            [(1980, 650.0, "0x0"), (1815, 699.0, "0x4"), (1410, 706.5, "0xC"), (1830, 700.0, "0x4"),
             (1980, 660.0, "0x0"), (1800, 701.0, "0x4"), (1980, 655.0, "0x0"), (1980, 640.0, "0x0")]]
  lines.insert(5, "[Unknown Error]\n")                   # nvidia-smi's placeholder for a field it could not read
  out = _sampler(lines)
  assert out["samples"] == 8
  assert out["sm_mhz"] == 1905.0 and out["sm_mhz_min"] == 1410
  assert out["power_w"] == 679.5 and out["power_w_max"] == 706.5 and out["temp_c"] == 55
  assert out["reasons"] == {"hw_slowdown": 0.12, "sw_power_cap": 0.5}
  assert "idle" not in out["reasons"]                    # the settling samples' reasons are not counted


def test_summary_without_samples_says_so():
  out = _sampler(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\n"])
  assert out["samples"] == 0 and "NVIDIA-SMI" in out["raw"][0]
