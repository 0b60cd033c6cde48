"""Benchmark the OpenAI-compatible server with N concurrent streams (thin main over mla_jax.serve.bench).

    python scripts/bench_serve.py --launch --concurrency 1 8 32          # starts the server in this process
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --model NAME --concurrency 64 --num-requests 256

Prints one row per concurrency (requests/s, output tok/s, TTFT and inter-token latency p50/p99) and writes JSON
(`--out`, default bench/results/serve_<device>_<commit>.json) with the device, jax version and commit. A warm-up
round at each concurrency (not timed) compiles the engine's step variants first. With --launch the engine flags
are those of scripts/generate.py (mla_jax.cli); without it the server at --url is measured as it is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

from mla_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_args(ap)
    ap.add_argument("--launch", action="store_true", help="start the server in this process on a free port")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--served-model-name", default=None, help="model id to send (default: --model's dir name)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=None, help="per concurrency (default: 4 x concurrency)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from mla_jax.serve import bench

    model_name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    meta = {"jax": jax.__version__, "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip()}
    server = engine = None
    url = args.url
    if args.launch:
        import mla_jax
        from mla_jax.serve.launch import ServerThread, build_app
        llm = mla_jax.LLM(args.model, **cli.engine_kwargs(args))
        app, engine = build_app(llm, model_name=model_name, model_dir=args.model)
        server = ServerThread(app).start()
        url = server.url
        meta.update(device=jax.devices()[0].device_kind, num_devices=len(jax.devices()), backend=llm.backend,
                    dtype=str(llm.dtype), kv_cache_dtype=llm.kv_cache_dtype, max_num_seqs=llm.max_num_seqs,
                    model=args.model)
    else:
        meta.update(device="external server", url=url)
    rows = []
    try:
        print(f"{'conc':>5} {'reqs':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} "
              f"{'ITL p50':>8} {'p99':>8}  (ms)", flush=True)
        for c in args.concurrency:
            n = args.num_requests or 4 * c
            kw = dict(model=model_name, concurrency=c, prompt_len=args.prompt_len, max_tokens=args.max_tokens)
            if not args.no_warmup:
                asyncio.run(bench.run_benchmark(url, num_requests=c, seed=1, **kw))
            r = asyncio.run(bench.run_benchmark(url, num_requests=n, **kw))
            rows.append(r)
            print(f"{c:>5} {n:>5} {r['requests_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
                  f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f} {r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>8.1f}",
                  flush=True)
    finally:
        if server is not None:
            server.stop()
            engine.close()
    out = args.out or os.path.join(REPO, "bench", "results",
                                   f"serve_{meta['device'].replace(' ', '_').lower()}_{meta['commit']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
