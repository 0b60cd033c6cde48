"""ptxas's register and spill report for the Mosaic GPU kernels, on a machine without a GPU.

XLA's CUDA plugin can compile for a compile-only sm_90a device described by a target config (no GPU, no driver);
Mosaic GPU then runs ptxas on each kernel, and MOSAIC_GPU_DUMP_PTXAS=1 prints its report. Spills are what this is
for: a kernel that spills where an H200 measured none (or the reverse) names the change that did it before any
device time is spent (the fp8 MLA rows kernel once lost 21% to 632 B of spilled wgmma descriptors; NOTES.md).

Setup, once, in a venv of its own (with the CUDA plugin installed JAX would look for a GPU in the test venv):
    python3.12 -m venv /tmp/cudavenv
    /tmp/cudavenv/bin/pip install jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
and a CUDA 13 ptxas on PATH (or /usr/local/cuda). Then, from the repository root:
    /tmp/cudavenv/bin/python scripts/ptxas_report.py --out bench/results/ptxas_<what>_cpu_<commit>.json
    /tmp/cudavenv/bin/python scripts/ptxas_report.py --case '{"op": "mla", "kernel": "seesaw", "fp8": true,
        "plan": {"producer_registers": 56, "compute_registers": 224}}'
Each case compiles in its own process (the report is ptxas's own output); a case is one call shape:
    {"op": "mla", "kernel": "rows" | "seesaw" | "swapped", "fp8": bool, "heads": 128, "sq": 1, "plan": {...}}
    ("q_whole": true: the rows / seesaw kernels read both parts of Q from q whole [.., 576], as mla_decode passes
    it when it gets q whole; else the parts apart, as the model passes them)
    {"op": "moe", "group": 128, "tokens": 64, "config": {...}}        DeepSeek-V3's routed experts
    {"op": "dense", "k": 7168, "n": 18432, "m": 64, "group": 128, "config": {...}}
The ptxas here may not be the H200 image's: read the report as a difference between variants, checked on a GPU.
The ptx column hashes each kernel's PTX without its source locations: a refactor that leaves it unchanged for every
case leaves the GPU code unchanged (how w4a16 NOTES v20 checked x_reuse's removal).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The compile-only device: an sm_90 part with an H100 / H200 SXM's SM (132 SMs, 227 KiB of opt-in SMEM a block,
# 64 K registers an SM); the fields XLA's GPU compiler reads.
TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""

DEFAULT_CASES = [
    dict(op="mla", kernel="rows", fp8=False), dict(op="mla", kernel="rows", fp8=True),
    dict(op="mla", kernel="seesaw", fp8=False), dict(op="mla", kernel="seesaw", fp8=True),
    dict(op="moe", group=128, tokens=64, config={}), dict(op="moe", group=128, tokens=64, config=dict(sub_tiles=1)),
    dict(op="dense", k=7168, n=18432, m=64, group=128, config={}),
    dict(op="dense", k=7168, n=18432, m=64, group=128, config=dict(sub_tiles=2)),
]


def compile_case(case: dict) -> None:
  """Builds the case's kernels for the compile-only device and compiles them (ptxas prints as it goes)."""
  import jax
  import jax.numpy as jnp
  from jax._src import xla_bridge
  from jax.sharding import SingleDeviceSharding

  topology = xla_bridge.make_pjrt_topology("cuda", "", target_config=TARGET_CONFIG, topology="1x1x1")
  where = SingleDeviceSharding(topology._make_compile_only_devices()[0])
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=where)
  if case["op"] == "mla":
    from pallas_kernels.mla_decode import mosaic_sm90
    batch, heads, sq, pages = case.get("batch", 128), case.get("heads", 128), case.get("sq", 1), 8192
    fp8 = bool(case["fp8"])
    if case["kernel"] == "swapped":           # tokens on wgmma M, <= 32 query rows per CTA (h16 and the like)
      plan = mosaic_sm90.make_plan(sq * heads, fp8, num_parts=132 // -(-sq * heads // 32), **case.get("plan", {}))
      fn = mosaic_sm90._build_call(plan, batch=batch, sq=sq, heads=heads, causal=sq > 1, softmax_scale=192 ** -0.5,
                                   num_pages=pages, interpret=False)
      n = plan.n
      q_args = ((s((batch * plan.groups, n, 512), jnp.float16), s((batch * plan.groups, n, 64), jnp.bfloat16))
                if fp8 else (s((batch * plan.groups, n, 576), jnp.bfloat16),) * 2)
    else:
      module = mosaic_sm90.ROWS_KERNELS[case["kernel"]]
      plan = module.make_plan(sq * heads, num_sms=132, fp8=fp8, **case.get("plan", {}))
      fn = module.build_call(plan, batch=batch, sq=sq, heads=heads, causal=sq > 1, softmax_scale=192 ** -0.5,
                             num_pages=pages, interpret=False)
      rows = batch * plan.groups
      q_args = ((s((rows, 64, 576), jnp.bfloat16),) * 2 if case.get("q_whole") else
                (s((rows, 64, 512), jnp.bfloat16), s((rows, 64, 64), jnp.bfloat16)))
    cache = ((s((pages, 64, 512), jnp.float8_e4m3fn), s((pages, 64, 64), jnp.bfloat16),
              s((pages, 64, 4), jnp.float32)) if fp8 else
             (s((pages, 64, 512), jnp.bfloat16), s((pages, 64, 64), jnp.bfloat16)))
    args = (*q_args, *cache,
            s((batch, 64), jnp.int32), s((batch,), jnp.int32), s((batch + 1,), jnp.int32),
            s((4, 1 << (plan.num_parts - 1).bit_length()), jnp.int32))
  else:
    from pallas_kernels.w4a16 import api, layout, mosaic_sm90 as ms, routing

    def weight(*a, **kw):
      w = jax.eval_shape(lambda: layout.random_weight(jax.random.key(0), *a, **kw))
      return jax.tree.map(lambda x: s(x.shape, x.dtype), w)

    config = dict(case.get("config", {}), num_ctas=132)
    g = case["group"]
    if case["op"] == "moe":
      e, d, i, k, t = 256, 7168, 2048, 8, case["tokens"]
      bm = api.default_block_m(t, k, e, "mosaic_sm90")
      fn = lambda x, ids, wts, w13, w2: ms.moe(x, routing.align(ids, wts, e, bm), w13, w2,
                                               busy_blocks=min(e, t * k), config=config)
      args = (s((t, d), jnp.bfloat16), s((t, k), jnp.int32), s((t, k), jnp.float32),
              weight((e,), d, i, g, gate_up=True), weight((e,), i, d, g))
    else:
      fn = lambda x, w: ms.matmul(x, w, config=config)
      args = (s((case["m"], case["k"]), jnp.bfloat16), weight((), case["k"], case["n"], g))
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_PTX_START = "// Generated by LLVM NVPTX Back-End"
_SOURCE_LOCATION = re.compile(r"^\s*\.(loc|file)\b")


def ptx_hashes(text: str) -> list[str]:
  """One hash per PTX module Mosaic dumped (MOSAIC_GPU_DUMP_PTX), in order, over its lines less the source
  locations (`.loc`, `.file`): equal before and after a change that moves no instruction, whatever lines of
  Python it moved (a refactor's check without a GPU)."""
  hashes, block = [], None
  for line in text.splitlines() + ["ptxas"]:
    if line.startswith(_PTX_START) or line.startswith("ptxas"):
      if block:
        hashes.append(hashlib.sha256("\n".join(block).encode()).hexdigest()[:12])
      block = [line] if line.startswith(_PTX_START) else None
    elif block is not None and not _SOURCE_LOCATION.match(line):
      block.append(line)
  return hashes


def compile_in_subprocess(case: dict, timeout: int | None = None, **env) -> subprocess.CompletedProcess:
  """compile_case(case) in a process of its own (its PTX and ptxas report dumped by Mosaic), with `env` added."""
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
             JAX_PLATFORMS="cpu", **env)
  return subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], env=env, capture_output=True,
                        text=True, timeout=timeout)


def error_line(run: subprocess.CompletedProcess) -> str:
  """A failed compile's exception line, not the traceback-filtering note JAX prints after it."""
  text = run.stdout + run.stderr
  errors = [line for line in text.splitlines() if re.match(r"\w*(Error|Exception): ", line)]
  return (errors or text.strip().splitlines() or [f"exit {run.returncode}"])[-1][:500]


def report(case: dict, timeout: int) -> dict:
  t0 = time.perf_counter()
  run = compile_in_subprocess(case, timeout)
  text = run.stdout + run.stderr
  kernels = []
  for line in text.splitlines():
    if (m := _ENTRY.search(line)):
      kernels.append(dict(entry=m.group(1)))
    elif kernels and (m := _SPILL.search(line)):
      kernels[-1].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    elif kernels and (m := _USED.search(line)):
      kernels[-1]["registers"] = int(m.group(1))
  for k, h in zip(kernels, ptx_hashes(text)):
    k["ptx"] = h
  out = dict(case=case, ok=run.returncode == 0, seconds=round(time.perf_counter() - t0, 1), kernels=kernels)
  if run.returncode:
    out["error"] = error_line(run)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", action="append", default=None, help="one case as JSON (repeatable; default: a set)")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)       # the child process: compile one case
  ap.add_argument("--timeout", type=int, default=600)
  ap.add_argument("--out", default=None)
  ap.add_argument("--commit", default=None)
  args = ap.parse_args(argv)
  if args.one:
    compile_case(json.loads(args.one))
    return
  cases = [json.loads(c) for c in args.case] if args.case else DEFAULT_CASES
  commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  ptxas = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
  results = [report(c, args.timeout) for c in cases]
  print(f"\nptxas report, compile-only sm_90a, commit {commit[:12]}, {ptxas[-1] if ptxas else 'ptxas ?'}")
  print(f"{'case':70s} {'kernel':>6s} {'spill st':>9s} {'spill ld':>9s} {'stack':>6s} {'ptx':>12s}")
  for r in results:
    name = json.dumps(r["case"], separators=(",", ":"))[:70]
    if not r["ok"]:
      print(f"{name:70s} FAILED: {r['error']}")
    for i, k in enumerate(r["kernels"]):
      print(f"{name if i == 0 else '':70s} {i:6d} {k.get('spill_stores', '?'):>9} {k.get('spill_loads', '?'):>9} "
            f"{k.get('stack', '?'):>6} {k.get('ptx', '?'):>12}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(commit=commit, ptxas=ptxas, device="compile-only sm_90a (scripts/ptxas_report.py)",
                     results=results), f, indent=1)


if __name__ == "__main__":
  main()
