"""Command-line flags shared by the scripts and the server: the engine's (mla_jax.LLM's) settings.

    ap = argparse.ArgumentParser()
    add_engine_args(ap)                   # --model, --dtype, --kv-cache-dtype, --attention-backend, ...
    args = ap.parse_args()
    llm = mla_jax.LLM(args.model, **engine_kwargs(args))

Imports nothing from the project (argparse only), so a script can parse flags before jax starts.
"""
from __future__ import annotations

import argparse
import os

# The embedded model ships in the repository next to the package (an editable install or a checkout).
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints",
                             "tiny-deepseek-py")


def add_engine_args(ap: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    """Adds the flags engine_kwargs() reads, plus --model."""
    ap.add_argument("--model", default=default_model,
                    help="HF-format model directory (default: the embedded model checkpoints/tiny-deepseek-py)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed; request i gets a seed derived from it")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3", "float32"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "mosaic_sm90", "triton", "xla"])
    ap.add_argument("--interpret", action="store_true", help="run Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prompt tokens per prefill step (the chunk size of chunked prefill)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="devices to run over (all of them with several processes): attention heads and experts "
                         "split over them")
    ap.add_argument("--data-parallel-attention", action="store_true",
                    help="with --tensor-parallel-size N: split sequences and their KV-cache pages over the devices "
                         "instead of attention heads (experts stay split)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """mla_jax.LLM keyword arguments (all but the model path) from flags added by add_engine_args."""
    return dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, interpret=args.interpret, seed=args.seed,
                data_parallel_attention=args.data_parallel_attention)
