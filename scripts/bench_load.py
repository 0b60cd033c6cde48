"""Load time: HF safetensors directory vs our converted (orbax) directory, for a fixture and a synthetic ~200 MB
model, unquantized (bf16) and AWQ. Each load runs in a fresh process (no warm jit/orbax state); files are in the
page cache for both formats (each is read once before timing). Prints a table last and writes JSON.

  python scripts/bench_load.py --out bench/results/load_converted_vs_hf_cpu.json [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURE = os.path.join(REPO, "tests", "fixtures", "v3_yarn")

SYNTH = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=8192, hidden_size=1024,
    intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
)

CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import jax, numpy as np
from flax import nnx
import mla_jax
t1 = time.perf_counter()
model, cfg = mla_jax.load_model(sys.argv[1], sys.argv[2])
jax.block_until_ready([v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def synth_hf(dst: str, seed: int = 0, layers: int = 4) -> int:
    """A random bf16 HF checkpoint of the SYNTH config with `layers` layers; returns its weight bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from mla_jax.checkpoint.hf import hf_param_map
    from mla_jax.config import ModelConfig

    config = dict(SYNTH, num_hidden_layers=layers)
    cfg = ModelConfig.from_hf_dict(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, t in hf_param_map(cfg).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            arr = np.ones(t.hf_shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            arr = np.zeros(t.hf_shape, np.float32)
        else:
            arr = rng.standard_normal(t.hf_shape, np.float32) * 0.02
        tensors[name] = arr.astype(np.float32 if name.endswith("e_score_correction_bias") else ml_dtypes.bfloat16)
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return sum(a.nbytes for a in tensors.values())


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def timed_load(path: str, dtype: str, repeats: int) -> dict:
    # read every file once so both formats are timed from the page cache
    for r, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(r, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass
    runs = []
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, path, dtype], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"load of {path} failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"load_s": statistics.median(r["load_s"] for r in runs), "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/load_converted_vs_hf_cpu.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--layers", default="4,16", help="synthetic model sizes (decoder layers; 4 = ~217 MB bf16)")
    args = ap.parse_args(argv)

    import jax

    from mla_jax.checkpoint.converted import convert_checkpoint
    from mla_jax.quant.pack import quantize_checkpoint

    try:
        commit = args.commit or subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                        text=True).strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    info = dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform, jax=jax.__version__,
                commit=commit, cpus=os.cpu_count(), dtype=args.dtype, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                note="median of fresh-process loads; load_s excludes interpreter/jax import; page cache warm")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = {}
        cases["fixture v3_yarn fp32"] = FIXTURE
        fx_awq = os.path.join(tmp, "fx_awq")
        quantize_checkpoint(FIXTURE, fx_awq, group_size=8)
        cases["fixture v3_yarn AWQ g8"] = fx_awq
        for L in [int(x) for x in args.layers.split(",")]:
            synth = os.path.join(tmp, f"synth{L}")
            synth_hf(synth, layers=L)
            cases[f"synthetic L{L} bf16"] = synth
            synth_awq = os.path.join(tmp, f"synth{L}_awq")
            quantize_checkpoint(synth, synth_awq, group_size=128)
            cases[f"synthetic L{L} AWQ g128"] = synth_awq
        for name, src in cases.items():
            conv = os.path.join(tmp, os.path.basename(src) + "_conv")
            t0 = time.perf_counter()
            convert_checkpoint(src, conv, progress=False)
            convert_s = time.perf_counter() - t0
            hf = timed_load(src, args.dtype, args.repeats)
            cv = timed_load(conv, args.dtype, args.repeats)
            row = dict(case=name, hf_bytes=dir_bytes(src), converted_bytes=dir_bytes(conv), convert_s=convert_s,
                       hf_load_s=hf["load_s"], converted_load_s=cv["load_s"],
                       speedup=hf["load_s"] / cv["load_s"], hf_runs=hf["runs"], converted_runs=cv["runs"])
            rows.append(row)
            print(f"{name:24s} HF {row['hf_load_s']:6.2f}s  converted {row['converted_load_s']:6.2f}s  "
                  f"x{row['speedup']:.2f}", flush=True)
            shutil.rmtree(conv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(info=info, loads=rows), f, indent=1)
    print(f"\nload_model(path, {args.dtype!r}) on {info['device']} ({info['cpus']} cpus), jax {info['jax']}, "
          f"commit {info['commit']}; median of {args.repeats} fresh processes")
    print(f"{'case':26s} {'HF MB':>7} {'conv MB':>8} {'HF s':>7} {'conv s':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['case']:26s} {r['hf_bytes'] / 1e6:7.1f} {r['converted_bytes'] / 1e6:8.1f} {r['hf_load_s']:7.2f} "
              f"{r['converted_load_s']:7.2f} {r['speedup']:8.2f}")
    # marginal cost between the two synthetic sizes: what a large checkpoint pays per GB of HF bytes
    marg = {}
    for kind in ("bf16", "AWQ g128"):
        rs = [r for r in rows if r["case"].startswith("synthetic") and r["case"].endswith(kind)]
        if len(rs) >= 2:
            a, b = rs[0], rs[-1]
            gb = (b["hf_bytes"] - a["hf_bytes"]) / 1e9
            marg[kind] = dict(hf_s_per_gb=(b["hf_load_s"] - a["hf_load_s"]) / gb,
                              converted_s_per_gb=(b["converted_load_s"] - a["converted_load_s"]) / gb)
            print(f"marginal {kind:9s}: HF {marg[kind]['hf_s_per_gb']:.2f} s/GB, converted "
                  f"{marg[kind]['converted_s_per_gb']:.2f} s/GB (per GB of HF checkpoint bytes)")
    with open(args.out, "w") as f:
        json.dump(dict(info=info, loads=rows, marginal=marg), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
