"""scripts/check_mla_gpu.py's L2-resident block table: the same work on a pool of pages that fits in L2."""
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import check_mla_gpu  # noqa: E402  (a script, not a package)

from pallas_kernels.mla_decode import reference  # noqa: E402
from pallas_kernels.testing import random_problem  # noqa: E402


def test_l2_resident_table_reads_only_full_pages_of_the_pool():
  lens = [256, 128, 320, 192, 64]
  q, cache, table, lens_a = random_problem(3, lens=lens, sq=1, heads=4, dtype="fp8_e4m3")
  out_table = np.asarray(check_mla_gpu.l2_resident_table(table, lens, 8))
  t = np.asarray(table)
  pages = [n // 64 for n in lens]
  pool = set(np.concatenate([t[b, :k] for b, k in enumerate(pages)])[:8].tolist())
  for b, k in enumerate(pages):
    assert set(out_table[b, :k].tolist()) <= pool                  # every page read comes from the pool
    np.testing.assert_array_equal(out_table[b, k:], t[b, k:])      # entries past the length untouched
  assert len({tuple(out_table[b, :2]) for b in range(len(lens))}) > 1   # sequences start at different places
  # every page the new table reads is a full page of data: the unused slots of random_problem's pool are NaN
  out, lse = reference.mla_decode(q, cache, jnp.asarray(out_table), lens_a, softmax_scale=0.1, causal=False)
  assert not np.isnan(np.asarray(out, np.float32)).any() and not np.isnan(np.asarray(lse)).any()


def test_l2_resident_table_refuses_partial_pages_and_a_pool_larger_than_the_batch():
  lens = [100, 128]
  _, _, table, _ = random_problem(4, lens=lens, sq=1, heads=4, dtype="fp8_e4m3")
  with pytest.raises(ValueError, match="whole pages"):
    check_mla_gpu.l2_resident_table(table, lens, 1)
  with pytest.raises(ValueError, match="at least that many"):
    check_mla_gpu.l2_resident_table(table, [128, 128], 5)


def test_hang_watchdog_records_and_ends_the_process_and_cancel_stops_it():
  """A variant that never returns (a deadlocked kernel) is recorded and the process ends with status 3; a variant
  that returns in time cancels its watchdog and the process goes on."""
  import subprocess
  body = ("import sys, time; sys.path.insert(0, {scripts!r}); import check_mla_gpu as c\n"
          "t = c.hang_watchdog({secs}, lambda: print('recorded hang', flush=True))\n"
          "{cancel}time.sleep(3); print('went on', flush=True)\n")
  scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
  for cancel, want_rc, want_out in (("", 3, "recorded hang"), ("t.cancel(); ", 0, "went on")):
    code = body.format(scripts=scripts, secs=0.5, cancel=cancel)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == want_rc, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [want_out]
