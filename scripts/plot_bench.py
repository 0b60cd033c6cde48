"""Charts of the measured benchmarks in bench/results (PNG): what a reader would rather look at than read.

    pip install -e ".[plot]"          # matplotlib
    python scripts/plot_bench.py      # -> bench/plots/{mla_decode_roofline,w4a16_roofline,engine_tok_s}.png

- mla_decode_roofline.png: every MLA decode backend on every uniform-length shape of the grid JSONs
  (bench_mla.py), achieved TFLOP/s against arithmetic intensity (FLOP per cache byte), under the copy-bandwidth
  roofline (measured HBM copy GB/s of the same run × intensity) and the tensor-core peak; one panel per cache dtype.
- w4a16_roofline.png: the W4A16 ops (bench_w4a16.py): dense AWQ linears and one DeepSeek-V3 MoE layer, the Pallas
  kernel and XLA's dequant + dot, on the same axes.
- engine_tok_s.png: LLM output tok/s against batch size (bench_generate.py).

Each chart names its source JSONs, device, jax version and commit. Only numbers in the JSON files are drawn
(FLOPs of the W4A16 rows come from their shapes, as bench_w4a16.py defines them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
MLA_FILES = ("mla_bench_b128_h200_22fa9ff.json", "mla_bench_b32_h200_e989f89.json")
W4A16_FILES = ("w4a16_dense_h200.json", "w4a16_moe_h200.json")
ENGINE_FILE = "generate_model_h200.json"
# NVIDIA's H200 SXM dense 16-bit tensor-core rate (the MLA and W4A16 kernels multiply in bf16/f16).
TENSOR_CORE_TFLOPS = 989.0
# One DeepSeek-V3 MoE layer as bench_w4a16.py runs it (its MOE dict): each token meets top_k experts of three
# [hidden, inter] matmuls (gate, up, down).
MOE = dict(hidden=7168, inter=2048, top_k=8)
BACKEND_COLOR = {"mosaic_sm90": "tab:red", "triton": "tab:blue", "xla": "tab:gray", "w4a16 triton": "tab:blue",
                 "xla dequant+dot": "tab:gray"}


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


def mla_points(docs: list[dict]) -> list[dict]:
    """Uniform-length MLA decode records -> {backend, dtype, shape, intensity (FLOP/B), tflops, copy_gbps}."""
    out = []
    for doc in docs:
        for r in doc["records"]:
            if r["lengths"] != "uniform":
                continue
            out.append(dict(backend=r["backend"], dtype=r["dtype"], heads=f"h{r['h']}",
                            shape=f"b{r['b']} h{r['h']} L{r['L']} Sq{r['sq']}",
                            intensity=r["tflops"] * 1e12 / (r["gbps"] * 1e9), tflops=r["tflops"],
                            copy_gbps=doc["copy_gbps"]))
    return out


def w4a16_points(docs: list[dict]) -> list[dict]:
    """Dense and MoE W4A16 rows -> points for the kernel and for XLA's dequant + dot (same FLOPs and bytes)."""
    out = []
    for doc in docs:
        for r in doc["rows"]:
            if r["op"] == "dense":
                flops, shape = 2.0 * r["m"] * r["k"] * r["n"], f"dense {r['k']}->{r['n']} M{r['m']}"
            elif r["op"] == "moe":
                flops = 2.0 * r["t"] * MOE["top_k"] * 3 * MOE["hidden"] * MOE["inter"]
                shape = f"MoE T{r['t']} g{r['group']}"
            else:
                continue
            for backend, us in (("w4a16 triton", r["us"]), ("xla dequant+dot", r.get("xla_us"))):
                if us:
                    out.append(dict(backend=backend, op=r["op"], shape=shape, intensity=flops / r["bytes"],
                                    tflops=flops / (us * 1e-6) / 1e12, copy_gbps=doc["copy_gbps"]))
    return out


def engine_points(doc: dict) -> list[tuple[int, float]]:
    return sorted((r["batch"], r["output_tok_s"]) for r in doc["rows"])


def _rooflines(ax, copy_gbps: float, lo: float, hi: float) -> None:
    import numpy as np

    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(x * copy_gbps / 1e3, TENSOR_CORE_TFLOPS), "k-", lw=1.2,
            label=f"roofline: copy {copy_gbps:,.0f} GB/s, tensor cores {TENSOR_CORE_TFLOPS:.0f} TFLOP/s")
    ax.axhline(TENSOR_CORE_TFLOPS, color="k", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)


def _scatter(ax, points: list[dict], group: str, markers: dict) -> None:
    """Colour by backend, marker by points[i][group] (head count, or dense / MoE)."""
    seen = set()
    for p in points:
        label = f"{p['backend']}, {p[group]}"
        ax.scatter(p["intensity"], p["tflops"], c=BACKEND_COLOR[p["backend"]], marker=markers[p[group]], s=28,
                   alpha=0.85, label=None if label in seen else label, edgecolors="none")
        seen.add(label)


def plot_mla(out_dir: str, plt) -> str:
    docs = [_load(f) for f in MLA_FILES]
    points = mla_points(docs)
    copy = min(d["copy_gbps"] for d in docs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, dtype in zip(axes, ("bfloat16", "fp8_e4m3")):
        sel = [p for p in points if p["dtype"] == dtype]
        _rooflines(ax, copy, 5, 2000)
        _scatter(ax, sel, "heads", {"h16": "o", "h128": "s"})
        ax.set_title(f"MLA decode, {dtype} cache")
        ax.legend(fontsize=6.5, loc="upper left")
    meta = docs[0]
    fig.suptitle(f"{meta['device']}, jax {meta['jax_version']}; uniform lengths, b 32/128, h 16/128, L 4096/16384, "
                 f"Sq 1/2 ({', '.join(MLA_FILES)})", fontsize=8)
    return _save(fig, out_dir, "mla_decode_roofline.png", plt)


def plot_w4a16(out_dir: str, plt) -> str:
    docs = [_load(f) for f in W4A16_FILES]
    points = w4a16_points(docs)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _rooflines(ax, min(d["copy_gbps"] for d in docs), 0.2, 200)
    _scatter(ax, points, "op", {"dense": "s", "moe": "o"})
    for p in points:
        if p["backend"] == "w4a16 triton" and p["op"] == "moe" and "g64" in p["shape"]:
            ax.annotate(p["shape"].replace(" g64", ""), (p["intensity"], p["tflops"]), fontsize=6,
                        xytext=(3, -8), textcoords="offset points")
    ax.set_title("W4A16 int4 x bf16: dense AWQ linears and a V3 MoE layer", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    meta = docs[0]
    fig.text(0.01, 0.005, f"{meta['device']}, jax {meta['jax']}, code {meta['commit']} "
             f"({', '.join(W4A16_FILES)}); MoE FLOPs 2·T·8·3·7168·2048", fontsize=6)
    return _save(fig, out_dir, "w4a16_roofline.png", plt)


def plot_engine(out_dir: str, plt) -> str:
    doc = _load(ENGINE_FILE)
    pts = engine_points(doc)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot([b for b, _ in pts], [t for _, t in pts], "o-", color="tab:red")
    for b, t in pts:
        ax.annotate(f"{t:,.0f}", (b, t), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([b for b, _ in pts], [str(b) for b, _ in pts])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tok/s")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    info, cfg = doc["info"], doc["config"]
    ax.set_title(f"LLM.generate, embedded model ({cfg['layers']} layers, AWQ int4), {doc['backend']}, "
                 f"{doc['kv_cache_dtype']} cache", fontsize=8)
    fig.text(0.01, 0.005, f"{info['device']}, jax {info['jax']}, commit {info['commit']}; 64-token prompts, "
             f"64 new tokens ({ENGINE_FILE})", fontsize=6)
    return _save(fig, out_dir, "engine_tok_s.png", plt)


def _save(fig, out_dir: str, name: str, plt) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "plots"), help="output directory")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print('error: plotting needs matplotlib; pip install -e ".[plot]"', file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    for plot in (plot_mla, plot_w4a16, plot_engine):
        path = plot(args.out, plt)
        print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
