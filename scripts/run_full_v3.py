"""DeepSeek-V3 at full width (hidden 7168, 256 experts, 128 heads) with random AWQ int4 weights, at any depth
(--num-layers) and device count (--num-devices 1, 2, 8): tensor-parallel attention (tp) and data-parallel attention
with expert parallelism (dp), under both expert dispatch paths (all_gather, all_to_all); fp8 KV cache. Reports
output tokens/s, decode-step latency against its HBM roofline, measured memory per GPU, the 1 -> N GPU scaling at
the same per-GPU batch, and (--measure-layer) what one MoE layer's expert dispatch costs under each path against
the measured collective bandwidth. JSON to bench/results/ (rewritten after every row, so a run stopped by a time
limit keeps what it measured).

    # 8 GPUs, all 61 layers:
    python scripts/run_full_v3.py --num-devices 8 --modes tp dp --batches 64 128 256 --prompt-len 1000 --gen-len 1000
    # 2 GPUs vs 1 GPU, 8 layers, the same per-GPU batch (global batch = per-GPU batch x devices):
    python scripts/run_full_v3.py --num-layers 8 --num-devices 1 2 --modes dp tp --per-device-batch --batches 64 \\
        --prompt-len 256 --gen-len 64 --measure-layer --time-budget-s 420
    # on a CPU, 8 simulated devices: the full-size sharded plan, abstractly (no allocation): per-device bytes of
    # weights and cache, and the decode step traced and lowered with those shardings
    python scripts/run_full_v3.py --dry-run
    # on a CPU, the whole run path on a tiny V3-shaped model (simulated devices):
    python scripts/run_full_v3.py --small --num-devices 1 2 --per-device-batch --batches 4 --prompt-len 20 --gen-len 6

--num-layers L keeps V3's first min(3, L-1) layers dense (V3 has 3 dense layers, then MoE), so every depth has MoE
layers. With --per-device-batch each batch in --batches is per GPU: N GPUs run N x that many sequences.

Roofline of one decode step (per GPU): every byte a step must read from HBM once — the weights the step touches
(attention, dense MLPs, shared experts, embeddings/lm_head, and the routed experts that at least one token of the
batch routes to, expected count E·(1-(1-k/E)^B) over all devices) plus the KV cache of the sequences the GPU
attends (TP: all B sequences, replicated cache; DP: B/N) — divided by the HBM copy bandwidth measured on an H200
(4,268 GB/s, docs/architecture.md §11). Collective time is not in it.
"""
from __future__ import annotations

import argparse
import os
import time

HBM_BYTES_PER_S = 4268e9          # H200 HBM copy bandwidth measured (docs/architecture.md §11)

# A tiny model with V3's structure and the real MLA cache dims, for checking the run path on a CPU (--small; AWQ
# group 16, so that row-split weights have a multiple of 8 groups).
SMALL_V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, first_k_dense_replace=1)
DISPATCHES = ("all_gather", "all_to_all")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, 8 simulated devices, abstract shapes only")
    ap.add_argument("--small", action="store_true", help="tiny V3-shaped model (CPU check of the run path)")
    ap.add_argument("--num-layers", type=int, default=None, help="full width, this many layers (default: all 61)")
    ap.add_argument("--modes", nargs="+", choices=("tp", "dp"), default=["tp", "dp"],
                    help="tp: tensor-parallel attention; dp: data-parallel attention (experts split in both)")
    ap.add_argument("--dispatches", nargs="+", choices=DISPATCHES, default=list(DISPATCHES),
                    help="expert dispatch paths to run (with more than one device)")
    ap.add_argument("--expert-capacity-factor", type=float, default=None,
                    help="all_to_all rows per peer as a fraction of a device's rows (default 1.0: never overflows)")
    ap.add_argument("--num-devices", type=int, nargs="+", default=[8],
                    help="device counts to run, in order (e.g. 1 2: the scaling from one GPU to two)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--per-device-batch", action="store_true",
                    help="--batches are per device: N devices run N x batch sequences")
    ap.add_argument("--measure-layer", action="store_true",
                    help="also time one MoE layer's routed experts under each dispatch, and the raw all-to-all / "
                         "all-gather bandwidth, at each batch")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no new run after this many seconds (the JSON says which were skipped)")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--gen-len", type=int, default=1000)
    ap.add_argument("--group-size", type=int, default=64, help="AWQ group size of the random weights")
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "bfloat16"))
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (tokens per step)")
    ap.add_argument("--lower", action="store_true", help="dry run: also trace and lower the decode step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None,
                    help="git commit to record (the device machine's copy of the tree has no usable .git)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/full_v3_<kind>.json)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    for n in args.num_devices:
        if n < 1:
            raise SystemExit(f"--num-devices must be >= 1, got {n}")
    if args.dry_run or args.small:
        # Simulated CPU devices: must be set before jax creates its CPU client.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={max(args.num_devices)}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from mla_jax.config import ModelConfig

    _count_compiles()
    cfg = ModelConfig.from_hf_dict(model_hf_config(args))
    if jax.device_count() < max(args.num_devices):
        raise SystemExit(f"needs {max(args.num_devices)} devices, found {jax.device_count()} "
                         f"({jax.devices()[0].platform}); use --dry-run on a CPU")
    kind = "dryrun" if args.dry_run else "small_cpu" if args.small else "gpu"
    out = args.out or os.path.join("bench", "results", f"full_v3_{kind}.json")
    if args.dry_run:
        write_json(dry_run(cfg, args), out)
    else:
        run(cfg, args, out)


def model_hf_config(args) -> dict:
    """config.json of the model: full-size V3 (or the tiny one with --small), cut to --num-layers."""
    from mla_jax.config import deepseek_v3_hf_config

    base = deepseek_v3_hf_config(16, **SMALL_V3) if args.small else deepseek_v3_hf_config(args.group_size)
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SystemExit(f"--num-layers must be >= 1, got {args.num_layers}")
        base.update(num_hidden_layers=args.num_layers,
                    first_k_dense_replace=min(base["first_k_dense_replace"], args.num_layers - 1))
    return base


def run_configs(args) -> list:
    """(devices, mode, dispatch) in order; one device has a single configuration ("single", no dispatch)."""
    out = []
    for n in args.num_devices:
        if n == 1:
            out.append((1, "single", None))
        else:
            out += [(n, mode, d) for mode in args.modes for d in args.dispatches]
    return out


def global_batch(args, batch: int, n: int) -> int:
    return batch * n if args.per_device_batch else batch


# ---------------------------------------------------------------------------------------------------------------
def pages_per_seq(args) -> int:
    return -(-(args.prompt_len + args.gen_len) // 64)


def num_pages_for(args, batch: int, mode: str, n: int) -> int:
    """Pages per layer for `batch` sequences of prompt+gen tokens (+ scratch): TP one pool, DP one per device."""
    if mode == "dp":
        return n * ((batch // n) * pages_per_seq(args) + 1)
    return batch * pages_per_seq(args) + 1


def expected_experts_touched(cfg, batch: int) -> float:
    """Expected number of distinct routed experts a decode step of `batch` tokens uses (uniform routing)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** batch)


def decode_roofline(cfg, mem: dict, args, batch: int, mode: str, context: int, n: int) -> dict:
    """Bytes one GPU must read per decode step and the time that takes at HBM bandwidth."""
    touched = expected_experts_touched(cfg, batch) / cfg.n_routed_experts
    weights = mem["weights_total"] - mem.get("routed_experts", 0) * (1 - touched)
    seqs = batch // n if mode == "dp" else batch
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
    n = max(args.num_devices)
    for mode in args.modes:
        plan = sharding.ShardingPlan.create(cfg, n, mode == "dp")
        for batch in args.batches:
            batch = global_batch(args, batch, n)
            num_pages = num_pages_for(args, batch, mode, n)
            graphdef, weights, caches = abstract_engine_state(
                cfg, jnp.bfloat16, num_pages=num_pages, cache_dtype=args.kv_cache_dtype)
            mem = memory_per_device(plan, weights, caches)
            roof = decode_roofline(cfg, mem, args, batch, mode, args.prompt_len + args.gen_len // 2, n)
            row = dict(mode=mode, batch=batch, num_pages=num_pages, bytes_per_device=mem, decode_roofline=roof)
            if args.lower:
                row["lowered"] = lower_decode(graphdef, weights, caches, plan, cfg, batch, args)
            rows.append(row)
            print_row(row)
    return {"kind": "dry_run", "devices": f"{n} simulated CPU devices", "config": "DeepSeek-V3 "
            f"full width, {cfg.num_hidden_layers} layers, AWQ int4 group {args.group_size}, bf16 activations, "
            f"{args.kv_cache_dtype} cache",
            "prompt_len": args.prompt_len, "gen_len": args.gen_len, "rows": rows, **env_info(args.commit)}


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
def run(cfg, args, out_path: str) -> None:
    """Per (devices, mode, dispatch): random sharded weights generated on the devices, then per batch one warm-up
    generate (compiles every bucket the timed run uses) and one timed generate of `batch` prompts x gen_len tokens
    (ignore_eos). The JSON is rewritten after every row."""
    import gc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mla_jax import sharding
    from mla_jax.checkpoint.sharded import init_sharded

    t_start = time.perf_counter()
    result = {"kind": "run", "config": f"DeepSeek-V3 {'small (CPU check)' if args.small else 'full width'}, "
              f"{cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), AWQ int4 group "
              f"{cfg.quantization.group_size} random weights, bf16 activations, {args.kv_cache_dtype} cache",
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "per_device_batch": args.per_device_batch,
              "rows": [], "layer_dispatch": [], "skipped": [], **env_info(args.commit)}
    for n, mode, dispatch in run_configs(args):
        if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
            result["skipped"].append(dict(devices=n, mode=mode, dispatch=dispatch, reason="--time-budget-s"))
            print(f"[{n} dev {mode} {dispatch}] skipped: past --time-budget-s {args.time_budget_s}")
            continue
        plan = sharding.ShardingPlan.create(cfg, n, mode == "dp", expert_dispatch=dispatch or "all_gather",
                                            expert_capacity_factor=args.expert_capacity_factor)
        t0 = time.perf_counter()
        model = init_sharded(cfg, plan, jnp.bfloat16, seed=args.seed) if n > 1 else init_one_device(cfg, args.seed)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        print(f"[{n} dev {mode} {dispatch}] random AWQ weights generated in {time.perf_counter() - t0:.1f}s")
        for batch in args.batches:
            row = run_one(cfg, args, model, plan, n, mode, dispatch, batch)
            result["rows"].append(row)
            if args.measure_layer and n > 1 and dispatch == args.dispatches[0]:    # once per (devices, mode)
                result["layer_dispatch"] += measure_layer(cfg, model, plan, row["batch"], args)
            result["scaling"] = scaling(result["rows"])
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            write_json(result, out_path)
            gc.collect()
        del model
        gc.collect()
    for s in result.get("scaling", []):
        print(f"scaling {s['mode']} {s['dispatch']} at {s['per_device_batch']} sequences per device: "
              f"{s['devices']} devices give {s['speedup']:.2f}x the output tok/s of 1 device")
    write_json(result, out_path)


def init_one_device(cfg, seed: int):
    """The random model on the default device, generated under jit (no host copy). Not init_sharded with a
    one-device plan: the engine recompiles its prefill once for weights placed that way (NamedSharding)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mla_jax.model.transformer import DeepseekV3

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(DeepseekV3(cfg, dtype=jnp.bfloat16,
                                                                    rngs=nnx.Rngs(seed))))())


_COMPILES = {"n": 0, "names": []}      # jit compilations (or cache reads) so far in this process


def _count_compiles() -> None:
    from jax import monitoring

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILES["n"] += 1
            _COMPILES["names"].append(f"{kw.get('fun_name', '?')} ({secs:.2f} s)")
    monitoring.register_event_duration_secs_listener(listener)


def run_one(cfg, args, model, plan, n: int, mode: str, dispatch, batch_arg: int) -> dict:
    """One timed generate on one configuration; the row of the table."""
    import gc
    import statistics

    import jax.numpy as jnp
    import numpy as np

    from mla_jax.engine import LLM, SamplingParams
    from mla_jax.engine.memory import abstract_engine_state, memory_per_device

    rng = np.random.default_rng(args.seed)
    batch = global_batch(args, batch_arg, n)
    num_pages = num_pages_for(args, batch, "dp" if mode == "dp" else "tp", n)
    llm = LLM.from_model(
        model, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
        max_model_len=args.prompt_len + args.gen_len, max_num_seqs=batch, num_pages=num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=n,
        data_parallel_attention=mode == "dp", sharding_plan=plan if n > 1 else None)
    steps = llm.record_decode_times()    # (batch rows, seconds) per decode step
    prompts = rng.integers(2, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
    # The warm-up is the timed run itself, once: every shape the timed run meets (chunked prefill next to
    # decoding sequences, multi-step decode, table widths) compiles here. A 3-token warm-up left a ~13 s compile
    # of a full-width decode shape inside the timed run (bench/results/full_v3_l8_h200x2_d4a44ac.json).
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
    warm_s = time.perf_counter() - t0
    steps.clear()
    compiles_before = _COMPILES["n"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
    total_s = time.perf_counter() - t0
    compiles = _COMPILES["n"] - compiles_before
    compiled = _COMPILES["names"][compiles_before:]
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = max(o.metrics["time_to_first_token_s"] for o in outs)
    full = [s for b, s in steps if b == max(b for b, _ in steps)]
    _, weights, caches = abstract_engine_state(cfg, jnp.bfloat16, num_pages=num_pages,
                                               cache_dtype=args.kv_cache_dtype)
    mem = memory_per_device(plan, weights, caches)
    roof = decode_roofline(cfg, mem, args, batch, "dp" if mode == "dp" else "tp",
                           args.prompt_len + args.gen_len // 2, n)
    step_ms = statistics.median(full) * 1e3 if full else None
    row = dict(devices=n, mode=mode, dispatch=dispatch, batch=batch, batch_per_device=batch_arg
               if args.per_device_batch else None, num_pages=num_pages, backend=llm.backend, output_tokens=n_out,
               total_s=total_s, output_tok_per_s=n_out / total_s,
               total_tok_per_s=(n_out + batch * args.prompt_len) / total_s,
               time_to_last_first_token_s=ttft, warmup_s=warm_s, decode_steps=len(steps),
               compilations_in_timed_run=compiles, compiled_in_timed_run=compiled,
               decode_step_ms_median=step_ms,
               decode_step_ms_p90=float(np.percentile(full, 90)) * 1e3 if full else None,
               decode_roofline_ms=roof["seconds"] * 1e3,
               decode_roofline_fraction=roof["seconds"] * 1e3 / step_ms if step_ms else None,
               roofline=roof, planned_bytes_per_device=mem, device_memory=device_memory())
    print(f"[{n} dev {mode} {dispatch}] batch {batch:4d}: {row['output_tok_per_s']:9.1f} output tok/s  "
          f"({row['total_tok_per_s']:9.1f} total)  decode step {step_ms or float('nan'):8.2f} ms "
          f"(roofline {row['decode_roofline_ms']:.2f} ms)  peak mem/GPU "
          f"{max(m.get('peak_bytes_in_use', 0) for m in row['device_memory']) / 2**30:.1f} GiB; "
          f"{compiles} compilations in the timed run {compiled if compiled else ''}", flush=True)
    del llm, outs
    gc.collect()
    return row


def scaling(rows: list) -> list:
    """Output tok/s of N devices over 1 device at the same per-device batch (rows with --per-device-batch)."""
    one = {r["batch_per_device"]: r for r in rows if r["devices"] == 1 and r["batch_per_device"]}
    out = []
    for r in rows:
        base = one.get(r["batch_per_device"])
        if r["devices"] > 1 and base is not None:
            out.append(dict(devices=r["devices"], mode=r["mode"], dispatch=r["dispatch"],
                            per_device_batch=r["batch_per_device"], speedup=r["output_tok_per_s"]
                            / base["output_tok_per_s"]))
    return out


def measure_layer(cfg, model, plan, batch: int, args) -> list:
    """One MoE layer's routed experts (the last layer's, full width) on `batch` decode tokens with random uniform
    routing, under each dispatch path, in the decode layout of the plan's mode; and the bare collectives each path
    is built from on the same rows ([rows, hidden] bf16): all_to_all (per-peer buffers), all_gather, and the fp32
    reduce-scatter of the all-gather path's combine. Bytes are what one device sends to the others."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from flax import nnx

    from mla_jax import sharding

    n, D, K, E = plan.num_devices, cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    graphdef, state = nnx.split(model.layers[-1].mlp.experts)
    split = plan.data_parallel_attention
    rows = plan.sharding(P(sharding.AXIS) if split else P())
    keys = jax.random.split(jax.random.key(args.seed), 3)
    x = jax.device_put(jax.random.normal(keys[0], (batch, D), jnp.bfloat16), rows)
    idx = jax.device_put(jnp.argsort(jax.random.uniform(keys[1], (batch, E)), axis=1)[:, :K].astype(jnp.int32),
                         rows)
    w = jax.device_put(jax.random.uniform(keys[2], (batch, K), jnp.float32), rows)
    out = []
    for dispatch in DISPATCHES:
        p = dataclasses.replace(plan, expert_dispatch=dispatch)
        fn = jax.jit(lambda st, x, i, w, p=p: p.experts(nnx.merge(graphdef, st), x, i, w, scatter_rows=split))
        secs = seconds_per_call(fn, (state, x, idx, w))
        out.append(dict(what="moe_layer_routed_experts", dispatch=dispatch, devices=n, mode=plan.data_parallel_attention
                        and "dp" or "tp", batch=batch, ms=secs * 1e3))
    local = -(-batch // n)
    for name, fn, nbytes in collective_fns(plan, local, D):
        secs = seconds_per_call(fn, (jax.device_put(jnp.ones((local * n, D), jnp.bfloat16), plan.sharding(
            P(sharding.AXIS))),))
        out.append(dict(what=name, devices=n, batch=batch, ms=secs * 1e3, bytes_sent_per_device=nbytes,
                        gb_per_s=nbytes / secs / 1e9))
    for r in out:
        print(f"  layer dispatch: {r['what']:26s} {r.get('dispatch') or '':10s} {r['ms']:8.3f} ms"
              + (f"  {r['gb_per_s']:7.1f} GB/s sent per device" if "gb_per_s" in r else ""), flush=True)
    return out


def seconds_per_call(fn, args) -> float:
    """Median seconds per call: pallas_kernels.testing.time_calls (back-to-back async calls) on GPUs; on simulated
    CPU devices, where many collectives in flight can starve XLA:CPU's rendezvous, a few synchronous calls."""
    import statistics

    import jax

    from pallas_kernels.testing import time_calls

    if jax.devices()[0].platform == "gpu":
        return time_calls(fn, [args], min_batch_s=0.05, batches=5)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def collective_fns(plan, local_rows: int, D: int) -> list:
    """(name, jitted fn of a [local_rows·N, D] bf16 array split by rows, bytes one device sends) for the
    collectives of the two dispatch paths (the all-to-all with the worst-case capacity: local_rows per peer)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from mla_jax.sharding import AXIS

    n = plan.num_devices

    def island(body, out_spec):
        return jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=P(AXIS), out_specs=out_spec, check_vma=False))

    a2a = island(lambda x: jax.lax.all_to_all(jnp.tile(x, (n, 1)), AXIS, 0, 0, tiled=True), P(AXIS))
    gather = island(lambda x: jax.lax.all_gather(x, AXIS, tiled=True), P())
    scatter = island(lambda x: jax.lax.psum_scatter(jnp.tile(x.astype(jnp.float32), (n, 1)), AXIS,
                                                    scatter_dimension=0, tiled=True), P(AXIS))
    row = D * 2
    return [("all_to_all_bf16", a2a, (n - 1) * local_rows * row),
            ("all_gather_bf16", gather, (n - 1) * local_rows * row),
            ("reduce_scatter_fp32", scatter, (n - 1) * local_rows * row * 2)]


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


def env_info(commit_override: str | None = None) -> dict:
    import subprocess

    import jax
    commit = commit_override
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
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
