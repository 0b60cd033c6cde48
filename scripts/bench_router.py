"""Device time of the MoE router and the grouping of its pairs at DeepSeek-V3 shapes (D=7168, E=256, top-8,
8 groups, top-4 groups, noaux_tc), batch T = 1 / 16 / 64, one GPU.

  python scripts/bench_router.py --out bench/results/router_h200.json [--commit SHA]

Times (CUPTI, every kernel of the call): the router's logits dot in fp32 (the model's), as split-K einsums, and
with bf16 weights (what a bf16 router weight would cost); the selection (sigmoid, bias, group top-2, top-4
groups, top-8) written with `jax.lax.top_k` (moe_router's XLA reference) and as moe_router's Pallas Triton kernel;
the whole `Router` call with either; and the grouping for the grouped W4A16 kernels, `routing.align` (XLA) and
`routing_triton.align_kernel` (one launch), at the block sizes of both kernel backends. Each variant's output is
compared with the model's (the selection) or with routing.align's (the grouping). (A sort-free
rank-based top-k was measured at 2d323df: selection 15-17 us against 13.9 at T=64, no gain; it was reverted.)
Prints a table last and writes JSON (device, jax version, commit).
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import ModelConfig, deepseek_v3_hf_config
from mla_jax.model.moe import Router
from pallas_kernels.testing import commit_id, device_time
from pallas_kernels import moe_router
from pallas_kernels.w4a16 import api, routing, routing_triton

SCALE = 2.5          # DeepSeek-V3's routed_scaling_factor


def normalised(select):
  """A selection (scores, bias -> ids, weights) with the model's norm_topk_prob and routed scaling applied."""
  def fn(scores, bias):
    idx, w = select(scores, bias, k=8, n_group=8, topk_group=4)
    return idx, w / (w.sum(-1, keepdims=True) + 1e-20) * SCALE
  return fn


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="bench/results/router.json")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--ts", default="1,16,64")
  args = ap.parse_args()
  dev = jax.devices()[0]
  info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, commit=commit_id(args.commit))
  print(f"[info] {info}", flush=True)
  cfg = ModelConfig.from_hf_dict(deepseek_v3_hf_config())      # the router's fields are DeepSeek-V3's
  router = Router(cfg, rngs=nnx.Rngs(0))
  router.e_score_correction_bias[...] = jax.random.normal(jax.random.key(5), (256,), jnp.float32) * 0.01
  kernel, bias = router.kernel[...], router.e_score_correction_bias[...]
  d, e = kernel.shape
  hi = jax.lax.Precision.HIGHEST

  def split_k(s):
    return lambda x, w: jnp.einsum("tsd,sde->tse", x.astype(jnp.float32).reshape(x.shape[0], s, d // s),
                                   w.reshape(s, d // s, e), precision=hi).sum(1)

  logits_variants = {
      "logits fp32 (model)": (lambda x, w: jnp.dot(x.astype(jnp.float32), w, precision=hi), kernel),
      **{f"logits fp32 split-K {s}": (split_k(s), kernel) for s in (4, 8, 16)},
      "logits bf16 weights": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                              kernel.astype(jnp.bfloat16)),
  }
  rows = []
  for t in [int(v) for v in args.ts.split(",")]:
    first = len(rows)
    x = jax.random.normal(jax.random.key(t), (t, d), jnp.bfloat16)
    ref_logits = jnp.dot(x.astype(jnp.float32), kernel, precision=hi)
    for name, (fn, w) in logits_variants.items():
      f = jax.jit(fn)
      err = float(jnp.max(jnp.abs(f(x, w) - ref_logits)) / jnp.max(jnp.abs(ref_logits)))
      rows.append(dict(t=t, variant=name, rel_err=err, **device_time(f, x, w)))
    scores = jax.nn.sigmoid(ref_logits)
    ref_idx, ref_w = router(x)
    for name, select in (("lax.top_k", moe_router.reference.select_noaux_tc),
                         ("moe_router triton", moe_router.triton.select_noaux_tc)):
      f_select = jax.jit(normalised(select))
      idx, w = f_select(scores, bias)
      same = bool(jnp.all(idx == ref_idx)) and float(jnp.max(jnp.abs(w - ref_w))) == 0.0
      rows.append(dict(t=t, variant=f"selection {name}", same_as_model=same, **device_time(f_select, scores, bias)))
    for backend in ("auto", "xla"):
      router.select_backend = backend
      graph, state = nnx.split(router)
      f_router = jax.jit(lambda st, x: nnx.merge(graph, st)(x))
      rows.append(dict(t=t, variant=f"Router (model: fp32 dot + select {backend})", **device_time(f_router, state, x)))
    router.select_backend = "auto"
    for backend in ("triton", "mosaic_sm90"):
      bm = api.default_block_m(t, 8, e, backend)
      f_align = jax.jit(lambda i, w: routing.align(i, w, e, bm))
      want = f_align(ref_idx, ref_w)
      rows.append(dict(t=t, variant=f"routing.align block_m {bm}", **device_time(f_align, ref_idx, ref_w)))
      # the kernel's default, then its knobs (warps, pairs a program) around it, at the triton backend's block_m
      default = (routing_triton.NUM_WARPS, routing_triton.PAIR_CHUNK)
      knob_sets = [default] + ([kn for kn in ((4, 32), (8, 64), (16, 32)) if kn != default]
                               if backend == "triton" else [])
      for warps, chunk in knob_sets if t > 1 else []:
        f_kernel = jax.jit(lambda i, w, warps=warps, chunk=chunk: routing_triton.align_kernel(
            i, w, e, bm, num_warps=warps, pair_chunk=chunk))
        got = f_kernel(ref_idx, ref_w)
        same = all(bool(jnp.array_equal(getattr(got, n), getattr(want, n)))
                   for n in ("block_expert", "row_token", "row_weight", "pair_row"))
        knobs = "" if (warps, chunk) == default else f" warps {warps} chunk {chunk}"
        rows.append(dict(t=t, variant=f"align_kernel block_m {bm}{knobs}", same_as_model=same,
                         **device_time(f_kernel, ref_idx, ref_w)))
    for r in rows[first:]:
      print(f"[time] T={r['t']} {r['variant']}: {r['us']:.1f} us {r.get('kernels')}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(info=info, rows=rows), f, indent=1)
  print(f"\n{'T':>3s} {'variant':36s} {'us':>7s} {'kernels':>7s}  note")
  for r in rows:
    note = f"rel_err {r['rel_err']:.1e}" if "rel_err" in r else (f"same as model: {r['same_as_model']}"
                                                                  if "same_as_model" in r else "")
    print(f"{r['t']:3d} {r['variant']:36s} {r['us']:7.1f} {len(r.get('kernels') or {}):7d}  {note}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
