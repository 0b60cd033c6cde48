"""Several devices give the one-device result: greedy tokens equal, fp32 logprobs within --atol, for a small
random DeepSeek-V3-shaped model, under TP, data-parallel attention, and both expert dispatch paths (all_gather,
all_to_all); as one process over N devices, and as N processes of one device each through jax.distributed on
this host. Exit status 1 on any mismatch; JSON to bench/results/check_multi_gpu_<platform>.json.

    python scripts/check_multi_gpu.py                         # GPUs: 2 of them (--num-devices)
    python scripts/check_multi_gpu.py --cpu                   # the same on simulated CPU devices

Every phase runs in a child process (so the GPUs are free for the next one): the reference (1 device) and the
one-process configs in one child, then N children, one per device, for the multi-process configs. Weights are
random, generated from --seed identically in every process (the same values whatever the sharding).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# attention mode:expert dispatch
CONFIGS = ("tp:all_gather", "tp:all_to_all", "dp_attention:all_gather", "dp_attention:all_to_all")

# V3's structure at a small width (heads, experts, groups divisible by 8; the real MLA cache dims)
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
             first_k_dense_replace=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-devices", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="simulated CPU devices instead of GPUs")
    ap.add_argument("--phases", nargs="+", choices=("one_process", "multi_process"),
                    default=["one_process", "multi_process"])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                    help="attention mode (tensor parallel, data-parallel attention) : expert dispatch path")
    ap.add_argument("--quantized", action="store_true", help="AWQ int4 (group 16) routed experts and linears")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--num-prompts", type=int, default=6, help="(not a multiple of the devices: padding rows)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--atol", type=float, default=1e-4, help="logprob tolerance (absolute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    ap.add_argument("--out", default=None)
    # internal: a child process
    ap.add_argument("--child", choices=("one_process", "multi_process"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator-address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# parent: start the children, compare, report
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    import tempfile
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # the reference, and the one-process configs when asked (one child over all devices)
        out = os.path.join(tmp, "one_process.json")
        run_children(args, "one_process", [out])
        results = json.load(open(out))
        if "multi_process" in args.phases:
            outs = [os.path.join(tmp, f"multi_process_{i}.json") for i in range(args.num_devices)]
            run_children(args, "multi_process", outs)
            per_process = [json.load(open(o)) for o in outs]
            for name, first in per_process[0].items():
                results[name] = first
                for i, other in enumerate(per_process[1:], 1):     # every process must see the same result
                    if other[name]["token_ids"] != first["token_ids"]:
                        first["error"] = f"process {i} returned other tokens than process 0"
    report = compare(results, args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path = args.out or os.path.join(REPO, "bench", "results", f"check_multi_gpu_{'cpu' if args.cpu else 'gpu'}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    print("PASS" if report["ok"] else "FAIL", flush=True)
    return 0 if report["ok"] else 1


def forwarded(args) -> list:
    """The options a child needs, from the parent's parsed args."""
    argv = ["--num-devices", str(args.num_devices), "--phases", *args.phases, "--configs", *args.configs,
            "--dtype", args.dtype,
            "--kv-cache-dtype", args.kv_cache_dtype, "--attention-backend", args.attention_backend,
            "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    return argv + ["--cpu"] * args.cpu + ["--quantized"] * args.quantized


def child_env(args, device_count: int) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"        # the children use the GPUs in turn
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={device_count}")
    return env


def run_children(args, phase: str, outs: list) -> None:
    base = [sys.executable, os.path.abspath(__file__), *forwarded(args), "--child", phase]
    if phase == "one_process":
        cmds, envs = [[*base, "--child-out", outs[0]]], [child_env(args, args.num_devices)]
    else:
        coordinator = f"localhost:{free_port()}"
        cmds = [[*base, "--child-out", out, "--coordinator-address", coordinator, "--process-id", str(i)]
                for i, out in enumerate(outs)]
        envs = [child_env(args, 1) for _ in outs]
    procs = [subprocess.Popen(c, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c, e in zip(cmds, envs)]
    texts = []
    try:
        for p in procs:
            texts.append(p.communicate(timeout=args.timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, text) in enumerate(zip(procs, texts)):
        print(f"---- {phase} child {i} (rc {p.returncode}) ----\n{text[-3000:]}", flush=True)
        if p.returncode != 0:
            raise SystemExit(f"{phase} child {i} failed with rc {p.returncode}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def compare(results: dict, args) -> dict:
    """Each config against the reference: tokens equal and max |logprob difference| <= atol."""
    import numpy as np
    ref = results["reference"]
    rows, ok = [], True
    print(f"{'config':44s} {'tokens':>8s} {'max |dlogprob|':>15s}")
    for name, got in results.items():
        if name == "reference":
            continue
        same_tokens = got["token_ids"] == ref["token_ids"] and "error" not in got
        diff = max((float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(got["logprobs"], ref["logprobs"])
                    if len(a) == len(b)), default=float("inf")) if same_tokens else None
        passed = same_tokens and diff is not None and diff <= args.atol
        ok &= passed
        rows.append(dict(config=name, tokens_equal=same_tokens, max_abs_logprob_diff=diff, passed=passed,
                         error=got.get("error"), seconds=got.get("seconds")))
        print(f"{name:44s} {'equal' if same_tokens else 'DIFFER':>8s} "
              f"{diff if diff is not None else float('nan'):15.2e}  {'ok' if passed else 'FAIL'}")
    return {"ok": bool(ok) and bool(rows), "atol": args.atol, "rows": rows, "reference_tokens": ref["token_ids"],
            "model": ref["model"], "env": ref["env"], "num_devices": args.num_devices}


# ---------------------------------------------------------------------------------------------------------------
# child: run the configs, write tokens and logprobs
# ---------------------------------------------------------------------------------------------------------------

def child(args) -> int:
    if args.child == "multi_process":
        from mla_jax import sharding
        sharding.initialize_distributed(args.coordinator_address, args.num_devices, args.process_id,
                                        local_device_ids=None if args.cpu else [args.process_id])
    import jax

    from mla_jax import sharding

    if jax.device_count() < args.num_devices:
        raise SystemExit(f"needs {args.num_devices} devices, found {jax.device_count()} ({jax.devices()[0].platform})")
    cfg, model_info = small_config(args)
    prompts = make_prompts(args, cfg)
    results = {}
    if args.child == "one_process":
        results["reference"] = generate(args, cfg, prompts, plan=None)
        results["reference"].update(model=model_info, env=env_info())
    configs = () if args.child == "one_process" and "one_process" not in args.phases else args.configs
    where = (f"{args.num_devices} processes x 1 device (jax.distributed)" if args.child == "multi_process"
             else f"1 process x {args.num_devices} devices")
    for config in configs:
        mode, dispatch = config.split(":")
        plan = sharding.ShardingPlan.create(cfg, args.num_devices, mode == "dp_attention", expert_dispatch=dispatch)
        results[f"{mode}{args.num_devices} {dispatch} [{where}]"] = generate(args, cfg, prompts, plan)
    if args.child == "multi_process":
        jax.distributed.shutdown()
    with open(args.child_out, "w") as f:
        json.dump(results, f)
    return 0


def small_config(args):
    from mla_jax.config import ModelConfig, deepseek_v3_hf_config
    hf = deepseek_v3_hf_config(16 if args.quantized else None, **SMALL)
    info = (f"DeepSeek-V3-shaped, {SMALL['num_hidden_layers']} layers, hidden {SMALL['hidden_size']}, "
            f"{SMALL['n_routed_experts']} experts top-{SMALL['num_experts_per_tok']}, "
            f"{'AWQ int4 g16' if args.quantized else args.dtype} weights, random (seed {args.seed}), dtype {args.dtype}, "
            f"kv cache {args.kv_cache_dtype}")
    return ModelConfig.from_hf_dict(hf), info


def make_prompts(args, cfg) -> list:
    import numpy as np
    rng = np.random.default_rng(args.seed)
    return [rng.integers(2, cfg.vocab_size, size=int(rng.integers(3, 40))).tolist() for _ in range(args.num_prompts)]


def generate(args, cfg, prompts, plan) -> dict:
    """Greedy generation with per-token logprobs. The weights come from init_sharded with the plan's shardings
    (a one-device plan for the reference): every process generates the same values for its part."""
    import jax.numpy as jnp

    from mla_jax import sharding
    from mla_jax.checkpoint.sharded import init_sharded
    from mla_jax.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    dtype = jnp.dtype(args.dtype)
    model = init_sharded(cfg, plan or sharding.ShardingPlan.create(cfg, 1), dtype, seed=args.seed)
    n = plan.num_devices if plan else 1
    seqs = -(-len(prompts) // n) * n
    llm = LLM.from_model(model, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                         max_model_len=128, max_num_seqs=seqs, num_pages=n * (seqs * 2 + 1), page_size=64,
                         tensor_parallel_size=n, data_parallel_attention=bool(plan and plan.data_parallel_attention),
                         sharding_plan=plan)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=True,
                                                ignore_eos=True))
    return {"token_ids": [list(o.token_ids) for o in outs], "logprobs": [list(map(float, o.logprobs)) for o in outs],
            "backend": llm.backend, "seconds": round(time.perf_counter() - t0, 2)}


def env_info() -> dict:
    import jax
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    return {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
            "git_commit": commit.strip()}


if __name__ == "__main__":
    sys.exit(main())
