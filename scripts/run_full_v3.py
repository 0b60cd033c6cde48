"""Full-size DeepSeek-V3 (61 layers, 256 experts, hidden 7168) with random AWQ int4 weights on 8 GPUs: TP8 and
data-parallel attention, fp8 KV cache; output tokens/s at several batch sizes, decode-step latency against its
HBM roofline, memory per GPU. JSON to bench/results/.

    # on 8 GPUs (weights are generated on the GPUs, sharded; nothing is downloaded):
    python scripts/run_full_v3.py --modes tp dp --batches 64 128 256 --prompt-len 1000 --gen-len 1000
    # on a CPU, 8 simulated devices: the full-size sharded plan, abstractly (no allocation): per-device bytes of
    # weights and cache, and the decode step traced and lowered with those shardings
    python scripts/run_full_v3.py --dry-run
    # on a CPU, the whole run path on a tiny V3-shaped model (8 simulated devices):
    python scripts/run_full_v3.py --small --batches 8 --prompt-len 20 --gen-len 6

Roofline of one decode step (per GPU): every byte a step must read from HBM once — the weights the step touches
(attention, dense MLPs, shared experts, embeddings/lm_head, and the routed experts that at least one token of the
batch routes to, expected count E·(1-(1-k/E)^B) over all devices) plus the KV cache of the sequences the GPU
attends (TP: all B sequences, replicated cache; DP: B/8) — divided by the HBM copy bandwidth measured on an H200
(4,268 GB/s, docs/architecture.md §11).
"""
from __future__ import annotations

import argparse
import os

HBM_BYTES_PER_S = 4268e9          # H200 HBM copy bandwidth measured (docs/architecture.md §11)

# A tiny model with V3's structure and the real MLA cache dims, for checking the run path on a CPU (--small; AWQ
# group 16, so that row-split weights have a multiple of 8 groups).
SMALL_V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, first_k_dense_replace=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, 8 simulated devices, abstract shapes only")
    ap.add_argument("--small", action="store_true", help="tiny V3-shaped model (CPU check of the run path)")
    ap.add_argument("--modes", nargs="+", choices=("tp", "dp"), default=["tp", "dp"],
                    help="tp: tensor-parallel attention (TP8); dp: data-parallel attention")
    ap.add_argument("--num-devices", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--gen-len", type=int, default=1000)
    ap.add_argument("--group-size", type=int, default=64, help="AWQ group size of the random weights")
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "bfloat16"))
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (tokens per step)")
    ap.add_argument("--lower", action="store_true", help="dry run: also trace and lower the decode step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/full_v3_<kind>.json)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run or args.small:
        # Simulated CPU devices: must be set before jax creates its CPU client.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.num_devices}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from mla_jax.config import ModelConfig, deepseek_v3_hf_config

    hf = deepseek_v3_hf_config(16, **SMALL_V3) if args.small else deepseek_v3_hf_config(args.group_size)
    cfg = ModelConfig.from_hf_dict(hf)
    if jax.device_count() < args.num_devices:
        raise SystemExit(f"needs {args.num_devices} devices, found {jax.device_count()} "
                         f"({jax.devices()[0].platform}); use --dry-run on a CPU")
    if args.dry_run:
        result = dry_run(cfg, args)
        kind = "dryrun"
    else:
        result = run(cfg, args)
        kind = "small_cpu" if args.small else "gpu"
    write_json(result, args.out or os.path.join("bench", "results", f"full_v3_{kind}.json"))


# ---------------------------------------------------------------------------------------------------------------
def pages_per_seq(args) -> int:
    return -(-(args.prompt_len + args.gen_len) // 64)


def num_pages_for(args, batch: int, mode: str) -> int:
    """Pages per layer for `batch` sequences of prompt+gen tokens (+ scratch): TP one pool, DP one per device."""
    if mode == "dp":
        return args.num_devices * ((batch // args.num_devices) * pages_per_seq(args) + 1)
    return batch * pages_per_seq(args) + 1


def expected_experts_touched(cfg, batch: int) -> float:
    """Expected number of distinct routed experts a decode step of `batch` tokens uses (uniform routing)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** batch)


def decode_roofline(cfg, mem: dict, args, batch: int, mode: str, context: int) -> dict:
    """Bytes one GPU must read per decode step and the time that takes at HBM bandwidth."""
    touched = expected_experts_touched(cfg, batch) / cfg.n_routed_experts
    weights = mem["weights_total"] - mem.get("routed_experts", 0) * (1 - touched)
    seqs = batch // args.num_devices if mode == "dp" else batch
    cache_bytes_per_token = {"fp8_e4m3": 656, "bfloat16": 1152}[args.kv_cache_dtype]
    cache = seqs * context * cache_bytes_per_token * cfg.num_hidden_layers
    return {"bytes_weights": int(weights), "bytes_kv_cache": int(cache),
            "seconds": (weights + cache) / HBM_BYTES_PER_S, "context_tokens": context,
            "expected_experts_touched": expected_experts_touched(cfg, batch)}


def dry_run(cfg, args) -> dict:
    import jax
    import jax.numpy as jnp

    from mla_jax import sharding
    from mla_jax.engine.memory import abstract_engine_state, memory_per_device

    rows = []
    for mode in args.modes:
        plan = sharding.ShardingPlan.create(cfg, args.num_devices, mode == "dp")
        for batch in args.batches:
            num_pages = num_pages_for(args, batch, mode)
            graphdef, weights, caches = abstract_engine_state(
                cfg, jnp.bfloat16, num_pages=num_pages, cache_dtype=args.kv_cache_dtype)
            mem = memory_per_device(plan, weights, caches)
            roof = decode_roofline(cfg, mem, args, batch, mode, args.prompt_len + args.gen_len // 2)
            row = dict(mode=mode, batch=batch, num_pages=num_pages, bytes_per_device=mem, decode_roofline=roof)
            if args.lower:
                row["lowered"] = lower_decode(graphdef, weights, caches, plan, cfg, batch, args)
            rows.append(row)
            print_row(row)
    return {"kind": "dry_run", "devices": f"{args.num_devices} simulated CPU devices", "config": "DeepSeek-V3 "
            f"full size, AWQ int4 group {args.group_size}, bf16 activations, {args.kv_cache_dtype} cache",
            "prompt_len": args.prompt_len, "gen_len": args.gen_len, "rows": rows, **env_info()}


def lower_decode(graphdef, weights, caches, plan, cfg, batch, args) -> dict:
    """Traces and lowers the engine's sharded decode step (mla_jax.engine.steps.decode_step with the plan, the
    function LLM jits) on abstract full-size inputs: shapes and shardings check out, nothing is allocated. The
    attention backend is the portable xla one (Pallas GPU kernels do not lower for a CPU)."""
    import time

    import jax
    import jax.numpy as jnp

    from mla_jax.engine.steps import decode_step

    def sds(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    w = jax.tree.map(sds, weights, plan.engine_weight_shardings(weights))
    c = jax.tree.map(sds, caches, plan.cache_shardings(caches))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=plan.replicated_sharding)
    fn = jax.jit(decode_step, static_argnums=(0,), static_argnames=("backend", "interpret", "plan"),
                 donate_argnums=(2,))
    t0 = time.perf_counter()
    lowered = fn.lower(graphdef, w, c, i32(batch), i32(batch), i32(batch), i32(batch, pages_per_seq(args)),
                       i32(batch), backend="xla", interpret=False, plan=plan)
    secs = time.perf_counter() - t0
    text = lowered.as_text()
    return {"lower_seconds": round(secs, 1), "stablehlo_chars": len(text),
            "manual_computations": text.count("sdy.manual_computation") + text.count("shard_map")}


# ---------------------------------------------------------------------------------------------------------------
def run(cfg, args) -> dict:
    """Random sharded weights (generated on the devices), then per mode and batch: one warm-up generate (compiles
    every bucket the timed run uses), one timed generate of `batch` prompts × gen_len tokens (ignore_eos)."""
    import gc
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mla_jax import sharding
    from mla_jax.checkpoint.sharded import init_sharded
    from mla_jax.engine import LLM, SamplingParams
    from mla_jax.engine.memory import abstract_engine_state, memory_per_device

    rng = np.random.default_rng(args.seed)
    rows = []
    for mode in args.modes:
        plan = sharding.ShardingPlan.create(cfg, args.num_devices, mode == "dp")
        t0 = time.perf_counter()
        model = init_sharded(cfg, plan, jnp.bfloat16, seed=args.seed)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        init_s = time.perf_counter() - t0
        print(f"[{mode}] random AWQ weights generated on {args.num_devices} devices in {init_s:.1f}s")
        for batch in args.batches:
            num_pages = num_pages_for(args, batch, mode)
            llm = LLM.from_model(
                model, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                max_model_len=args.prompt_len + args.gen_len, max_num_seqs=batch, num_pages=num_pages,
                max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.num_devices,
                data_parallel_attention=mode == "dp", sharding_plan=plan)
            steps = llm.record_decode_times()    # (batch rows, seconds) per decode step
            prompts = rng.integers(2, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=min(3, args.gen_len), ignore_eos=True))
            warm_s = time.perf_counter() - t0
            steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
            total_s = time.perf_counter() - t0
            n_out = sum(len(o.token_ids) for o in outs)
            ttft = max(o.metrics["time_to_first_token_s"] for o in outs)
            full = [s for b, s in steps if b == max(b for b, _ in steps)]
            graphdef, weights, caches = abstract_engine_state(
                cfg, jnp.bfloat16, num_pages=num_pages, cache_dtype=args.kv_cache_dtype)
            mem = memory_per_device(plan, weights, caches)
            roof = decode_roofline(cfg, mem, args, batch, mode, args.prompt_len + args.gen_len // 2)
            step_ms = statistics.median(full) * 1e3 if full else None
            row = dict(mode=mode, batch=batch, num_pages=num_pages, backend=llm.backend, output_tokens=n_out,
                       total_s=total_s, output_tok_per_s=n_out / total_s,
                       total_tok_per_s=(n_out + batch * args.prompt_len) / total_s,
                       time_to_last_first_token_s=ttft, warmup_s=warm_s, decode_steps=len(steps),
                       decode_step_ms_median=step_ms,
                       decode_step_ms_p90=float(np.percentile(full, 90)) * 1e3 if full else None,
                       decode_roofline_ms=roof["seconds"] * 1e3,
                       decode_roofline_fraction=roof["seconds"] * 1e3 / step_ms if step_ms else None,
                       roofline=roof, planned_bytes_per_device=mem, device_memory=device_memory())
            rows.append(row)
            print(f"[{mode}] batch {batch:4d}: {row['output_tok_per_s']:9.1f} output tok/s  "
                  f"({row['total_tok_per_s']:9.1f} total)  decode step {step_ms or float('nan'):8.2f} ms "
                  f"(roofline {row['decode_roofline_ms']:.2f} ms)  peak mem/GPU "
                  f"{max(m.get('peak_bytes_in_use', 0) for m in row['device_memory']) / 2**30:.1f} GiB")
            del llm, outs
            gc.collect()
        del model
        gc.collect()
    return {"kind": "run", "config": f"DeepSeek-V3 {'small (CPU check)' if args.small else 'full size'}, AWQ "
            f"int4 group {cfg.quantization.group_size} random weights, bf16 activations, {args.kv_cache_dtype} "
            f"cache", "prompt_len": args.prompt_len, "gen_len": args.gen_len, "rows": rows, **env_info()}


def device_memory() -> list:
    import jax
    out = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        out.append({k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats})
    return out


# ---------------------------------------------------------------------------------------------------------------
def gib(n) -> str:
    return f"{n / 2**30:8.2f}"


def print_row(row) -> None:
    m = row["bytes_per_device"]
    r = row["decode_roofline"]
    if not getattr(print_row, "_header", False):
        print(f"{'mode':4s} {'batch':>5s} {'pages':>6s} | GiB per device: {'attn':>8s} {'experts':>8s} "
              f"{'dense+sh':>8s} {'emb+head':>8s} {'W_UK/UV':>8s} {'weights':>8s} {'kv':>8s} {'total':>8s} | "
              f"decode roofline ms")
        print_row._header = True
    dense = m.get("dense_mlp", 0) + m.get("shared_experts", 0) + m.get("router", 0) + m.get("norms", 0)
    print(f"{row['mode']:4s} {row['batch']:5d} {row['num_pages']:6d} |                {gib(m.get('attention', 0))} "
          f"{gib(m.get('routed_experts', 0))} {gib(dense)} {gib(m.get('embed_lm_head', 0))} "
          f"{gib(m['absorbed_w_uk_w_uv'])} {gib(m['weights_total'])} {gib(m['kv_cache'])} {gib(m['total'])} | "
          f"{r['seconds'] * 1e3:8.2f}")


def env_info() -> dict:
    import subprocess

    import jax
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = None
    return {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
            "num_devices": jax.device_count(), "git_commit": commit}


def write_json(result: dict, path: str) -> None:
    import json
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
