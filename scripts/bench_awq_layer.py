"""One full-width DeepSeek-V3 MoE decoder layer with random AWQ int4 weights built on the GPU: resident bytes vs
the formula (mla_jax.quant.awq.layer_resident_bytes), decode-step time for T = 1/16/64 tokens through the layer's
projections + MoE with the AWQ layers on each w4a16 backend (the Triton kernels and the XLA reference), and
per-linear timings of w4a16_matmul against the XLA reference and a bf16 dot.

  python scripts/bench_awq_layer.py --group-size 64 --out bench/results/awq_layer_h200.json [--commit SHA]

The decode step: input norm, q_a/q_b/kv_a projections (+RoPE), absorbed q_nope·W_UK and o_lat·W_UVᵀ with
W_UK/W_UV dequantized once from kv_b_proj, o_proj, residual, post norm, router, routed experts (AWQExperts),
shared expert, residual. The attention over the KV cache (the MLA decode kernel) is not part of it: o_lat is a
stand-in computed from q_lat and the latent. Prints a table last and writes JSON (device, jax version, commit).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.config import ModelConfig, deepseek_v3_hf_config
from mla_jax.model.transformer import DecoderLayer
import pallas_kernels
from mla_jax.quant import awq

HBM_GBPS = 4268.0  # H200 device-to-device copy measured in docs/architecture.md §11


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - no git on the device machine: the caller passes --commit
        return "unknown"


def bytes_in_use(dev) -> int:
    stats = dev.memory_stats() or {}
    return int(stats.get("bytes_in_use", -1))


def time_fn(fn, *args, iters: int = 20, reps: int = 5) -> dict:
    """Median over `reps` of the mean time of `iters` back-to-back calls (dispatch pipelined), and the median of
    single calls each waited for; microseconds."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    means = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        means.append((time.perf_counter() - t0) / iters * 1e6)
    singles = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        singles.append((time.perf_counter() - t0) * 1e6)
    return {"us": statistics.median(means), "us_single": statistics.median(singles),
            "us_spread": max(means) - min(means)}


def bench_linears(cfg, G: int, tokens: list[int], key, backends: list[str]) -> list[dict]:
    """w4a16_matmul (Triton kernel) vs the XLA dequantize-and-dot reference vs a bf16 dot, per linear and T."""
    rows = []
    H, D = cfg.num_attention_heads, cfg.hidden_size
    shapes = {"q_b_proj": (cfg.q_lora_rank, H * cfg.qk_head_dim), "o_proj": (H * cfg.v_head_dim, D),
              "expert_gate": (D, cfg.moe_intermediate_size),
              "kv_a_proj": (D, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
    quant = cfg.quantization
    for name, (n_in, n_out) in shapes.items():
        lin = nnx.jit(lambda: awq.AWQLinear(quant, n_in, n_out, dtype=jnp.bfloat16, rngs=nnx.Rngs(1)))()
        w = lin.weight()
        w_bf16 = lin.dequantized_kernel()
        awq_bytes = awq.linear_resident_bytes(n_in, n_out, G)
        for T in tokens:
            x = jax.random.normal(jax.random.fold_in(key, T), (T, n_in), jnp.bfloat16)
            f_bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
            y_ref = np.asarray(f_bf16(x, w_bf16), np.float32)
            variants = [(b, jax.jit(lambda x, w, b=b: pallas_kernels.w4a16_matmul(x, w, backend=b)), (x, w),
                         awq_bytes) for b in backends]
            variants.append(("bf16", f_bf16, (x, w_bf16), 2 * n_in * n_out))
            for variant, fn, fargs, nbytes in variants:
                compiled = fn.lower(*fargs).compile()
                y = np.asarray(compiled(*fargs), np.float32)
                err = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
                t = time_fn(compiled, *fargs)
                rows.append(dict(linear=name, shape=[n_in, n_out], T=T, variant=variant, rel_err_vs_bf16=err,
                                 weight_bytes=nbytes, gbps=nbytes / t["us"] / 1e3, **t))
                print(f"  {name:12s} T={T:3d} {variant:7s} {t['us']:9.1f} us  {rows[-1]['gbps']:7.0f} GB/s  "
                      f"err={err:.1e}", flush=True)
        del lin, w, w_bf16
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--backends", default="triton,xla", help="w4a16 backends of the AWQ layers to time")
    ap.add_argument("--out", default="bench/results/awq_layer.json")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--skip-linears", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a scaled-down layer (CPU check of the script only)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    backends = args.backends.split(",")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)

    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                commit=args.commit or git_commit(), time=time.strftime("%Y-%m-%d %H:%M:%S"),
                group_size=args.group_size, dtype="bfloat16")
    print(f"device {info['device']} jax {info['jax']} commit {info['commit']} G={args.group_size}", flush=True)
    shape = deepseek_v3_hf_config()
    if args.smoke:
        shape.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                     kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     n_routed_experts=16, moe_intermediate_size=128, n_group=4, topk_group=2)
    info["config"] = {k: shape[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                            "n_routed_experts", "moe_intermediate_size", "n_shared_experts",
                                            "num_experts_per_tok")}
    cfg = ModelConfig.from_hf_dict(dict(shape, quantization_config=dict(
        quant_method="awq", bits=4, group_size=args.group_size, zero_point=True, version="gemm")))
    formula = awq.layer_resident_bytes(cfg)

    # 1. resident bytes: build one MoE layer (index 3) with random AWQ weights on the GPU.
    base = bytes_in_use(dev)
    t0 = time.perf_counter()
    layer = nnx.jit(lambda: DecoderLayer(cfg, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))()
    jax.block_until_ready(nnx.state(layer))
    build_s = time.perf_counter() - t0
    resident = bytes_in_use(dev) - base
    held = {}
    for path, v in nnx.to_flat_state(nnx.state(layer)):
        a = v.get_value()
        kind = str(a.dtype)
        held[kind] = held.get(kind, 0) + a.size * a.dtype.itemsize
    memory = dict(measured_bytes=resident, formula=formula, logical_bytes_by_dtype=held, build_s=build_s,
                  measured_over_formula=resident / formula["total"])
    print(f"resident: measured {resident:,} B, formula {formula['total']:,} B "
          f"(ratio {resident / formula['total']:.4f}); build {build_s:.1f}s", flush=True)

    steps: list[dict] = []
    experts_rows: list[dict] = []
    linears: list[dict] = []

    def dump():  # called after every measurement: partial results survive a later failure
        with open(args.out, "w") as f:
            json.dump(dict(info=info, memory=memory, decode_step=steps, experts=experts_rows, linears=linears), f,
                      indent=1)

    dump()

    # 2. decode step through the layer.
    attn = layer.self_attn
    w_uk, w_uv = jax.jit(lambda s: nnx.merge(nnx.graphdef(attn), s).absorbed_weights())(nnx.state(attn))
    key = jax.random.key(0)
    for backend in backends:
        awq.configure_w4a16(layer, backend=backend)
        graphdef, state = nnx.split(layer)

        def decode_step(state, w_uk, w_uv, x, pos):
            lay = nnx.merge(graphdef, state)
            a = lay.self_attn
            h = lay.input_layernorm(x)
            q_nope, q_rope = a.project_q(h, pos)                                   # [T,H,128], [T,H,64]
            latent, k_rope = a.project_kv(h, pos)                                  # [T,512], [T,64]
            # head-major batched dots (XLA:CPU cannot run a bf16->f32 dot with a non-leading batch dim)
            q_lat = jnp.einsum("htn,hnc->htc", q_nope.swapaxes(0, 1), w_uk, preferred_element_type=jnp.float32)
            # stand-in for the MLA kernel's P·latent (not timed here); keeps q_rope/k_rope live
            o_lat = (q_lat * 1e-2 + latent[None].astype(jnp.float32)
                     + (q_rope.swapaxes(0, 1).astype(jnp.float32).sum(-1, keepdims=True)
                        + k_rope[None, :, :1].astype(jnp.float32)) * 1e-3)
            o = jnp.einsum("htc,hvc->htv", o_lat.astype(x.dtype), w_uv, preferred_element_type=jnp.float32)
            x = x + a.output(o.swapaxes(0, 1).astype(x.dtype))
            return x + lay.mlp(lay.post_attention_layernorm(x))

        step = jax.jit(decode_step)

        def experts_only(state, x, idx, w):
            return nnx.merge(graphdef, state).mlp.experts(x, idx, w)

        experts_fn = jax.jit(experts_only)
        for T in tokens:
            x = jax.random.normal(jax.random.fold_in(key, T), (T, cfg.hidden_size), jnp.bfloat16)
            pos = jnp.arange(T, dtype=jnp.int32) + 100
            compiled = step.lower(state, w_uk, w_uv, x, pos).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            y = compiled(state, w_uk, w_uv, x, pos)
            finite = bool(jnp.isfinite(y.astype(jnp.float32)).all())
            t = time_fn(compiled, state, w_uk, w_uv, x, pos, iters=10)
            # routing of this input: unique experts -> bytes a step must read at least
            h2 = layer.post_attention_layernorm(x)
            idx, wts = layer.mlp.route(h2)
            uniq = int(np.unique(np.asarray(idx)).size)
            E_bytes = 3 * awq.linear_resident_bytes(cfg.hidden_size, cfg.moe_intermediate_size, args.group_size)
            dense_bytes = formula["quantized"] - cfg.n_routed_experts * E_bytes
            floor_bytes = dense_bytes + uniq * E_bytes
            floor_us = floor_bytes / HBM_GBPS / 1e3
            steps.append(dict(T=T, backend=backend, unique_experts=uniq, temp_bytes=temp, finite=finite,
                              min_bytes=floor_bytes, floor_us=floor_us, **t))
            print(f"  step T={T:3d} {backend:6s}: {t['us']:9.1f} us (single {t['us_single']:.1f}), unique experts "
                  f"{uniq}, floor {floor_us:.0f} us, temp {temp / 2**20:.0f} MiB, finite={finite}", flush=True)
            ce = experts_fn.lower(state, h2, idx, wts).compile()
            te = time_fn(ce, state, h2, idx, wts, iters=10)
            # correctness of this backend's experts against the XLA reference on the same weights and routing
            w13, w2 = layer.mlp.experts.weights()
            ref = np.asarray(jax.jit(lambda x, i, w, a, b: pallas_kernels.w4a16_moe(x, i, w, a, b, backend="xla"))(
                h2, idx, wts, w13, w2), np.float32)
            got = np.asarray(ce(state, h2, idx, wts), np.float32)
            te["rel_err_vs_xla"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            experts_rows.append(dict(T=T, backend=backend, unique_experts=uniq,
                                     temp_bytes=ce.memory_analysis().temp_size_in_bytes,
                                     floor_us=uniq * E_bytes / HBM_GBPS / 1e3, **te))
            dump()
            print(f"    experts only: {te['us']:9.1f} us (rel err vs xla {te['rel_err_vs_xla']:.1e}), floor "
                  f"{experts_rows[-1]['floor_us']:.0f} us, temp "
                  f"{experts_rows[-1]['temp_bytes'] / 2**20:.0f} MiB", flush=True)

    if not args.skip_linears:
        linears.extend(bench_linears(cfg, args.group_size, tokens, key, backends))
    dump()

    print(f"\nAWQ DeepSeek-V3 MoE layer, G={args.group_size}, bf16 activations, {info['device']}, jax {info['jax']}, "
          f"commit {info['commit']}")
    print(f"resident bytes: measured {resident:,} vs formula {formula['total']:,} "
          f"(quantized {formula['quantized']:,} + unquantized {formula['unquantized']:,}); "
          f"ratio {resident / formula['total']:.4f}")
    print(f"{'T':>4} {'backend':>7} {'step us':>9} {'experts us':>11} {'floor us':>9} {'uniq E':>7} {'temp MiB':>9}")
    for s, e in zip(steps, experts_rows):
        print(f"{s['T']:4d} {s['backend']:>7} {s['us']:9.1f} {e['us']:11.1f} {s['floor_us']:9.1f} "
              f"{s['unique_experts']:7d} {s['temp_bytes'] / 2**20:9.0f}")
    if linears:
        cols = backends + ["bf16"]
        print(f"{'linear':12s} {'T':>3} " + " ".join(f"{c + ' us':>10}" for c in cols)
              + f" {cols[0] + ' GB/s':>12}")
        by = {}
        for r in linears:
            by.setdefault((r["linear"], r["T"]), {})[r["variant"]] = r
        for (name, T), v in by.items():
            print(f"{name:12s} {T:3d} " + " ".join(f"{v[c]['us']:10.1f}" for c in cols)
                  + f" {v[cols[0]]['gbps']:12.0f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
