"""The engine's decode fast path against its plain path on this machine's device (a GPU check; CPU tests cover the
same with the fp32 fixture in tests/test_engine_fast.py).

  python scripts/check_engine_gpu.py --out bench/results/engine_check.json [--kv-cache-dtype fp8_e4m3]

Greedy decoding of the same random prompts by LLM(fused_decode=False) and by the default LLM (fused sampling,
multi-step while loop, overlap; on a GPU the loop runs as one CUDA graph, engine/runner.py). Per batch size it
prints how many requests produced the same tokens and the largest logprob difference over each request's common
prefix; exit status 1 when fewer than --min-same of them agree (bf16 models may flip a near-tie).
"""
import argparse
import json
import os

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory or an embedded model's name (default: embedded)")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=33)
    ap.add_argument("--max-tokens", type=int, default=61)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3", "float32"])
    ap.add_argument("--min-same", type=float, default=0.95, help="fraction of requests with identical tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    import jax
    import mla_jax
    from mla_jax import cli

    model = args.model or cli.DEFAULT_MODEL
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    common = dict(kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(sizes), seed=0,
                  max_model_len=args.prompt_len + args.max_tokens + 1)
    plain = mla_jax.LLM(model, fused_decode=False, **common)
    fast = mla_jax.LLM(model, **common)
    params = mla_jax.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=True)
    rng = np.random.default_rng(1)
    rows, ok = [], True
    for b in sizes:
        prompts = [[int(t) for t in rng.integers(3, plain.cfg.vocab_size, size=args.prompt_len - i % 5)]
                   for i in range(b)]
        want, got = plain.generate(prompts, params), fast.generate(prompts, params)
        same = sum(w.token_ids == g.token_ids for w, g in zip(want, got))
        diffs = []
        for w, g in zip(want, got):
            n = next((i for i, (a, c) in enumerate(zip(w.token_ids, g.token_ids)) if a != c), len(w.token_ids))
            if n:
                diffs.append(float(np.max(np.abs(np.subtract(w.logprobs[:n], g.logprobs[:n])))))
        row = dict(batch=b, requests=b, same_tokens=same, max_logprob_diff=max(diffs) if diffs else None,
                   lengths_equal=all(len(w.token_ids) == len(g.token_ids) for w, g in zip(want, got)))
        row["ok"] = bool(same >= args.min_same * b and row["lengths_equal"])
        ok &= row["ok"]
        rows.append(row)
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=args.commit, model=model,
                backend=fast.backend, kv_cache_dtype=str(fast.kv_cache_dtype), xla_flags=os.environ.get("XLA_FLAGS"))
    print(f"{info['device']}, jax {info['jax']}, commit {args.commit}, backend {fast.backend}, "
          f"kv cache {info['kv_cache_dtype']}")
    print("batch  same tokens  max |dlogprob|  ok")
    for r in rows:
        d = "-" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.2e}"
        print(f"{r['batch']:5d}  {r['same_tokens']:5d}/{r['requests']:<5d}  {d:>14s}  {r['ok']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(info, rows=rows, ok=ok), f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
