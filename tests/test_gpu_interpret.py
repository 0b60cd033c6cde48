"""Mosaic GPU interpret mode cannot deadlock: the XLA:CPU pool it needs (pallas_kernels/gpu_interpret.py).

The one-core runs are subprocesses with a timeout, so that a regression fails here instead of hanging CI.
"""
import json
import os
import subprocess
import sys

import pytest

from pallas_kernels import gpu_interpret
from pallas_kernels.mla_decode import mosaic_sm90

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "gpu_interpret_worker.py")
# A passing `run` takes ~20 s of CPU on one core; a hang is forever.
TIMEOUT_S = 240


def _worker(mode: str, **env_changes) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
  env.update(env_changes)
  try:
    r = subprocess.run([sys.executable, WORKER, mode], cwd=os.path.dirname(HERE), env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    tail = (e.stderr or b"")[-3000:]
    pytest.fail(f"GPU interpret mode on one core did not finish in {TIMEOUT_S} s (deadlock: see "
                f"pallas_kernels/gpu_interpret.py); stderr tail:\n{tail!r}")
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_pool_size_rule_matches_the_pool_xla_made():
  """Our copy of XLA's sizing rule, applied to this process's environment, gives the pool JAX's CPU client
  actually has (counted by thread name): so reserve_cpu_threads and check_cpu_threads reason about the real pool.
  conftest.py reserved the pool before JAX started, so it has at least MIN_CPU_THREADS threads."""
  have = gpu_interpret.cpu_pool_threads()
  assert have == gpu_interpret.xla_cpu_pool_size(os.environ, gpu_interpret.schedulable_cpus())
  assert have >= gpu_interpret.MIN_CPU_THREADS


@pytest.mark.parametrize("environ,cpus,pool", [
    ({}, 2, 2),                                         # one thread per usable core
    ({"NPROC": "3"}, 2, 3),                             # NPROC when PJRT_NPROC is unset
    ({"PJRT_NPROC": "5", "NPROC": "3"}, 2, 5),          # PJRT_NPROC first
    ({"PJRT_NPROC": "many", "NPROC": "3"}, 2, 3),       # a value that does not parse is skipped
    ({"PJRT_NPROC": "-4"}, 2, 0),
])
def test_xla_pool_size_rule(environ, cpus, pool):
  assert gpu_interpret.xla_cpu_pool_size(environ, cpus) == pool


def test_reserve_raises_small_pools_and_respects_the_users_choice():
  env = {}
  assert gpu_interpret.reserve_cpu_threads(8, environ=env, cpus=2) and env == {"PJRT_NPROC": "8"}
  env = {"NPROC": "1"}                                  # NPROC is overridden through PJRT_NPROC
  assert gpu_interpret.reserve_cpu_threads(8, environ=env, cpus=64) and env["PJRT_NPROC"] == "8"
  env = {}
  assert not gpu_interpret.reserve_cpu_threads(8, environ=env, cpus=16) and env == {}   # enough cores: untouched
  env = {"PJRT_NPROC": "2"}
  assert not gpu_interpret.reserve_cpu_threads(8, environ=env, cpus=2) and env == {"PJRT_NPROC": "2"}
  assert gpu_interpret.reserve_cpu_threads(8, override_user=True, environ=env, cpus=2) and env["PJRT_NPROC"] == "8"
  env = {"PJRT_NPROC": "12"}                            # larger than asked: never lowered
  assert not gpu_interpret.reserve_cpu_threads(8, override_user=True, environ=env, cpus=2)
  assert env == {"PJRT_NPROC": "12"}


def test_mosaic_interpret_on_one_core_finishes_and_is_correct():
  """Issue 14's case (B=3, H=20, Sq=2 causal, lengths 0/77/130, fp8 and bf16 caches, after xla and triton calls
  in the same process, jitted) pinned to one core with no PJRT_NPROC: before the pool reservation this hung every
  time, all threads waiting in Barrier.wait. mosaic_sm90 meets docs/architecture.md §3 against the float64
  reference; the xla and triton calls before it (the outside check's order; their own tests hold them to §3)
  must at least be NaN-free with FlashMLA's cos_diff < 1e-5."""
  results = _worker("run")
  assert set(results) == {f"{b} {d}" for b in ("xla", "triton", "mosaic_sm90") for d in ("fp8_e4m3", "bfloat16")}
  for name, res in results.items():
    if name.startswith("mosaic_sm90"):
      assert res["ok"], (name, res)
    else:
      assert res["out_nan"] == 0 and res["lse_nan"] == 0 and res["cos_diff"] < 1e-5, (name, res)


def test_too_small_pool_is_refused_with_a_clear_error():
  """A pool the user fixed too small (PJRT_NPROC=2 on one core) gets an error that names the fix, not a hang."""
  need = mosaic_sm90.NUM_WARPGROUPS + 2
  err = _worker("refuse", PJRT_NPROC="2")["error"]
  assert err is not None
  assert f"at least {need} XLA:CPU intra-op threads" in err and "has 2" in err and "PJRT_NPROC=8" in err
