"""Generation benchmarks of the engine: offline throughput and decode step latency, JSON out.

Two modes (run one or both in one call):

  --model DIR (default: the embedded model) with --batch-sizes 1,2,4,...: for each batch size B, LLM.generate on
      B random prompts of --prompt-len tokens, --max-tokens new tokens each (ignore_eos). Reports output tok/s
      (generated tokens / wall time of the timed generate call, compilation excluded by a warm-up call) and the
      engine's decode step latency (scheduling + device step + sampling + tokens on the host; median / p10 / p90
      over the run's decode steps with all B requests in the batch; with multi-step decode a call's wall time is
      split evenly over the steps it ran). --decode-modes runs each engine decode mode in turn (plain: a decode and
      a sampling call per step, tokens read every step; fused; overlap; multistep; default = multi-step + overlap,
      the LLM's defaults) and prints one table. --profile adds, per row, the device time of one decode step at the
      run's mean context (CUPTI kernel times on a GPU; back-to-back wall clock on a CPU), wall - device (the host
      overhead per step), and the engine's decode call with a wait after it; --trace-dir writes a jax.profiler
      trace of each timed run (Perfetto / TensorBoard).

  --v3-slice: a full-width random DeepSeek-V3 slice: --v3-layers layers at real dims (hidden 7168, 128 heads,
      q_lora 1536, kv_lora 512, 256 experts top-8, moe_inter 2048, vocab 129280), the first --v3-dense-layers
      dense, AWQ int4 (group 128) everywhere AWQ quantizes, bf16 activations, an fp8_e4m3 paged cache holding
      --batch sequences of --context tokens (random latents written through MLAKVCache.write: the step's cost
      does not depend on the values). Times the public decode_step (jitted, cache donated) for each backend in
      --backends, checks its logits against the xla backend on the same inputs, and compares the step time with
      its roofline: (bytes of weights the step reads + cache bytes) / the copy bandwidth measured in the same
      run on a GPU (a 2 GiB y = x + 1; 4.27 TB/s, an H200's, on a CPU). Weights read: every layer's
      attention weights (AWQ resident bytes of q_a/q_b/kv_a/o and the bf16 absorbed W_UK/W_UV; kv_b is not read
      by decode), dense MLPs, router + shared experts, the routed experts the batch touches (expected number of
      distinct experts under uniform routing: E·(1-(1-K/E)^B)), lm_head (bf16), norms; cache: B·context·656 B per
      layer. --v3-scale tiny shrinks the dims (CPU smoke test of the same code path). --mosaic-options gives
      every mosaic_sm90.mla_decode call of the run keyword arguments: a candidate attention default measured in
      the whole step, against a run without them.

    python scripts/bench_generate.py --batch-sizes 1,2,4,8,16,32,64 --out bench/results/generate_h200.json
    python scripts/bench_generate.py --batch-sizes 1,8,64 --decode-modes plain,fused,overlap,multistep,default \
        --profile --out bench/results/generate_modes_h200.json
    python scripts/bench_generate.py --v3-slice --backends auto,triton,xla --out bench/results/generate_v3_slice_h200.json
    python scripts/bench_generate.py --v3-slice --mosaic-options '{"kernel": "seesaw", "l2_prefetch": 2}'

Every figure in the JSON carries the device, jax version, git commit, shapes and dtypes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HBM_BYTES_PER_S = 4.27e12           # H200 HBM copy bandwidth (docs/architecture.md §11): the roofline without a GPU


def run_info(commit_override=None) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    if commit_override:            # e.g. on a machine that got the working tree without .git
        commit, dirty = commit_override, None
    d = jax.devices()[0]
    return dict(device=d.device_kind, platform=d.platform, num_devices=jax.device_count(), jax=jax.__version__,
                commit=commit, dirty_worktree=dirty, time=datetime.datetime.now().isoformat(timespec="seconds"))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


# ---- mode 1: the engine on a checkpoint ---------------------------------------------------------------------------
# --decode-modes: name -> LLM keyword arguments (multi_step filled in from --multi-step)
DECODE_MODES = {
    "plain": dict(fused_decode=False),                       # one decode + one sampling call per step, tokens read
    "fused": dict(multi_step=1, overlap=False),               # sampling fused, one transfer each way, still synced
    "overlap": dict(multi_step=1, overlap=True),              # + next step dispatched before reading this one
    "multistep": dict(overlap=False),                         # + k steps per device call
    "default": dict(overlap=True),                            # multi-step + overlap (the LLM's defaults)
}


def device_step_time(llm, batch: int, context: int, iters: int) -> dict:
    """Device time of one decode step (model forward + sampling) of `batch` sequences of `context` tokens, through
    the engine's own jitted step and block table width: CUPTI kernel times on a GPU (the sum over the step's
    kernels, as scripts/check_mla_gpu.py), else the wall clock of back-to-back calls (then bounded by dispatch)."""
    from mla_jax.engine.cache_storage import as_stored, from_stored
    from mla_jax.engine.runner import pow2_at_least
    from mla_jax.engine.sampling import sample
    from mla_jax.engine.steps import decode_step

    ps = llm.page_size
    pages = -(-context // ps)
    width = pow2_at_least(pages, llm.block_table_width) if llm.backend == "xla" else llm.block_table_width
    bt = np.zeros((batch, width), np.int32)
    bt[:, :pages] = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages) % (llm.allocator.num_pages - 1)
    pos = np.full(batch, context - 1, np.int32)
    slots = bt[:, (context - 1) // ps] * ps + (context - 1) % ps
    tokens = np.arange(batch, dtype=np.int32) % llm.cfg.vocab_size
    samp = (np.zeros(batch, np.float32), np.full(batch, -1, np.int32), np.ones(batch, np.float32),
            np.zeros(batch, np.uint32), np.zeros(batch, np.int32))
    graphdef, backend, interpret = llm.graphdef, llm.backend, llm.interpret

    def step(weights, caches, tokens, pos, slots, bt, lens, *samp):
        caches, logits = decode_step(graphdef, weights, from_stored(caches), tokens, pos, slots, bt, lens,
                                     backend=backend, interpret=interpret)
        return as_stored(caches), sample(logits, *samp)

    step = jax.jit(step, donate_argnums=1)          # caches updated in place, as in the engine
    args = [jax.device_put(a) for a in (tokens, pos, slots, bt, pos + 1, *samp)]
    state = dict(caches=jax.tree.map(jnp.copy, llm.caches))      # a copy: the engine's caches stay valid

    def fn():
        state["caches"], out = step(llm.weights, state["caches"], *args)
        return out
    jax.block_until_ready(fn())
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, runs = profiler.measure(lambda *_: fn(), aggregate=False, iterations=iters)()
        if not runs:
            raise RuntimeError("no kernels recorded")
        totals = [sum(t for _, t in run) for run in runs]
        return dict(device_step_ms=statistics.median(totals), kernels_per_step=len(runs[0]), method="cupti",
                    context=context, block_table_width=width)
    except Exception as e:  # noqa: BLE001 - CUPTI unavailable (CPU): back-to-back wall clock
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn()
        jax.block_until_ready(r)
        return dict(device_step_ms=1e3 * (time.perf_counter() - t0) / iters, context=context,
                    block_table_width=width, method=f"wallclock back-to-back ({type(e).__name__}: {e})"[:160])


def bench_model(args, info) -> dict:
    import mla_jax

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.decode_modes.split(",")
    for m in modes:
        if m not in DECODE_MODES:
            raise SystemExit(f"--decode-modes: unknown mode {m!r}; choose from {', '.join(DECODE_MODES)}")
    rng = np.random.default_rng(0)
    rows, llm = [], None
    for mode in modes:
        kw = dict(DECODE_MODES[mode])
        if "multi_step" not in kw and kw.get("fused_decode", True):
            kw["multi_step"] = args.multi_step
        llm = mla_jax.LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          attention_backend=args.attention_backend, max_num_seqs=max(batch_sizes),
                          max_model_len=args.prompt_len + args.max_tokens + 1, interpret=args.interpret, seed=0,
                          **kw)
        print(f"mode {mode} {kw}: model {args.model}: backend {llm.backend} ({llm.backend_reason}); kv cache "
              f"{llm.kv_cache_dtype}", flush=True)
        vocab = llm.cfg.vocab_size

        def prompts(b):
            return [[int(t) for t in rng.integers(3, vocab, size=args.prompt_len)] for _ in range(b)]

        for b in batch_sizes:
            params = mla_jax.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts(b), params)                 # compiles this bucket (every block-table width too)
            warm_s = time.perf_counter() - t
            llm.step_times.clear()
            trace = os.path.join(args.trace_dir, f"{mode}_b{b}") if args.trace_dir else None
            if trace:
                jax.profiler.start_trace(trace)
            t = time.perf_counter()
            outs = llm.generate(prompts(b), params)
            wall = time.perf_counter() - t
            if trace:
                jax.profiler.stop_trace()
            n_out = sum(len(o.token_ids) for o in outs)
            dec = [s for (kind, n, _, s) in llm.step_times if kind == "decode" and n == b]
            ttft = [o.metrics["time_to_first_token_s"] for o in outs]
            row = dict(mode=mode, engine_kwargs=kw, batch=b, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                       output_tokens=n_out, wall_s=wall, output_tok_s=n_out / wall, warmup_s=warm_s,
                       decode_steps=len(dec),
                       decode_step_ms_median=1e3 * statistics.median(dec) if dec else None,
                       decode_step_ms_p10=1e3 * pct(dec, 10) if dec else None,
                       decode_step_ms_p90=1e3 * pct(dec, 90) if dec else None,
                       ttft_s_mean=sum(ttft) / len(ttft), preemptions=llm.scheduler.num_preemptions,
                       trace_dir=trace)
            if args.profile:
                # the device's share of a step: one decode step at the run's mean context, timed on its own
                row.update(device_step_time(llm, b, args.prompt_len + args.max_tokens // 2, args.iters))
                # and the engine's decode call with a wait after each (dispatch + device, per step)
                times = llm.record_decode_times()
                llm.generate(prompts(b), params)
                llm._decode_times = None
                blocked = [s for (rows_, s) in times]
                row["decode_call_blocked_ms_median"] = 1e3 * statistics.median(blocked) if blocked else None
                if row["decode_step_ms_median"] is not None:
                    row["host_overhead_ms"] = row["decode_step_ms_median"] - row["device_step_ms"]
            rows.append(row)
            extra = (f"  device {row['device_step_ms']:.2f} ms ({row['method'].split(' ')[0]}), call+wait "
                     f"{row['decode_call_blocked_ms_median']:.2f} ms" if args.profile else "")
            print(f"  {mode:9s} B={b:4d}  {row['output_tok_s']:9.1f} tok/s  decode step {row['decode_step_ms_median']:.2f} ms "
                  f"(p10 {row['decode_step_ms_p10']:.2f}, p90 {row['decode_step_ms_p90']:.2f})  ttft "
                  f"{row['ttft_s_mean']:.3f} s{extra}  (warm-up incl. compile {warm_s:.1f} s)", flush=True)
    print_table(rows, args.profile)
    cfg = llm.cfg
    return dict(mode="model", model=os.path.relpath(os.path.abspath(args.model), REPO), dtype=args.dtype,
                kv_cache_dtype=llm.kv_cache_dtype, backend=llm.backend, backend_reason=llm.backend_reason,
                multi_step=args.multi_step, compilation_cache=args.compilation_cache_dir,
                config=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                            experts=cfg.n_routed_experts, vocab=cfg.vocab_size,
                            awq=cfg.quantization is not None),
                rows=rows, info=info)


def print_table(rows, profile: bool) -> None:
    cols = ["mode", "batch", "output_tok_s", "decode_step_ms_median", "ttft_s_mean"]
    if profile:
        cols += ["device_step_ms", "host_overhead_ms", "decode_call_blocked_ms_median"]
    head = {"output_tok_s": "tok/s", "decode_step_ms_median": "wall ms/step", "ttft_s_mean": "ttft s",
            "device_step_ms": "device ms/step", "host_overhead_ms": "wall - device",
            "decode_call_blocked_ms_median": "call+wait ms/step"}
    print("\n| " + " | ".join(head.get(c, c) for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c))) for c in cols]
        print("| " + " | ".join(cells) + " |")


# ---- mode 2: full-width random DeepSeek-V3 slice ------------------------------------------------------------------
# the dims the JSON records; --v3-scale tiny shrinks them (the other dims stay V3's)
V3_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
           "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group")
V3_TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, n_routed_experts=16,
               num_experts_per_tok=4, n_group=4, topk_group=2)


def v3_config(scale: str, layers: int, dense_layers: int):
    """DeepSeek-V3 (mla_jax.config.deepseek_v3_hf_config, AWQ group 128) cut to `layers` layers, the first
    `dense_layers` dense; scale "tiny" shrinks the widths."""
    from mla_jax.config import ModelConfig, deepseek_v3_hf_config

    dims = {} if scale == "full" else V3_TINY
    return ModelConfig.from_hf_dict(deepseek_v3_hf_config(128, num_hidden_layers=layers,
                                                          first_k_dense_replace=dense_layers, **dims))


def v3_bytes_per_step(cfg, batch: int, context: int, cache_bytes_per_token: int) -> dict:
    """Bytes a decode step must read (the roofline's numerator), by part."""
    from mla_jax.quant.awq import linear_resident_bytes

    G = cfg.quantization.group_size
    D, H, E, K = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok
    I, Is = cfg.moe_intermediate_size, cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attn = (linear_resident_bytes(D, cfg.q_lora_rank, G) + linear_resident_bytes(cfg.q_lora_rank, H * qk, G)
            + linear_resident_bytes(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, G)
            + linear_resident_bytes(H * cfg.v_head_dim, D, G)
            + 2 * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank       # W_UK, W_UV bf16
            + 2 * (2 * D + cfg.q_lora_rank + cfg.kv_lora_rank))                          # norms
    expert = 2 * linear_resident_bytes(D, I, G) + linear_resident_bytes(I, D, G)
    touched = E * (1 - (1 - K / E) ** batch)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense_layers = cfg.num_hidden_layers - moe_layers
    parts = dict(
        attention_weights=cfg.num_hidden_layers * attn,
        dense_mlp=dense_layers * (2 * linear_resident_bytes(D, cfg.intermediate_size, G)
                                  + linear_resident_bytes(cfg.intermediate_size, D, G)),
        router_and_shared=moe_layers * (4 * D * E + 4 * E + 2 * linear_resident_bytes(D, Is, G)
                                        + linear_resident_bytes(Is, D, G)),
        routed_experts=int(moe_layers * touched * expert),
        embed_rows_norm_lm_head=batch * D * 2 + 2 * D + D * cfg.vocab_size * 2,
        kv_cache=cfg.num_hidden_layers * batch * context * cache_bytes_per_token,
    )
    parts["total"] = sum(parts.values())
    parts["expected_distinct_experts_per_moe_layer"] = touched
    return parts


def back_to_back_ms(call, caches, iters: int, warmup: int, windows: int = 1) -> list[float]:
    """Milliseconds per step, one figure per window of `iters` steps dispatched without waiting (each takes the
    previous one's donated caches, so they run in order) and the host blocking once at the window's end: the
    device's time per step while the host stays ahead, as in the engine's overlapped loop. Timing each call with a
    wait after it adds that call's dispatch latency to every step. Several windows in a row show the spread within
    one process (under the H200's power cap runs differ by ~1-2%)."""
    logits = None
    for _ in range(warmup):
        caches, logits = call(caches)
    jax.block_until_ready(logits)
    out = []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(iters):
            caches, logits = call(caches)
        jax.block_until_ready(logits)
        out.append(1e3 * (time.perf_counter() - t) / iters)
    return out


def apply_mosaic_options(options_json: str | None) -> dict:
    """--mosaic-options: every mosaic_sm90.mla_decode call in this process, the model's layers included, gets these
    keyword arguments (e.g. {"kernel": "seesaw", "l2_prefetch": 2}): a candidate default measured in the whole
    decode step, against a run without them, before it becomes one. Returns them (recorded in the JSON)."""
    if not options_json:
        return {}
    import functools
    import inspect
    from pallas_kernels.mla_decode import mosaic_sm90
    options = json.loads(options_json)
    known = set(inspect.signature(mosaic_sm90.mla_decode).parameters) - {"q", "cache", "block_table", "seq_lens",
                                                                          "softmax_scale", "causal", "interpret",
                                                                          "schedule"}
    if not isinstance(options, dict) or set(options) - known:
        raise SystemExit(f"--mosaic-options takes a JSON object of mosaic_sm90.mla_decode keyword arguments "
                         f"{sorted(known)}; got {options_json!r}")
    mosaic_sm90.mla_decode = functools.wraps(mosaic_sm90.mla_decode)(
        functools.partial(mosaic_sm90.mla_decode, **options))
    print(f"  mosaic_sm90.mla_decode options for this run: {options}", flush=True)
    return options


def bench_v3_slice(args, info) -> dict:
    from flax import nnx

    import pallas_kernels
    from pallas_kernels.testing import compare, copy_ceiling_gbps, device_time
    from pallas_kernels import resolve_backend
    from mla_jax.engine.sampling import sample
    from mla_jax.engine.runner import decode_loop_compiler_options
    from mla_jax.engine.steps import allocate_caches, decode_step, split_model
    from mla_jax.model.transformer import DeepseekV3

    cfg = v3_config(args.v3_scale, args.v3_layers, args.v3_dense_layers)
    B, L, ps = args.batch, args.context, 64
    cache_dtype = args.v3_cache_dtype
    out = dict(mode="v3_slice", scale=args.v3_scale, layers=cfg.num_hidden_layers,
               dense_layers=args.v3_dense_layers, batch=B, context=L, page_size=ps, dtype="bfloat16",
               kv_cache_dtype=cache_dtype, awq_group_size=cfg.quantization.group_size,
               config={k: getattr(cfg, k) for k in V3_DIMS}, info=info, backends=[],
               mosaic_options=apply_mosaic_options(args.mosaic_options))

    t = time.perf_counter()
    model = DeepseekV3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, weights = split_model(model)
    del model
    jax.block_until_ready(weights)
    out["weights_bytes_resident"] = int(sum(x.nbytes for x in jax.tree.leaves(weights)))
    out["build_s"] = time.perf_counter() - t
    print(f"v3 slice ({args.v3_scale}): {cfg.num_hidden_layers} layers, {out['weights_bytes_resident'] / 2**30:.2f} "
          f"GiB of weights built in {out['build_s']:.1f} s", flush=True)

    pages_per_seq = L // ps
    num_pages = B * pages_per_seq + 1
    block_table = (1 + np.arange(B * pages_per_seq, dtype=np.int32)).reshape(B, pages_per_seq)
    t = time.perf_counter()
    caches = allocate_caches(cfg, num_pages, page_size=ps, dtype=cache_dtype)

    @jax.jit
    def fill(cache, key):
        # every slot of every sequence: latents ~ N(0, 1) like kv_a_layernorm's output, rope ~ N(0, 1)
        slots = jnp.arange(ps, num_pages * ps, dtype=jnp.int32)
        k1, k2 = jax.random.split(key)
        lat = jax.random.normal(k1, (slots.shape[0], 512), jnp.bfloat16)
        rope = jax.random.normal(k2, (slots.shape[0], 64), jnp.bfloat16)
        return cache.write(slots, lat, rope)

    caches = tuple(fill(c, jax.random.key(i)) for i, c in enumerate(caches))
    jax.block_until_ready(caches)
    out["cache_fill_s"] = time.perf_counter() - t
    cache_bpt = caches[0].bytes_per_token
    out["roofline_bytes"] = v3_bytes_per_step(cfg, B, L, cache_bpt)
    # the roofline at this device's copy bandwidth (an H100's is ~3.0 TB/s, an H200's ~4.27)
    on_gpu = jax.devices()[0].platform == "gpu"
    out["copy_gbps"] = copy_ceiling_gbps() if on_gpu else HBM_BYTES_PER_S / 1e9
    out["copy_gbps_source"] = "copy measured in this run" if on_gpu else "H200 copy constant (no GPU)"
    out["roofline_ms"] = out["roofline_bytes"]["total"] / (out["copy_gbps"] * 1e6)
    print(f"  roofline {out['roofline_ms']:.2f} ms: {out['roofline_bytes']['total'] / 1e9:.2f} GB at "
          f"{out['copy_gbps']:,.0f} GB/s ({out['copy_gbps_source']})", flush=True)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=B), jnp.int32)
    positions = jnp.full((B,), L - 1, jnp.int32)
    slots = jnp.asarray(block_table[:, -1] * ps + (L - 1) % ps, jnp.int32)
    seq_lens = jnp.full((B,), L, jnp.int32)
    block_table = jnp.asarray(block_table)
    samp = (jnp.zeros(B, jnp.float32), jnp.full(B, -1, jnp.int32), jnp.ones(B, jnp.float32),
            jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32))

    if args.step_kernels:
        # the whole step's kernels (CUPTI; the cache is not donated here, so XLA may add a copy of it)
        backend = resolve_backend(args.backends.split(",")[0], cache_dtype, args.interpret)[0]
        plain = jax.jit(lambda w, c: decode_step(graphdef, w, c, tokens, positions, slots, block_table, seq_lens,
                                                 backend=backend, interpret=args.interpret))
        dev = device_time(plain, weights, caches, iters=3)
        by_name = {}
        for name, us in dev.get("kernels", {}).items():
            key = name.split(":", 1)[-1]
            by_name[key] = by_name.get(key, 0.0) + us
        out["step_device"] = dict(us=dev["us"], method=dev["method"], by_name=by_name, kernels=dev.get("kernels"))
        print(f"  whole step, {backend}: device {dev['us']:.1f} us ({dev['method'][:40]}), "
              f"{len(dev.get('kernels', {}))} kernels; by name:" + "".join(
                  f"\n      {us:9.1f} us  {name}" for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]),
              flush=True)
        write_json(args.out, out)
        return out

    # the MLP of one dense and one MoE layer alone on B decode rows (where the rest of the step goes)
    x = jax.random.normal(jax.random.key(3), (B, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    for i in sorted({0, cfg.num_hidden_layers - 1}):
        kind = "moe" if cfg.is_moe_layer(i) else "dense"
        try:
            mlp = jax.jit(lambda w, x, i=i: nnx.merge(graphdef, w.model).layers[i].mlp(x))
            jax.block_until_ready(mlp(weights, x))
            ts = []
            for _ in range(args.iters):
                t = time.perf_counter()
                jax.block_until_ready(mlp(weights, x))
                ts.append(time.perf_counter() - t)
            out[f"{kind}_mlp_one_layer_ms_median"] = 1e3 * statistics.median(ts)
            print(f"  {kind} MLP (layer {i}) alone, {B} rows: {out[f'{kind}_mlp_one_layer_ms_median']:.2f} ms",
                  flush=True)
            # and its kernels (CUPTI on a GPU): which part of the layer is not the int4 GEMMs
            dev = device_time(mlp, weights, x, iters=args.iters)
            out[f"{kind}_mlp_device"] = dev
            top = sorted(dev.get("kernels", {}).items(), key=lambda kv: -kv[1])[:10]
            print(f"    device {dev['us']:.1f} us ({dev['method'][:40]})" + "".join(
                f"\n      {us:9.1f} us  {name}" for name, us in top), flush=True)
        except Exception as e:
            out[f"{kind}_mlp_error"] = f"{type(e).__name__}: {e}"
            print(f"  {kind} MLP timing FAILED: {out[f'{kind}_mlp_error'][:300]}", flush=True)
    write_json(args.out + ".partial", out)

    step = jax.jit(decode_step, static_argnums=0, static_argnames=("backend", "interpret"), donate_argnums=2)

    def fresh():
        return jax.tree.map(jnp.copy, caches)

    ref_logits = None
    for requested in args.backends.split(","):
        row = dict(requested=requested)
        out["backends"].append(row)
        try:
            name, reason = resolve_backend(requested, cache_dtype, args.interpret)
            row.update(backend=name, reason=reason)
            # correctness: one step (cache not donated) against the xla backend on the same inputs
            t = time.perf_counter()
            _, logits = step(graphdef, weights, fresh(), tokens, positions, slots, block_table, seq_lens,
                             backend=name, interpret=args.interpret)
            logits = np.asarray(logits, np.float32)
            row["first_call_s"] = time.perf_counter() - t
            if ref_logits is None:
                _, ref = step(graphdef, weights, fresh(), tokens, positions, slots, block_table, seq_lens,
                              backend="xla", interpret=False)
                ref_logits = np.asarray(ref, np.float32)
            row["logits_finite"] = bool(np.isfinite(logits).all())
            row["logits_max_abs_diff_vs_xla"] = float(np.abs(logits - ref_logits).max())
            row["logits_rel_diff_vs_xla"] = float(np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits))
            row["argmax_agree_vs_xla"] = float((logits.argmax(-1) == ref_logits.argmax(-1)).mean())

            run_caches = fresh()
            times = []
            for i in range(args.warmup + args.iters):
                t = time.perf_counter()
                run_caches, logits = step(graphdef, weights, run_caches, tokens, positions, slots, block_table,
                                          seq_lens, backend=name, interpret=args.interpret)
                logits.block_until_ready()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
            del run_caches
            # back to back, the model's static graph closed over (not hashed per call as a static argument)
            args_ = (tokens, positions, slots, block_table, seq_lens)
            closed = jax.jit(lambda w, c: decode_step(graphdef, w, c, *args_, backend=name,
                                                      interpret=args.interpret), donate_argnums=1)
            def record_back_to_back(key, what, call):
                """row[key] = the median of args.windows back-to-back windows (all kept in row[key + '_runs'])."""
                runs = back_to_back_ms(call, fresh(), args.iters, args.warmup, args.windows)
                row.update({key: statistics.median(runs), key + "_runs": runs})
                print(f"  backend {name:12s} {what} {row[key]:8.2f} ms per step x{row[key] / out['roofline_ms']:.2f} "
                      f"of the roofline (median of {len(runs)} windows, {min(runs):.2f}-{max(runs):.2f})", flush=True)

            record_back_to_back("decode_step_back_to_back_ms", "steps back to back", lambda c: closed(weights, c))
            # the same step compiled as one CUDA graph, as the engine's fused decode loop is: the wall time above
            # includes the host launching every kernel of 4 layers (H200, d8350b0: dense MLP 0.91 ms wall vs 0.17
            # ms of kernels)
            graph_opts = decode_loop_compiler_options(jax.default_backend())
            if graph_opts:
                gstep = jax.jit(decode_step, static_argnums=0, static_argnames=("backend", "interpret"),
                                donate_argnums=2, compiler_options=graph_opts)
                run_caches = fresh()
                gtimes = []
                for i in range(args.warmup + args.iters):
                    t = time.perf_counter()
                    run_caches, logits = gstep(graphdef, weights, run_caches, tokens, positions, slots,
                                               block_table, seq_lens, backend=name, interpret=args.interpret)
                    logits.block_until_ready()
                    if i >= args.warmup:
                        gtimes.append(time.perf_counter() - t)
                del run_caches
                gclosed = jax.jit(lambda w, c: decode_step(graphdef, w, c, *args_, backend=name,
                                                           interpret=args.interpret),
                                  donate_argnums=1, compiler_options=graph_opts)
                record_back_to_back("decode_step_graph_back_to_back_ms", "CUDA graph back to back",
                                    lambda c: gclosed(weights, c))
                row.update(decode_step_graph_ms_median=1e3 * statistics.median(gtimes),
                           decode_step_graph_ms_min=1e3 * min(gtimes),
                           step_graph_over_roofline=1e3 * statistics.median(gtimes) / out["roofline_ms"])
                print(f"  backend {name:12s} step as one CUDA graph {row['decode_step_graph_ms_median']:8.2f} ms "
                      f"(min {row['decode_step_graph_ms_min']:.2f})  x{row['step_graph_over_roofline']:.2f} of "
                      f"the roofline", flush=True)
            sample_fn = jax.jit(sample)
            jax.block_until_ready(sample_fn(logits, *samp))
            st = []
            for _ in range(args.iters):
                t = time.perf_counter()
                jax.block_until_ready(sample_fn(logits, *samp))
                st.append(time.perf_counter() - t)
            # the attention kernel alone, one layer
            q = jax.random.normal(jax.random.key(7), (B, 1, cfg.num_attention_heads, 576), jnp.float32)
            q = q.astype(jnp.bfloat16)
            attn = jax.jit(lambda q, c: pallas_kernels.mla_decode(q, c, block_table, seq_lens,
                                                                   softmax_scale=cfg.softmax_scale, backend=name,
                                                                   interpret=args.interpret))
            # the same layer-0 call against the xla backend: separates the kernel's own error (docs/architecture.md
            # §3 tolerances) from its amplification through the random-weight network in the logits above
            a_out, a_lse = attn(q, caches[0])
            x_out, x_lse = pallas_kernels.mla_decode(q, caches[0], block_table, seq_lens,
                                                     softmax_scale=cfg.softmax_scale, backend="xla")
            row["mla_decode_one_layer_vs_xla"] = compare(a_out, a_lse, x_out, x_lse)
            at = []
            for _ in range(args.iters):
                t = time.perf_counter()
                jax.block_until_ready(attn(q, caches[0]))
                at.append(time.perf_counter() - t)
            med = statistics.median(times)
            row.update(decode_step_ms_median=1e3 * med, decode_step_ms_min=1e3 * min(times),
                       decode_step_ms_p90=1e3 * pct(times, 90), iters=len(times),
                       sample_ms_median=1e3 * statistics.median(st),
                       mla_decode_one_layer_ms_median=1e3 * statistics.median(at),
                       step_over_roofline=1e3 * med / out["roofline_ms"])
            print(f"  backend {name:12s} step {row['decode_step_ms_median']:8.2f} ms (min "
                  f"{row['decode_step_ms_min']:.2f})  roofline {out['roofline_ms']:.2f} ms  x{row['step_over_roofline']:.2f}"
                  f"  | mla_decode/layer {row['mla_decode_one_layer_ms_median']:.3f} ms  sample "
                  f"{row['sample_ms_median']:.2f} ms  | logits vs xla: rel {row['logits_rel_diff_vs_xla']:.2e}, "
                  f"argmax agree {row['argmax_agree_vs_xla']:.2f} | one mla_decode vs xla: "
                  f"{row['mla_decode_one_layer_vs_xla']}", flush=True)
        except Exception as e:      # report the failure of this backend, go on with the next one
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
            print(f"  backend {requested}: FAILED {row['error'][:300]}", flush=True)
        write_json(args.out + ".partial", out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=cli.DEFAULT_MODEL, help="a model directory or an embedded model's name")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3", "float32"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--decode-modes", default="plain,default",
                    help=f"comma-separated engine decode modes to compare: {', '.join(DECODE_MODES)}")
    ap.add_argument("--multi-step", type=int, default=8, help="decode steps per device call (multistep, default)")
    ap.add_argument("--profile", action="store_true",
                    help="also report per step the device time (CUPTI on a GPU) against the wall time")
    ap.add_argument("--trace-dir", default=None, help="write a jax.profiler trace of each timed run here")
    ap.add_argument("--compilation-cache", default=None, metavar="DIR|off",
                    help="JAX's persistent compilation cache (default: $MLA_JAX_COMPILATION_CACHE, else "
                         "~/.cache/mla_jax/jax_compilation_cache; 'off' disables it)")
    ap.add_argument("--v3-slice", action="store_true", help="benchmark the full-width random DeepSeek-V3 slice "
                    "instead of --model")
    ap.add_argument("--v3-scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--step-kernels", action="store_true", help="--v3-slice: only list the whole step's kernels "
                    "(CUPTI) by name")
    ap.add_argument("--v3-layers", type=int, default=4)
    ap.add_argument("--v3-dense-layers", type=int, default=1,
                    help="leading dense layers (real V3: 3 of 61; default 1 so the slice is mostly MoE like V3)")
    ap.add_argument("--v3-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--backends", default="auto", help="comma-separated mla_decode backends for --v3-slice")
    ap.add_argument("--mosaic-options", default=None, metavar="JSON",
                    help="--v3-slice: keyword arguments for every mosaic_sm90.mla_decode call of the run, e.g. "
                         "'{\"kernel\": \"seesaw\", \"l2_prefetch\": 2}' (a candidate default, measured in the step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--windows", type=int, default=5,
                    help="--v3-slice: back-to-back windows of --iters steps each (the median is reported, all kept)")
    ap.add_argument("--commit", default=None, help="git commit to record when the tree has no .git")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/generate_<mode>_<device>.json)")
    args = ap.parse_args(argv)
    if args.v3_slice and args.context % 64:
        ap.error("--context must be a multiple of the page size 64")
    from mla_jax.engine.compile_cache import enable_compilation_cache
    args.compilation_cache_dir = enable_compilation_cache(args.compilation_cache)
    info = run_info(args.commit)
    if args.out is None:
        dev = info["device"].lower().replace("nvidia ", "").replace(" ", "_")
        args.out = os.path.join(REPO, "bench", "results",
                                f"generate_{'v3_slice' if args.v3_slice else 'model'}_{dev}.json")
    result = bench_v3_slice(args, info) if args.v3_slice else bench_model(args, info)
    write_json(args.out, result)
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
