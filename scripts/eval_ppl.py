"""Held-out perplexity of the embedded model through the engine's step functions, in one table (thin main over
mla_train.evaluate).

    python scripts/eval_ppl.py --model checkpoints/tiny-deepseek-py --bf16-model tmp/tiny-bf16 \
        --backends xla,triton,mosaic_sm90 --kv-cache-dtypes bfloat16,fp8_e4m3

Data: the held-out files recorded in the model's training.json (split by file, never trained on), read from this
interpreter's standard library (files whose sha256 changed are left out and counted), tokenized as in training
(<|bos|> file <|eos|>, concatenated) and cut into windows of --seq-len + 1 tokens, of which --num-seqs are scored,
spread evenly over the stream (--windows first takes the first ones: mostly codec tables for the shipped model).

Paths scored, each by teacher forcing (the true next token is fed, its log-probability is read):
  forward   model(ids): full causal forward, no cache (the reference for the weights)
  decode    prefill_step on the first token, then decode_step for every later position: absorbed MLA through
            pallas_kernels.mla_decode on the paged cache (bf16 or fp8_e4m3), with the chosen backend
  prefill   chunked prefill_step (--chunk tokens a step, all_logits): each chunk attends to its prefix read back
            from the paged cache (dequantized), so the cache dtype shows here too; pure XLA (no backend choice)
Rows: weights (bf16 checkpoint, AWQ checkpoint) x kv cache dtype x backend. A backend that cannot run on this
device is listed with the reason (never replaced by another). Writes JSON (device, jax version, commit, date).
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import time

import jax

import mla_jax
from pallas_kernels import resolve_backend
from mla_train.evaluate import heldout_windows, score_decode, score_forward, score_prefill


def _commit() -> str:
    if os.environ.get("GIT_COMMIT"):  # set by callers whose copy of the tree has no .git (e.g. a remote run)
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-deepseek-py", help="AWQ checkpoint (with training.json)")
    ap.add_argument("--bf16-model", help="the unquantized bf16 checkpoint the AWQ one was made from")
    ap.add_argument("--kv-cache-dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--backends", default="xla,triton,mosaic_sm90")
    ap.add_argument("--paths", default="forward,prefill,decode")
    ap.add_argument("--num-seqs", type=int, default=64, help="held-out windows scored (0: all)")
    ap.add_argument("--windows", default="spread", choices=["spread", "first"],
                    help="spread: evenly over the whole test stream; first: its first --num-seqs windows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="batch of the forward path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype of the model (the checkpoint's weights are loaded into it)")
    ap.add_argument("--interpret", action="store_true", help="run Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--corpus-root", help="where the held-out files live (default: this Python's stdlib)")
    ap.add_argument("--out", help="JSON output (default bench/results/eval_ppl_<platform>.json)")
    args = ap.parse_args(argv)

    windows, stats = heldout_windows(args.model, args.seq_len, args.num_seqs, args.corpus_root, args.windows)
    print(f"held-out: {stats['matched']}/{stats['listed']} files matched under {stats['root']} "
          f"(changed {len(stats['changed'])}, missing {len(stats['missing'])}); {windows.shape[0]} windows x "
          f"{windows.shape[1] - 1} scored tokens = {windows.shape[0] * (windows.shape[1] - 1):,} tokens", flush=True)
    weights_list = ([("bf16", args.bf16_model)] if args.bf16_model else []) + [("awq" if _is_awq(args.model)
                                                                               else "bf16", args.model)]
    cache_dtypes = [c for c in args.kv_cache_dtypes.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    paths = [p for p in args.paths.split(",") if p]
    dev = jax.devices()[0]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "results",
                                   f"eval_ppl_{dev.platform}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = out + ".partial.jsonl"  # rows as they finish, in case the run is cut short
    if os.path.exists(partial):
        os.remove(partial)
    rows = []

    def add(weights, cache, backend, path, nll=None, seconds=None, note=None):
        row = {"weights": weights, "kv_cache_dtype": cache, "backend": backend, "path": path}
        if nll is not None:
            row.update(nll=float(nll.mean()), ppl=math.exp(float(nll.mean())), tokens=int(nll.size),
                       seconds=round(seconds, 1))
        if note:
            row["note"] = note
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(partial, "a") as f:
            f.write(json.dumps(row) + "\n")

    for wname, wpath in weights_list:
        model, cfg = mla_jax.load_model(wpath, dtype=args.dtype)
        if "forward" in paths:
            t0 = time.time()
            add(wname, "-", "-", "forward", score_forward(model, windows, args.batch), time.time() - t0)
        for cache in cache_dtypes:
            if "prefill" in paths:
                t0 = time.time()
                add(wname, cache, "xla", "prefill", score_prefill(model, windows, cache, args.chunk), time.time() - t0)
            if "decode" not in paths:
                continue
            for backend in backends:
                try:
                    resolve_backend(backend, cache, args.interpret)
                except ValueError as e:
                    add(wname, cache, backend, "decode", note=f"not run: {e}")
                    continue
                t0 = time.time()
                try:
                    nll = score_decode(model, windows, cache, backend, args.interpret)
                except Exception as e:  # a kernel that fails is reported in the table, the other rows still run
                    add(wname, cache, backend, "decode", note=f"failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                add(wname, cache, backend, "decode", nll, time.time() - t0)

    # Relative change against the bf16 cache of the same weights/backend/path.
    base = {(r["weights"], r["backend"], r["path"]): r["ppl"] for r in rows
            if r["kv_cache_dtype"] == "bfloat16" and "ppl" in r}
    for r in rows:
        b = base.get((r["weights"], r["backend"], r["path"]))
        if b and "ppl" in r and r["kv_cache_dtype"] != "bfloat16":
            r["ppl_vs_bf16_cache_pct"] = 100.0 * (r["ppl"] / b - 1.0)

    result = {
        "script": "scripts/eval_ppl.py", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.platform}:{dev.device_kind}", "jax": jax.__version__, "commit": _commit(),
        "models": dict(weights_list), "num_seqs": int(windows.shape[0]), "windows": args.windows, "seq_len": int(windows.shape[1] - 1),
        "chunk": args.chunk, "interpret": args.interpret, "dtype": args.dtype, "heldout": {k: v for k, v in stats.items()
                                                                   if k in ("listed", "matched", "root")},
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.remove(partial)

    print(f"\nheld-out perplexity, {result['num_seqs']} x {result['seq_len']} tokens, {args.dtype} compute, {result['device']}, "
          f"jax {result['jax']}, commit {result['commit']}, {result['date']}")
    print(f"{'weights':8} {'kv cache':10} {'backend':12} {'path':8} {'ppl':>9} {'vs bf16 cache':>14}")
    for r in rows:
        ppl = f"{r['ppl']:9.4f}" if "ppl" in r else f"{'-':>9}"
        rel = f"{r['ppl_vs_bf16_cache_pct']:+13.3f}%" if "ppl_vs_bf16_cache_pct" in r else f"{'':>14}"
        print(f"{r['weights']:8} {r['kv_cache_dtype']:10} {r['backend']:12} {r['path']:8} {ppl} {rel}"
              + (f"  ({r['note'].split(';')[0]})" if "note" in r else ""))
    print(f"wrote {out}")


def _is_awq(path: str) -> bool:
    with open(os.path.join(path, "config.json")) as f:
        return bool(json.load(f).get("quantization_config"))


if __name__ == "__main__":
    main()
