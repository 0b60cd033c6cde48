"""GPU check of the mosaic_sm90 MLA decode backend against the xla backend, plus timing of kernel variants.

Correctness: random shapes (ragged lengths, zero-length sequences, Sq=2 causal, H in {1,16,20,64,128}, bf16 and
fp8 caches; every unused slot NaN) through pallas_kernels.mla_decode(backend="mosaic_sm90") vs backend="xla",
with the tolerances of docs/architecture.md §3 (pallas_kernels.testing.compare). Timing (--timing): b128 L4096
shapes with CUPTI per-kernel times, including the ragged [1, 2L] case, the bf16-P variant (split_p=False) and
each of the three kernels forced (kernel="swapped" | "rows" | "seesaw"); the grid over every backend is
scripts/bench_mla.py's. Prints a table last and writes JSON (device, jax version, commit). layer_us is the call
less its split-KV schedule kernel: one layer's cost in a decode step that computes the schedule once.

  python scripts/check_mla_gpu.py --out bench/results/mla_mosaic_check.json [--timing] [--commit SHA]
  python scripts/check_mla_gpu.py --interpret --cases tiny      # CPU self-test of this script (slow, tiny)
  python scripts/check_mla_gpu.py --cases none --timing --only "fp8_e4m3 h128,fp8_e4m3 h128 rows"   # a subset
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.mla_decode import api, mosaic_sm90
from pallas_kernels.mla_decode import reference
from pallas_kernels.testing import compare, device_time as time_call, random_problem

SCALE = 192 ** -0.5


def correctness_cases(kind: str):
  """(name, dtype, heads, sq, lens[, kernel[, kwargs]]) cases; lens drawn from a fixed seed so runs are comparable
  (new cases go last: the draws of earlier ones stay the same). A sixth entry forces mosaic_sm90's kernel, a
  seventh passes plan overrides (num_stages) to mosaic_sm90.mla_decode."""
  rng = np.random.default_rng(1234)
  if kind == "tiny":
    return [("bf16 h16 ragged+0", "bfloat16", 16, 1, [70, 0, 5]),
            ("fp8 h20 sq2 causal", "fp8_e4m3", 20, 2, [1, 130, 64]),
            ("bf16 h64 sq2 causal", "bfloat16", 64, 2, [70, 0, 5]),
            ("fp8 h64 ragged+0 rows", "fp8_e4m3", 64, 1, [70, 0, 5], "rows"),
            ("fp8 h64 ragged+0 rows 2 stages", "fp8_e4m3", 64, 1, [70, 0, 5], "rows", dict(num_stages=2))]
  ragged = lambda b, hi: [int(x) for x in rng.integers(0, hi + 1, b)]
  return [
      ("bf16 h16 ragged+0", "bfloat16", 16, 1, [0] + ragged(6, 700)),
      ("fp8 h16 ragged+0", "fp8_e4m3", 16, 1, [0] + ragged(6, 700)),
      ("fp8 h128 ragged", "fp8_e4m3", 128, 1, ragged(4, 1000)),
      ("bf16 h128 sq2 causal", "bfloat16", 128, 2, [1, 2] + ragged(3, 600)),
      ("fp8 h20 sq2 causal", "fp8_e4m3", 20, 2, [1, 0] + ragged(4, 500)),
      ("bf16 h1 ragged", "bfloat16", 1, 1, ragged(5, 300)),
      ("fp8 h64 sq2 causal", "fp8_e4m3", 64, 2, ragged(5, 900)),
      ("fp8 h16 b64 many seqs/part", "fp8_e4m3", 16, 1, ragged(64, 2000)),
      ("fp8 h16 sq2 causal", "fp8_e4m3", 16, 2, [1, 0] + ragged(5, 800)),
      ("bf16 h8 sq4 causal", "bfloat16", 8, 4, [3] + ragged(4, 500)),
      ("fp8 h128 b2 L8192", "fp8_e4m3", 128, 1, [8192, 8000]),
      # several sequences per share with several head groups (the engine's h128 decode)
      ("fp8 h128 b48 many seqs/part", "fp8_e4m3", 128, 1, ragged(48, 1500)),
      ("bf16 h64 sq2 b40 many seqs/part causal", "bfloat16", 64, 2, ragged(40, 1200)),
      # bf16 with Sq*H a multiple of 64: the seesaw kernel (mosaic_sm90_seesaw.py) under kernel="auto"
      ("bf16 h64 ragged+0", "bfloat16", 64, 1, [0] + ragged(6, 900)),
      ("bf16 h128 ragged+0", "bfloat16", 128, 1, [0, 64, 65] + ragged(5, 1000)),
      ("bf16 h128 b48 many seqs/part", "bfloat16", 128, 1, ragged(48, 1500)),
      ("bf16 h64 sq2 causal", "bfloat16", 64, 2, [1, 2, 0] + ragged(4, 700)),
      # fp8 through the rows kernel (auto's choice for fp8 where Sq*H is a multiple of 64), forced
      ("fp8 h64 ragged+0 rows", "fp8_e4m3", 64, 1, [0] + ragged(6, 900), "rows"),
      ("fp8 h128 ragged+0 rows", "fp8_e4m3", 128, 1, [0, 64, 65, 96] + ragged(5, 1000), "rows"),
      ("fp8 h128 b48 many seqs/part rows", "fp8_e4m3", 128, 1, ragged(48, 1500), "rows"),
      ("fp8 h128 b2 L8192 rows", "fp8_e4m3", 128, 1, [8192, 8000], "rows"),
      ("fp8 h64 sq2 rows causal", "fp8_e4m3", 64, 2, [1, 2, 0] + ragged(4, 700), "rows"),
      ("fp8 h128 sq2 rows causal", "fp8_e4m3", 128, 2, [1, 33, 0] + ragged(4, 900), "rows"),
      # the opt-in 2-slot fp8 ring (Q's rope as a register A operand: interpret mode cannot run that path)
      ("fp8 h128 ragged+0 rows 2 stages", "fp8_e4m3", 128, 1, [0, 64, 65, 96] + ragged(5, 1000), "rows",
       dict(num_stages=2)),
      ("fp8 h128 b48 many seqs/part rows 2 stages", "fp8_e4m3", 128, 1, ragged(48, 1500), "rows",
       dict(num_stages=2)),
      ("fp8 h64 sq2 rows 2 stages causal", "fp8_e4m3", 64, 2, [1, 2, 0] + ragged(4, 700), "rows",
       dict(num_stages=2)),
      # the next-page dequant during P.V (O in a whole-segment accumulator: GPU-only structure; default k = 2),
      # other depths, and none (the whole dequant after kfree)
      ("fp8 h128 ragged+0 rows prefetch 0", "fp8_e4m3", 128, 1, [0, 64, 65, 96] + ragged(5, 1000), "rows",
       dict(prefetch_tiles=0)),
      ("fp8 h128 b48 many seqs/part rows prefetch 4", "fp8_e4m3", 128, 1, ragged(48, 1500), "rows",
       dict(prefetch_tiles=4)),
      ("fp8 h64 sq2 rows prefetch 1 causal", "fp8_e4m3", 64, 2, [1, 2, 0] + ragged(4, 700), "rows",
       dict(prefetch_tiles=1)),
      # the seesaw kernel, forced (bf16: also auto's choice above): P0 and Q's rope as register A operands and O in
      # a whole-segment accumulator run only on a GPU; odd and even page counts per segment, many sequences a share
      ("bf16 h128 ragged+0 seesaw", "bfloat16", 128, 1, [0, 64, 65, 129] + ragged(5, 1000), "seesaw"),
      ("bf16 h128 b48 many seqs/part seesaw", "bfloat16", 128, 1, ragged(48, 1500), "seesaw"),
      ("bf16 h64 ragged+0 seesaw", "bfloat16", 64, 1, [0, 1] + ragged(6, 900), "seesaw"),
      ("bf16 h64 sq2 seesaw causal", "bfloat16", 64, 2, [1, 2, 0] + ragged(4, 700), "seesaw"),
      ("bf16 h128 sq2 seesaw causal", "bfloat16", 128, 2, [1, 33, 0] + ragged(4, 900), "seesaw"),
      # its fp8 path: the producer converts each page from GMEM into the f16 ring (88 registers a thread)
      ("fp8 h128 ragged+0 seesaw", "fp8_e4m3", 128, 1, [0, 64, 65, 96, 129] + ragged(5, 1000), "seesaw"),
      ("fp8 h128 b48 many seqs/part seesaw", "fp8_e4m3", 128, 1, ragged(48, 1500), "seesaw"),
      ("fp8 h64 sq2 seesaw causal", "fp8_e4m3", 64, 2, [1, 2, 0] + ragged(4, 700), "seesaw"),
      ("fp8 h128 sq2 seesaw causal", "fp8_e4m3", 128, 2, [1, 33, 0] + ragged(4, 900), "seesaw"),
      # the bf16 rows kernel, forced (auto's choice for bf16 before the seesaw kernel was measured)
      ("bf16 h128 ragged+0 rows", "bfloat16", 128, 1, [0, 64, 65] + ragged(5, 1000), "rows"),
      ("bf16 h64 sq2 rows causal", "bfloat16", 64, 2, [1, 2, 0] + ragged(4, 700), "rows"),
      # the seesaw producer's L2 prefetch of pages two pairs ahead (reads past each share's end are clipped)
      ("fp8 h128 ragged+0 seesaw l2_prefetch", "fp8_e4m3", 128, 1, [0, 64, 65, 96, 129] + ragged(5, 1000), "seesaw",
       dict(l2_prefetch=2)),
      ("fp8 h128 sq2 seesaw l2_prefetch causal", "fp8_e4m3", 128, 2, [1, 33, 0] + ragged(4, 900), "seesaw",
       dict(l2_prefetch=2)),
      ("bf16 h128 ragged+0 seesaw l2_prefetch", "bfloat16", 128, 1, [0, 64, 65] + ragged(5, 1000), "seesaw",
       dict(l2_prefetch=1)),
      # the swapped kernel (h16 and the like) with its producer converting each fp8 page into an f16 ring
      ("fp8 h16 ragged+0 producer_dequant", "fp8_e4m3", 16, 1, [0, 64, 65, 96, 129] + ragged(5, 1000), "swapped",
       dict(producer_dequant=True, producers=1, l2_prefetch=4)),
      ("fp8 h16 b48 many seqs/part producer_dequant", "fp8_e4m3", 16, 1, ragged(48, 1500), "swapped",
       dict(producer_dequant=True, producers=1, l2_prefetch=4)),
      ("fp8 h20 sq2 producer_dequant causal", "fp8_e4m3", 20, 2, [1, 2, 0] + ragged(4, 700), "swapped",
       dict(producer_dequant=True, l2_prefetch=4)),
      ("fp8 h32 b2 L8192 producer_dequant", "fp8_e4m3", 32, 1, [8192, 8000], "swapped",
       dict(producer_dequant=True)),
      ("fp8 h16 ragged+0 producers 2", "fp8_e4m3", 16, 1, [0, 64, 65, 96, 129] + ragged(5, 1000), "swapped",
       dict(producer_dequant=True, producers=2, l2_prefetch=2)),
      ("fp8 h16 b48 many seqs/part producers 2", "fp8_e4m3", 16, 1, ragged(48, 1500), "swapped",
       dict(producer_dequant=True, producers=2)),
  ]


def run_correctness(kind: str, interpret: bool, default_kernel: str = "auto", grep: str | None = None):
  """kernel: mosaic_sm90's kernel choice ("auto" goes through the public op; a forced kernel calls the backend
  module; a case's own kernel entry overrides it). Cases the rows kernel runs are compared with the float64
  reference: a bf16 cache (bf16 P) under §3's bf16-P bound, an fp8 cache (f16 P and V) under the plain bound."""
  rows = []
  for name, dtype, heads, sq, lens, *case_kernel in correctness_cases(kind):
    if grep and grep not in name:
      continue
    kernel = case_kernel[0] if case_kernel else default_kernel
    plan_kw = case_kernel[1] if len(case_kernel) > 1 else {}
    causal = name.endswith(" causal")
    q, cache, table, lens_a = random_problem(len(rows), lens=lens, sq=sq, heads=heads, dtype=dtype)
    try:
      which = mosaic_sm90.choose_kernel(sq * heads, dtype == "fp8_e4m3", kernel)
    except ValueError as e:                       # a kernel this case cannot run
      print(f"[check] {name}: not run with kernel={kernel}: {e}", flush=True)
      continue

    def call(backend):
      if backend == "mosaic_sm90" and (interpret or kernel != "auto"):
        # GPU interpret mode's ordered callbacks cannot pass the public op's custom_partitioning: call the
        # backend module and the op's output contract directly (the same steps, unsharded).
        def f(q, c, t, l):
          out, lse = mosaic_sm90.mla_decode(q, c, t, l, softmax_scale=SCALE, causal=causal, interpret=interpret,
                                            kernel=kernel, **plan_kw)
          return api.apply_output_contract(out, lse, c, t, l)
        return jax.jit(f)(q, cache, table, lens_a)
      return jax.jit(lambda q, c, t, l: pallas_kernels.mla_decode(
          q, c, t, l, softmax_scale=SCALE, causal=causal, backend=backend))(q, cache, table, lens_a)

    t0 = time.perf_counter()
    out, lse = jax.block_until_ready(call("mosaic_sm90"))
    t_first = time.perf_counter() - t0
    if which in mosaic_sm90.ROWS_KERNELS:        # float64 reference; bf16 P: sum p|v|/l for the widened bound
      lat, rope = cache.dequantize()
      ref_out, ref_lse, ref_abs = reference.mla_decode_numpy(
          np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), np.asarray(table), np.asarray(lens_a),
          softmax_scale=SCALE, causal=causal, page_size=64, return_abs=True)
      res = compare(out, lse, ref_out, ref_lse, ref_abs=None if dtype == "fp8_e4m3" else ref_abs)
    else:
      ref_out, ref_lse = call("xla")
      res = compare(out, lse, ref_out, ref_lse)
    rows.append(dict(case=name, kernel=which, dtype=dtype, heads=heads, sq=sq, batch=len(lens), max_len=max(lens),
                     first_call_s=round(t_first, 2), **res))
    print(f"[check] {name} ({which}): ok={res['ok']} out_err={res['out_max_abs_err']:.2e} cos={res['cos_diff']:.1e} "
          f"lse_err={res['lse_max_abs_err']:.1e}", flush=True)
  return rows


def fp8_seesaw_register_splits(label: str, splits, **kw):
  """Timing variants "fp8_e4m3 h128 {label} regs p/c" (b128 L4096) of the fp8 seesaw kernel at these (producer,
  compute) register splits, with kw for mosaic_sm90.mla_decode."""
  return [(f"fp8_e4m3 h128 {label} regs {p}/{c}", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
           dict(kernel="seesaw", registers=dict(producer_registers=p, compute_registers=c), **kw))
          for p, c in splits]


# the swapped kernel's two-producer configuration as measured before alternate and lookahead became its default
BEFORE_ALTERNATE = dict(alternate=False, lookahead=False)
# (dtype, name label, Sq, batch, ragged) of h128 L4096 on which the seesaw kernel's orders of work are timed
ORDER_SHAPES = (("fp8_e4m3", "", 1, 128, False), ("fp8_e4m3", " b64", 1, 64, False),
                ("fp8_e4m3", " sq2", 2, 128, False), ("fp8_e4m3", " ragged[1..2L]", 1, 128, True),
                ("bfloat16", "", 1, 128, False))
# the fp8 h16 shapes the swapped kernel's variants are timed at: (label, batch, L, ragged, extra problem kwargs)
H16_SHAPES = (("", 128, 4096, False, {}), (" ragged[1..2L]", 128, 4096, True, {}),
              (" b32 L16384", 32, 16384, False, {}), (" l2 resident", 128, 4096, False, dict(l2_pool_pages=512)))


def timing_variants():
  """(name, dtype, heads, sq, batch, L, ragged, backend, kwargs for mosaic_sm90.mla_decode).

  The plain b128 L4096 grid over every backend is scripts/bench_mla.py's; these time the production kernel
  (empty kwargs) on the shapes that locate its time, plus the plan overrides mosaic_sm90.mla_decode takes."""
  base = ("fp8_e4m3", 16, 1, 128, 4096)
  return [
      ("fp8_e4m3 h16", *base, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h16 ragged[1..2L]", *base, True, "mosaic_sm90", {}),
      ("bfloat16 h16", "bfloat16", 16, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("bfloat16 h16 bf16 P", "bfloat16", 16, 1, 128, 4096, False, "mosaic_sm90", dict(split_p=False)),
      ("fp8_e4m3 h16 sq2", "fp8_e4m3", 16, 2, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h128", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h128 rows", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      # the opt-in 2-slot fp8 ring (slot held through QK, Q's rope in registers) against the 1-slot default
      ("fp8_e4m3 h128 rows 2 stages", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", num_stages=2)),
      ("fp8_e4m3 h128 rows ragged[1..2L]", "fp8_e4m3", 128, 1, 128, 4096, True, "mosaic_sm90", dict(kernel="rows")),
      # the next page's first k dequant tiles converted while P.V runs
      *((f"fp8_e4m3 h128 rows prefetch {k}", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="rows", prefetch_tiles=k)) for k in (0, 1, 2, 4)),
      ("fp8_e4m3 h128 sq2", "fp8_e4m3", 128, 2, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h128 sq2 rows", "fp8_e4m3", 128, 2, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      ("fp8_e4m3 h128 sq2 rows 2 stages", "fp8_e4m3", 128, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", num_stages=2)),
      ("fp8_e4m3 h64", "fp8_e4m3", 64, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h64 rows", "fp8_e4m3", 64, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      ("fp8_e4m3 h64 rows 2 stages", "fp8_e4m3", 64, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", num_stages=2)),
      ("bfloat16 h128 swapped", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="swapped")),
      ("bfloat16 h128 swapped bf16 P", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", split_p=False)),
      ("bfloat16 h128 rows", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      # probe for the fp8 rows path's 1-slot ring: the bf16 rows kernel with 1 page slot instead of 2
      ("bfloat16 h128 rows 1 stage", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", num_stages=1)),
      ("bfloat16 h128 rows ragged[1..2L]", "bfloat16", 128, 1, 128, 4096, True, "mosaic_sm90", dict(kernel="rows")),
      ("bfloat16 h64 rows", "bfloat16", 64, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      ("bfloat16 h64 swapped", "bfloat16", 64, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="swapped")),
      ("bfloat16 h128 sq2 rows", "bfloat16", 128, 2, 128, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      # FlashMLA's staggered two-page schedule (opt-in kernel="seesaw") against the rows kernel
      ("bfloat16 h128 seesaw", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      ("bfloat16 h128 seesaw ragged[1..2L]", "bfloat16", 128, 1, 128, 4096, True, "mosaic_sm90",
       dict(kernel="seesaw")),
      ("bfloat16 h128 sq2 seesaw", "bfloat16", 128, 2, 128, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      ("bfloat16 h64 seesaw", "bfloat16", 64, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      ("fp8_e4m3 h128 seesaw", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      ("fp8_e4m3 h128 seesaw ragged[1..2L]", "fp8_e4m3", 128, 1, 128, 4096, True, "mosaic_sm90",
       dict(kernel="seesaw")),
      ("fp8_e4m3 h128 sq2 seesaw", "fp8_e4m3", 128, 2, 128, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      ("fp8_e4m3 h128 b64 seesaw", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90", dict(kernel="seesaw")),
      # warpgroup 0's P0 V0_L left in flight while it hands P0 over (early_p0: the bf16 default) or waited for
      # first (late); half the shares leaves half the SMs idle (66 CTAs): recorded once, not a ring test
      ("bfloat16 h128 seesaw late_p0", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", early_p0=False)),
      ("bfloat16 h128 sq2 seesaw late_p0", "bfloat16", 128, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", early_p0=False)),
      ("fp8_e4m3 h128 seesaw early_p0", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", early_p0=True)),
      ("bfloat16 h128 seesaw parts/2", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", num_parts=33)),
      # the fp8 producer's register split (producer, compute): more for the conversion or more for the softmax
      *fp8_seesaw_register_splits("seesaw", ((56, 224), (72, 216), (88, 208))),
      # the rows kernel's loop-variant operand addresses (rebase_per_page; default on for fp8) against their absence
      ("fp8_e4m3 h128 rows no rebase", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", rebase_per_page=False)),
      ("bfloat16 h128 rows rebase", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", rebase_per_page=True)),
      # batch 64 (the V3 slice's decode batch) and the split-KV width: shares of whole sequences or not
      ("fp8_e4m3 h128 b64 rows", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90", dict(kernel="rows")),
      ("fp8_e4m3 h128 b64 L4097 rows", "fp8_e4m3", 128, 1, 64, 4097, False, "mosaic_sm90", dict(kernel="rows")),
      *((f"fp8_e4m3 h128 b64 rows parts {p}", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90",
         dict(kernel="rows", num_parts=p)) for p in (32, 64, 128)),
      ("fp8_e4m3 h128 rows parts 64", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="rows", num_parts=64)),
      # the seesaw producer's L2 prefetch, 1 to 3 page pairs ahead (ncu at 14ec995: the fp8 producer waits on its
      # GMEM loads while the compute warpgroups wait on it)
      *((f"fp8_e4m3 h128 seesaw l2_prefetch {a}", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="seesaw", l2_prefetch=a)) for a in (1, 2, 3)),
      ("fp8_e4m3 h128 seesaw l2_prefetch 2 ragged[1..2L]", "fp8_e4m3", 128, 1, 128, 4096, True, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=2)),
      ("fp8_e4m3 h128 sq2 seesaw l2_prefetch 2", "fp8_e4m3", 128, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=2)),
      ("fp8_e4m3 h128 b64 seesaw l2_prefetch 2", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=2)),
      ("fp8_e4m3 h128 seesaw early_p0 l2_prefetch 2", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=2, early_p0=True)),
      *((f"bfloat16 h128 seesaw l2_prefetch {a}", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="seesaw", l2_prefetch=a)) for a in (1, 2)),
      ("bfloat16 h128 sq2 seesaw l2_prefetch 1", "bfloat16", 128, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=1)),
      # the swapped kernel's producer converting each fp8 page into an f16 ring (the compute warpgroups' chain
      # without its dequantization, two f16 slots), with 0 to 8 pages prefetched into L2; fp8 h16's floor is 80.6 µs
      *((f"fp8_e4m3 h16 producer_dequant l2 {a}", *base, False, "mosaic_sm90",
         dict(kernel="swapped", producer_dequant=True, producers=1, l2_prefetch=a)) for a in (0, 2, 4, 8)),
      ("fp8_e4m3 h16 producer_dequant l2 4 ragged[1..2L]", *base, True, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=1, l2_prefetch=4)),
      ("fp8_e4m3 h16 b32 L16384", "fp8_e4m3", 16, 1, 32, 16384, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h16 b32 L16384 producer_dequant l2 4", "fp8_e4m3", 16, 1, 32, 16384, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=1, l2_prefetch=4)),
      ("fp8_e4m3 h16 sq2 producer_dequant l2 4", "fp8_e4m3", 16, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, l2_prefetch=4)),
      ("fp8_e4m3 h32", "fp8_e4m3", 32, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h32 producer_dequant l2 4", "fp8_e4m3", 32, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, l2_prefetch=4)),
      # the defaults as of 51d1294's measurements (fp8: seesaw with 1 pair prefetched; producer_dequant with 4 pages
      # ahead from 32 rows per CTA) against what they replaced
      ("fp8_e4m3 h128 seesaw l2_prefetch 0", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", l2_prefetch=0)),
      ("fp8_e4m3 h128 b64", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h32 no producer_dequant", "fp8_e4m3", 32, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=False)),
      *((f"fp8_e4m3 {label} producer_dequant l2 2", "fp8_e4m3", h, sq, 128, 4096, False, "mosaic_sm90",
         dict(kernel="swapped", producer_dequant=True, l2_prefetch=2)) for label, h, sq in (("h32", 32, 1),
                                                                                            ("h16 sq2", 16, 2))),
      ("fp8_e4m3 h20", "fp8_e4m3", 20, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h20 no producer_dequant", "fp8_e4m3", 20, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=False)),
      # b64's split-KV width (the V3 slice's attention is b64)
      *((f"fp8_e4m3 h128 b64 seesaw parts {p}", "fp8_e4m3", 128, 1, 64, 4096, False, "mosaic_sm90",
         dict(kernel="seesaw", num_parts=p)) for p in (64, 132)),
      # fp8 h16 with two producer warpgroups converting a page's latent halves side by side (4 warpgroups), as
      # measured before alternate and lookahead (their default since be5c3ef) joined them
      *((f"fp8_e4m3 h16 producers 2 l2 {a}", *base, False, "mosaic_sm90",
         dict(kernel="swapped", producer_dequant=True, producers=2, l2_prefetch=a, **BEFORE_ALTERNATE))
        for a in (0, 1, 2, 4)),
      ("fp8_e4m3 h16 producers 2 l2 2 ragged[1..2L]", *base, True, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=2, l2_prefetch=2, **BEFORE_ALTERNATE)),
      ("fp8_e4m3 h16 b32 L16384 producers 2 l2 2", "fp8_e4m3", 16, 1, 32, 16384, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=2, l2_prefetch=2, **BEFORE_ALTERNATE)),
      ("fp8_e4m3 h16 sq2 rows_per_cta 16 producers 2 l2 2", "fp8_e4m3", 16, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=2, l2_prefetch=2, rows_per_cta=16,
            **BEFORE_ALTERNATE)),
      ("fp8_e4m3 h8 producers 2 l2 2", "fp8_e4m3", 8, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", producer_dequant=True, producers=2, l2_prefetch=2, **BEFORE_ALTERNATE)),
      ("fp8_e4m3 h8", "fp8_e4m3", 8, 1, 128, 4096, False, "mosaic_sm90", {}),
      # the seesaw kernel writing whole sequences' outputs itself (the default, direct_write) against f32 partials
      # for the merge to read (every sequence of these uniform-length batches is whole in its share)
      *((f"{dt} h128{label} merge all", dt, 128, sq, batch, 4096, ragged, "mosaic_sm90",
         dict(kernel="seesaw", direct_write=False))
        for dt, label, sq, batch, ragged in (("fp8_e4m3", "", 1, 128, False), ("bfloat16", "", 1, 128, False),
                                             ("fp8_e4m3", " b64", 1, 64, False), ("fp8_e4m3", " sq2", 2, 128, False),
                                             ("fp8_e4m3", " ragged[1..2L]", 1, 128, True))),
      ("bfloat16 h128", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90", {}),
      ("fp8_e4m3 h128 ragged[1..2L]", "fp8_e4m3", 128, 1, 128, 4096, True, "mosaic_sm90", {}),
      # fp8 direct write (opt-in) at b128, where its kernel is ~30 µs slower than merging every partial: with and
      # without the producer's L2 prefetch, and with 64 shares a row group (each exactly two whole sequences)
      *((f"fp8_e4m3 h128 {label}", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="seesaw", direct_write=d, **extra))
        for label, d, extra in (("direct", True, {}), ("direct l2_prefetch 0", True, dict(l2_prefetch=0)),
                                ("direct parts 64", True, dict(num_parts=64)),
                                ("merge all parts 64", False, dict(num_parts=64)))),
      # the producer filling slot 0's part B (the part the next pair's QK waits for most) before slot 1's part A
      *((f"{dt} h128{label} b0_before_a1", dt, 128, sq, batch, 4096, ragged, "mosaic_sm90",
         dict(kernel="seesaw", b0_before_a1=True))
        for dt, label, sq, batch, ragged in ORDER_SHAPES),
      # warpgroup 1's P0 V0_R before its P1 V1_R (slot 0's part B freed mid-pair), and early_p0 with an fp8 cache
      *((f"{dt} h128{label} p0_first{e}", dt, 128, sq, batch, 4096, ragged, "mosaic_sm90",
         dict(kernel="seesaw", p0_first=True, **({"early_p0": True} if e else {})))
        for dt, label, sq, batch, ragged in ORDER_SHAPES
        for e in ("", " early_p0") if not (e and (label or dt == "bfloat16"))),
      ("fp8_e4m3 h128 early_p0", "fp8_e4m3", 128, 1, 128, 4096, False, "mosaic_sm90",
       dict(kernel="seesaw", early_p0=True)),
      # page parts released to their QK tile by tile (the QK over them starts half a part's conversion earlier):
      # slot 0's part B ([0]'s), and with it slot 1's part A ([1]'s, converted last)
      *((f"{dt} h128{label} tiles {' '.join(parts)}", dt, 128, sq, batch, 4096, ragged, "mosaic_sm90",
         dict(kernel="seesaw", tile_release=parts))
        for dt, label, sq, batch, ragged in ORDER_SHAPES if dt == "fp8_e4m3"
        for parts in (("b0",), ("a1", "b0"))),
      # the same calls with every sequence's pages drawn from 512 full pages (L2-resident): the on-chip bound
      # (256 bf16 pages: 18.9 MB)
      *((f"{dt} h{h} l2 resident", dt, h, 1, 128, 4096, False, "mosaic_sm90", dict(l2_pool_pages=n))
        for dt, h, n in (("fp8_e4m3", 16, 512), ("bfloat16", 16, 256), ("fp8_e4m3", 128, 512))),
      # the swapped kernel's compute warpgroups on alternate pages (two in flight, no per-page score swap)
      *((f"fp8_e4m3 h{h}{label} alternate{' producers 1' if p == 1 else ''}", "fp8_e4m3", h, 1, batch, length,
         ragged, "mosaic_sm90", dict(kernel="swapped", producer_dequant=True, producers=p, alternate=True,
                                   lookahead=False, **kw))
        for h, label, batch, length, ragged, kw in (
            (16, "", 128, 4096, False, {}), (16, " ragged[1..2L]", 128, 4096, True, {}),
            (16, " b32 L16384", 32, 16384, False, {}), (8, "", 128, 4096, False, {}),
            (16, " l2 resident", 128, 4096, False, dict(l2_pool_pages=512)))
        for p in ((2, 1) if not label else (2,))),
      # the converting producers load the next page before converting this one (with and without alternate)
      *((f"fp8_e4m3 h16{label} lookahead{' alternate' if alt else ''}", "fp8_e4m3", 16, 1, batch, length, ragged,
         "mosaic_sm90", dict(kernel="swapped", producer_dequant=True, lookahead=True, alternate=alt, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES
        for alt in (False, True)),
      # bf16 h128's on-chip bound (256 bf16 pages, 18.9 MB: L2-resident), beside the ones above
      ("bfloat16 h128 l2 resident", "bfloat16", 128, 1, 128, 4096, False, "mosaic_sm90", dict(l2_pool_pages=256)),
      # no f16 page: the compute warpgroups convert each e4m3 page into their wgmma A registers (alternate pages,
      # one TMA producer); these register_dequant variants each trace their own copy of the compute code (no
      # shared_loop, which the default plan at 16 rows has)
      *((f"fp8_e4m3 h16{label} register dequant", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, shared_loop=False, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
      # ... with its producer's L2 prefetch 1 or 4 pages ahead (the default: none)
      *((f"fp8_e4m3 h16 register dequant prefetch {ahead}", "fp8_e4m3", 16, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, shared_loop=False, l2_prefetch=ahead)) for ahead in (1, 4)),
      # ... with a product's shared-memory loads all issued before its first conversion
      *((f"fp8_e4m3 h16{label} register dequant loads first", "fp8_e4m3", 16, 1, 128, 4096, False, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, shared_loop=False, loads_first=True, **kw))
        for label, kw in (("", {}), (" l2 resident", dict(l2_pool_pages=512)))),
      # ... with the 2-slot ring it had before its 4-slot default (one slot a compute warpgroup), one page prefetched
      # (the best of 0 / 1 / 2 / 4 with two slots on an H100)
      *((f"fp8_e4m3 h16{label} register dequant 2 stages", "fp8_e4m3", 16, 1, batch, length, ragged,
         "mosaic_sm90", dict(kernel="swapped", register_dequant=True, shared_loop=False, num_stages=2,
                             l2_prefetch=1, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
      # one traced copy of the compute warpgroups' code (the instruction cache): the converting producers' plan and
      # register_dequant (the default at 16 rows)
      *((f"fp8_e4m3 h16{label}{name} shared loop", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", shared_loop=True, **extra, **kw))
        for name, extra in (("", dict(producer_dequant=True)), (" register dequant", dict(register_dequant=True)))
        for label, batch, length, ragged, kw in H16_SHAPES),
      # the converting producers' plan (two producers, alternate pages, lookahead): the default at 16 rows a CTA
      # before register_dequant with shared_loop
      *((f"fp8_e4m3 h16{label} producers", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", producer_dequant=True, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
      # Sq 2 (32 rows) as two head groups of 16 rows a CTA, which take the default at 16 rows (register_dequant with
      # shared_loop): half the compute a CTA, each page read by both groups' CTAs (against "fp8_e4m3 h16 sq2")
      ("fp8_e4m3 h16 sq2 rows_per_cta 16", "fp8_e4m3", 16, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", rows_per_cta=16)),
      # register_dequant's QK scales applied to S, one accumulator a 128-dim scale tile (scale_on_s)
      *((f"fp8_e4m3 h16{label} scale on s", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, scale_on_s=True, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
      ("fp8_e4m3 h16 sq2 rows_per_cta 16 scale on s", "fp8_e4m3", 16, 2, 128, 4096, False, "mosaic_sm90",
       dict(kernel="swapped", rows_per_cta=16, scale_on_s=True)),
      # scale_on_s is the default since 39fee20 (the "scale on s" variants above are the default now): the scales on
      # QK's operands instead, what the default was before
      *((f"fp8_e4m3 h16{label} no scale on s", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, scale_on_s=False, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
      # the default plan (register_dequant, shared loop, scale_on_s) with a product's shared-memory loads all issued
      # before its first conversion (loads_first; on an H100 at 13ee541: -4.8% on chip, +1% HBM-bound)
      *((f"fp8_e4m3 h16{label} loads first", "fp8_e4m3", 16, 1, batch, length, ragged, "mosaic_sm90",
         dict(kernel="swapped", register_dequant=True, loads_first=True, **kw))
        for label, batch, length, ragged, kw in H16_SHAPES),
  ]


def l2_resident_table(table, lens, pool: int):
  """A block table whose every sequence reads its pages from one set of `pool` full pages (the first sequences'),
  each sequence from its own offset into it: the same work and schedule, but a working set that fits in L2 (512
  fp8 pages are 21.5 MB of the 50 MB), so the kernel's time is its on-chip bound rather than HBM's. The values
  differ from the problem's; only its time is of use."""
  t, lens, page = np.asarray(table), np.asarray(lens), mosaic_sm90.PAGE
  pages = -(-lens // page)
  if np.any(lens % page) or pages.sum() < pool:
    raise ValueError("l2_pool_pages needs whole pages and at least that many in the batch")
  full = np.concatenate([t[b, :k] for b, k in enumerate(pages)])[:pool]
  out = t.copy()
  for b, k in enumerate(pages):
    out[b, :k] = full[(b * 67 + np.arange(k)) % pool]      # an odd stride: sequences at different places in it
  return jnp.asarray(out)


def variant_lens(batch: int, length: int, ragged: bool) -> list[int]:
  """A timing variant's sequence lengths: all `length`, or (ragged) uniform in [1, 2 length], the same every run."""
  rng = np.random.default_rng(7)
  return (rng.integers(1, 2 * length + 1, batch) if ragged else np.full(batch, length)).tolist()


def variant_table(kw: dict, table, lens):
  """(the variant's mosaic_sm90 keyword arguments without l2_pool_pages, the block table it runs with: the
  problem's, or l2_resident_table's where l2_pool_pages asks for one)."""
  kw = dict(kw)
  pool = kw.pop("l2_pool_pages", None)
  return kw, (l2_resident_table(table, lens, pool) if pool else table)


def hang_watchdog(seconds: float, on_hang):
  """Starts a daemon timer that calls on_hang() and ends the process (exit status 3) unless cancelled within
  `seconds`. A kernel that deadlocks on the GPU (e.g. a setmaxnreg increase the CTA's registers cannot cover) blocks
  this process for good; without the watchdog an outer timeout kills it with nothing recorded, so the variant that
  hung and the ones after it look alike. Returns the timer (cancel() it when the variant is done)."""
  def fire():
    try:
      on_hang()
    finally:
      sys.stdout.flush()
      os._exit(3)
  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.start()
  return timer


def run_timing(iters: int, only: str | None, dump=lambda copy, rows: None, variant_timeout: float = 0):
  """Times each variant (all, or the comma list `only`). variant_timeout > 0: a variant without a result after that
  many seconds is recorded as hung (its error row, the JSON rewritten) and the process ends with status 3, so put
  variants that may hang last."""
  rows = []
  copy = copy_bandwidth()
  print(f"[time] copy ceiling {copy['tb_per_s']:.3f} TB/s ({copy['method']})", flush=True)
  problems = {}
  for name, dtype, heads, sq, batch, length, ragged, backend, kw in timing_variants():
    if only and name not in only.split(","):
      continue
    lens = variant_lens(batch, length, ragged)
    key = (dtype, heads, sq, batch, length, ragged)
    if key not in problems:
      problems.clear()
      problems[key] = random_problem(11, lens=lens, sq=sq, heads=heads, dtype=dtype, extra_pages=8)
    q, cache, table, lens_a = problems[key]
    kw, table = variant_table(kw, table, lens)
    if backend == "mosaic_sm90":
      fn = jax.jit(lambda q, c, t, l, kw=kw: mosaic_sm90.mla_decode(q, c, t, l, softmax_scale=SCALE,
                                                                     causal=False, **kw))
    else:
      fn = jax.jit(lambda q, c, t, l: reference.mla_decode(q, c, t, l, softmax_scale=SCALE, causal=False))
    def hung(name=name):
      rows.append(dict(variant=name, error=f"hung: no result after {variant_timeout:.0f} s (a deadlocked kernel?)"))
      print(f"[time] {name}: HUNG, no result after {variant_timeout:.0f} s; stopping here", flush=True)
      dump(copy, rows)
    watchdog = hang_watchdog(variant_timeout, hung) if variant_timeout > 0 else None
    try:
      t = time_call(fn, q, cache, table, lens_a, iters=iters)
    except Exception as e:  # noqa: BLE001 - record and go on to the next variant
      print(f"[time] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      rows.append(dict(variant=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
      continue
    finally:
      if watchdog is not None:
        watchdog.cancel()
    tokens = int(np.sum(lens))
    nbytes = tokens * (656 if dtype == "fp8_e4m3" else 1152)
    flops = 2 * tokens * sq * heads * (576 + 512)
    kernel_us = max(t.get("kernels", {"": t["us"]}).values())
    # one layer's call in a decode step, which computes the split-KV schedule once for all its layers (the engine;
    # FlashMLA's get_mla_metadata, outside its timed call): the call less the schedule kernel
    schedule_us = sum(v for k, v in (t.get("kernels") or {}).items() if k.endswith("mla_decode_split_schedule"))
    row = dict(variant=name, dtype=dtype, heads=heads, sq=sq, batch=batch, L=length, ragged=ragged,
               tokens=tokens, us=t["us"], main_kernel_us=kernel_us, tb_per_s=nbytes / t["us"] / 1e6,
               tflop_per_s=flops / t["us"] / 1e6, pct_copy=100 * nbytes / t["us"] / 1e6 / copy["tb_per_s"],
               layer_us=t["us"] - schedule_us, layer_tflop_per_s=flops / (t["us"] - schedule_us) / 1e6,
               method=t["method"], kernels=t.get("kernels"))
    rows.append(row)
    print(f"[time] {name}: {t['us']:.1f} us (main kernel {kernel_us:.1f}) {row['tb_per_s']:.2f} TB/s "
          f"{row['tflop_per_s']:.0f} TFLOP/s  kernels={t.get('kernels')}", flush=True)
    dump(copy, rows)
  return copy, rows


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> dict:
  """Device copy ceiling: bytes read + written per second of y = x + 1 on an int32 buffer of nbytes."""
  x = jnp.zeros((nbytes // 4,), jnp.int32)
  f = jax.jit(lambda a: a + 1)
  t = time_call(f, x, iters=iters)
  return dict(bytes=2 * nbytes, us=t["us"], tb_per_s=2 * nbytes / (t["us"] * 1e-6) / 1e12, method=t["method"])


def git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
  except Exception:  # noqa: BLE001 - no git on the device machine: the caller passes --commit
    return "unknown"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="bench/results/mla_mosaic_check.json")
  ap.add_argument("--cases", default="full", choices=["full", "tiny", "none"])
  ap.add_argument("--timing", action="store_true")
  ap.add_argument("--only", default=None, help="time only these variants (comma list of exact names)")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--variant-timeout", type=float, default=150,
                  help="seconds a timing variant may take (compile included) before it is recorded as hung and the "
                       "run ends with status 3 (0: no limit)")
  ap.add_argument("--case-grep", default=None, help="run only the correctness cases whose name contains this")
  ap.add_argument("--interpret", action="store_true", help="CPU GPU-interpret mode (use --cases tiny)")
  ap.add_argument("--kernel", default="auto", choices=list(mosaic_sm90.KERNELS),
                  help="mosaic_sm90 kernel for the correctness cases (auto: seesaw where Sq*H %% 64 == 0, else "
                       "swapped)")
  ap.add_argument("--commit", default=None)
  args = ap.parse_args()
  if args.only:
    # an --only name that matches no variant would be skipped silently after minutes of checks: refuse it now
    unknown = [n for n in args.only.split(",") if n not in {v[0] for v in timing_variants()}]
    if unknown:
      ap.error(f"--only: no timing variant named {unknown}; variant names: "
               f"{', '.join(v[0] for v in timing_variants())}")
  dev = jax.devices()[0]
  info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
              commit=args.commit or git_commit(), time=time.strftime("%Y-%m-%d %H:%M:%S"))
  print(f"[info] {info}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

  def dump(checks, copy, timings):      # rewritten after every step: a killed run keeps what it measured
    with open(args.out, "w") as f:
      json.dump(dict(info=info, checks=checks, copy=copy, timings=timings), f, indent=1)

  checks = (run_correctness(args.cases, args.interpret, args.kernel, args.case_grep) if args.cases != "none"
            else [])
  dump(checks, None, [])
  copy, timings = (run_timing(args.iters, args.only, lambda c, r: dump(checks, c, r), args.variant_timeout)
                   if args.timing
                   else (None, []))
  dump(checks, copy, timings)
  print(f"\n{'case (kernel)':44s} {'ok':>5s} {'out_err':>9s} {'cos_diff':>9s} {'lse_err':>9s} {'first_s':>7s}")
  for r in checks:
    print(f"{r['case'] + ' (' + r['kernel'] + ')':44s} {str(r['ok']):>5s} {r['out_max_abs_err']:9.2e} {r['cos_diff']:9.1e} "
          f"{r['lse_max_abs_err']:9.1e} {r['first_call_s']:7.1f}")
  if timings:
    print(f"\ncopy ceiling {copy['tb_per_s']:.3f} TB/s")
    print(f"{'variant':34s} {'us':>9s} {'kern_us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} {'%copy':>6s} "
          f"{'layer_us':>9s} {'layer_TF':>8s}")
    for r in timings:
      if "error" in r:
        print(f"{r['variant']:34s} ERROR {r['error'][:80]}")
        continue
      print(f"{r['variant']:34s} {r['us']:9.1f} {r['main_kernel_us']:9.1f} {r['tb_per_s']:6.2f} "
            f"{r['tflop_per_s']:8.1f} {r['pct_copy']:6.1f} {r['layer_us']:9.1f} {r['layer_tflop_per_s']:8.1f}")
  print(f"\nwrote {args.out}")
  return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
