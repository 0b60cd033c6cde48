"""Benchmark of the split-KV merge kernel (pallas_kernels.mla_decode.split_kv.merge_partials) alone, by its tiling.

  python scripts/bench_merge.py --out bench/results/merge_<device>_<commit>.json [--commit SHA] [--iters 20]

The merge is a latency-bound kernel: each program walks its sequence's partials one after another, so a batch with
few sequences (b32 L16384) or many cut ones (ragged lengths, Sq 2 at h128) gives few programs long chains. For the
partial shapes mosaic_sm90 writes at the benchmark's shapes (the swapped kernel's [E*G, 512, 16] with
register_dequant's row order; the seesaw kernel's [E*G, 64, 512] with its direct-written outputs), with the split
schedule of their lengths, this times each (latent columns a program, Triton warps, stages) configuration by CUPTI
and checks that its output has the bits of the default's (the same sums in the same order). Prints a table last and
writes JSON (device, jax version, commit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.mla_decode import mosaic_sm90, sm90_fp8_operands, split_kv
from pallas_kernels.testing import commit_id, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_mla_gpu import variant_lens  # noqa: E402  (a sibling script: its timing variants' lengths)

# (name, batch, length, ragged lengths, query rows a sequence, kernel)
SHAPES = (("fp8 h16 b128 L4096", 128, 4096, False, 16, "swapped"),
          ("fp8 h16 b128 ragged[1..2L]", 128, 4096, True, 16, "swapped"),
          ("fp8 h16 b32 L16384", 32, 16384, False, 16, "swapped"),
          ("fp8 h128 sq2 b128 L4096", 128, 4096, False, 256, "seesaw"),
          ("fp8 h128 b128 ragged[1..2L]", 128, 4096, True, 128, "seesaw"))
# (latent columns a program, Triton warps, Triton stages); the first is the default (cols None: split_kv.merge_cols)
CONFIGS = ((None, split_kv.MERGE_WARPS, split_kv.MERGE_STAGES),
           (128, 4, 1), (64, 4, 1), (32, 4, 1), (128, 4, 2), (64, 4, 2), (64, 2, 1), (32, 2, 1))


def problem(batch: int, length: int, ragged: bool, rows: int, kernel: str, interpret: bool = False):
  """The merge's operands as mosaic_sm90 builds them for this shape (random partial values), and its kwargs
  (interpret: the schedule kernel in interpret mode, for a CPU)."""
  lens = jnp.asarray(variant_lens(batch, length, ragged), jnp.int32)
  num_sms = mosaic_sm90._num_sms()
  if kernel == "swapped":
    plan = mosaic_sm90.make_plan(rows, True)
    groups, n, parts, cut = plan.groups, plan.n, plan.num_parts, 0
    kw = dict(row_of_dim=sm90_fp8_operands.row_of_dim if plan.register_dequant else None)
  else:
    plan = mosaic_sm90.mosaic_sm90_seesaw.make_plan(rows, num_sms=num_sms, fp8=True)
    groups, n, parts, cut = plan.groups, 64, plan.num_parts, split_kv.CUT_PAGES_DIRECT
    kw = dict(rows_major=True)
  cu, _, payload = split_kv.schedule_kernel(lens, parts, page=mosaic_sm90.PAGE, cut_pages=cut, interpret=interpret)
  entries = (parts + batch) * groups
  k1, k2 = jax.random.split(jax.random.key(batch + rows))
  shape = (entries, n, 512) if kernel == "seesaw" else (entries, 512, n)
  o_part = jax.random.normal(k1, shape, jnp.float32)
  lse2 = jax.random.normal(k2, (entries, n), jnp.float32) * 4
  if kernel == "seesaw":        # the direct-written outputs the merge updates in place for the cut sequences
    kw["direct"] = (jnp.zeros((batch, groups * n, 512), jnp.bfloat16), jnp.zeros((batch, groups * n), jnp.float32))
  return (o_part, lse2, cu, payload), dict(batch=batch, groups=groups, **kw)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--commit", default=None)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  dev = jax.devices()[0]
  info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, commit=commit_id(args.commit))
  rows = []
  for name, batch, length, ragged, qrows, kernel in SHAPES:
    operands, kw = problem(batch, length, ragged, qrows, kernel)
    reference = None
    for cols, warps, stages in CONFIGS:
      direct = kw.get("direct")
      fn = jax.jit(lambda o, l, c, p, d, cols=cols, warps=warps, stages=stages: split_kv.merge_partials(
          o, l, c, p, cols=cols, num_warps=warps, num_stages=stages,
          **{**kw, "direct": d}))
      out = jax.block_until_ready(fn(*operands, direct))
      if reference is None:
        reference = out
      same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(out, reference))
      t = device_time(fn, *operands, direct, iters=args.iters)
      # the merge kernel alone (the seesaw shapes' jitted call also copies the direct outputs it updates in place)
      merge_us = sum(v for k, v in (t.get("kernels") or {}).items() if "merge_partials" in k) or t["us"]
      rows.append(dict(shape=name, cols=cols or split_kv.merge_cols(kw["batch"], kw["groups"],
                                                                     kw.get("rows_major", False)),
                       default=cols is None, num_warps=warps, num_stages=stages, us=merge_us, call_us=t["us"],
                       method=t["method"], kernels=t.get("kernels"), same_bits_as_default=same))
      print(f"{name:28s} cols {rows[-1]['cols']:3d}{'*' if cols is None else ' '} warps {warps} stages {stages}  "
            f"{merge_us:7.2f} us  same bits: {same}",
            flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(info=info, rows=rows), f, indent=1)
  print(f"\n{'shape':28s} " + " ".join(f"{c or 'auto'}/{w}/{s:<5}" for c, w, s in CONFIGS)
        + "   (cols/warps/stages, µs)")
  for name, *_ in SHAPES:
    print(f"{name:28s} " + " ".join(f"{r['us']:9.2f}" for r in rows if r["shape"] == name))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
