"""Runs the multi-device sharding tests (tests/sharding_8dev_cases.py) in a fresh process with 8 simulated CPU
devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 only takes effect before jax creates its CPU client,
which other test modules of this session may already have done."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharding_on_8_simulated_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           os.path.join(HERE, "sharding_8dev_cases.py")]
    r = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-12000:]}\n{r.stderr[-4000:]}"
