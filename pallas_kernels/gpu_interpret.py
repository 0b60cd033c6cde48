"""XLA:CPU threads for Pallas Mosaic GPU interpret mode, so that an interpreted kernel cannot deadlock.

Why (jax 0.11.2): GPU interpret mode runs each warpgroup of a block as its own XLA:CPU computation, launched from
a Python thread (jax/_src/pallas/mosaic/interpret/thread_map.py: `_thread_map_callback` -> `_run_jaxpr`), and a
warpgroup waiting on a barrier blocks inside a host callback (jax/_src/pallas/mosaic_gpu/interpret/
shared_memory.py: `Barrier._wait`, a condition variable with no timeout). XLA:CPU's thunk executor moves a host
callback that may block onto its intra-op thread pool ("XLAEigen") whenever other thunks are ready at the same
time (xla/backends/cpu/runtime/thunk_executor.cc: `ThunkExecutor::Execute`, `ExecuteMayBlock`), and continues a
computation on that pool after asynchronous thunks. The pool is shared by every computation in the process and
has one thread per usable core (xla/pjrt/utils.cc: `DefaultThreadPoolSize`: PJRT_NPROC, else NPROC, else the CPU
affinity). Once every pool thread holds a warpgroup waiting at a barrier, the warpgroup that would arrive has its
next step queued on the same pool and never runs: all threads wait, at zero CPU, forever.

The bound: each warpgroup's callbacks are chained by a token, so at most one per warpgroup blocks at a time, plus
the launching computation's callback that waits for the block's threads. A pool of `threads_per_block + 2`
threads therefore always has a free thread. `reserve_cpu_threads` (run when pallas_kernels is imported) raises the
pool to MIN_CPU_THREADS before JAX creates its CPU client; `check_cpu_threads` refuses to interpret a kernel on a
smaller pool, with an error that says how to fix it, instead of letting it hang.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

import jax

# Covers kernels of up to 6 warpgroups (threads_per_block + 2); mosaic_sm90 runs 3.
MIN_CPU_THREADS = 8
# XLA names its intra-op pool "XLAEigen"; TSL prefixes thread names ("tf_XLAEigen" in jaxlib 0.11.2).
_POOL_THREAD_NAME = "XLAEigen"


def schedulable_cpus() -> int:
  """Cores this process may run on (what XLA's MaxParallelism counts)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def xla_cpu_pool_size(environ: MutableMapping[str, str], cpus: int) -> int:
  """The intra-op pool size XLA:CPU picks for this environment (the rule of xla/pjrt/utils.cc
  DefaultThreadPoolSize: the first of PJRT_NPROC, NPROC that parses as an integer, else the usable cores)."""
  for name in ("PJRT_NPROC", "NPROC"):
    try:
      return max(0, int(environ[name]))
    except (KeyError, ValueError):
      continue
  return cpus


def reserve_cpu_threads(min_threads: int = MIN_CPU_THREADS, *, override_user: bool = False,
                        environ: MutableMapping[str, str] | None = None, cpus: int | None = None) -> bool:
  """Sets PJRT_NPROC=min_threads when XLA:CPU would otherwise create fewer intra-op threads; True if it did.

  Takes effect only if it runs before JAX creates its CPU client (the first computation or jax.devices()).
  A PJRT_NPROC that is already set is the user's choice and is left alone (check_cpu_threads judges it), unless
  override_user (the test suite, which must neither hang nor refuse).
  """
  environ = os.environ if environ is None else environ
  cpus = schedulable_cpus() if cpus is None else cpus
  if ("PJRT_NPROC" in environ and not override_user) or xla_cpu_pool_size(environ, cpus) >= min_threads:
    return False
  environ["PJRT_NPROC"] = str(min_threads)
  return True


def cpu_pool_threads() -> int:
  """Threads in this process's XLA:CPU intra-op pool (creating JAX's CPU client if needed).

  Counted by thread name on Linux; elsewhere (or if no thread carries the name) the size XLA's rule gives for
  the current environment, which is right as long as the environment did not change after the client was made.
  """
  jax.devices("cpu")
  task_dir = "/proc/self/task"
  count = 0
  if os.path.isdir(task_dir):
    for tid in os.listdir(task_dir):
      try:
        with open(os.path.join(task_dir, tid, "comm")) as f:
          count += _POOL_THREAD_NAME in f.read()
      except OSError:      # the thread ended while we listed
        continue
  return count or xla_cpu_pool_size(os.environ, schedulable_cpus())


def check_cpu_threads(threads_per_block: int) -> None:
  """Raises RuntimeError unless the XLA:CPU pool is large enough to interpret a kernel of this many warpgroups
  without deadlock (see the module docstring)."""
  need = threads_per_block + 2
  have = cpu_pool_threads()
  if have < need:
    raise RuntimeError(
        f"Mosaic GPU interpret mode needs at least {need} XLA:CPU intra-op threads for a kernel of "
        f"{threads_per_block} warpgroups, but JAX's CPU client has {have} (PJRT_NPROC, else one per usable core). "
        f"With so few, every pool thread can end up holding a warpgroup that waits at a barrier, and the run hangs "
        f"forever. Set PJRT_NPROC={max(need, MIN_CPU_THREADS)} in the environment before JAX starts, or import "
        f"pallas_kernels (which sets it) before the first JAX computation.")
