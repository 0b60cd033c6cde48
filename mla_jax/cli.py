"""What the command-line entry points (scripts/generate.py, scripts/convert.py, the server) share: the engine's
flags, library logging kept quiet, bad input reported as one line, and the progress bar of a batch of requests.
Imports nothing from the project and no jax, so a script can check its arguments before jax starts.

    add_engine_args(ap)          --model, --dtype, --kv-cache-dtype, --attention-backend, ..., TP/DP (mla_jax.LLM's)
    engine_kwargs(args)          mla_jax.LLM keyword arguments from those flags
    configure_logging(verbose)   our loggers and the libraries' (absl/orbax, jax, tensorstore) at WARNING, or INFO
                                 with --verbose
    report_error(exc, verbose)   "error: ..." on one line of stderr (the traceback first with --verbose); returns 2
    USER_ERRORS                  the exceptions that mean bad input (a file, a flag) rather than a bug
    GenerationProgress           requests finished / total and output tok/s, on a terminal only
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback

from tqdm import tqdm

# The embedded model, by name (mla_jax.checkpoint.files.EMBEDDED_MODELS resolves it from any directory).
DEFAULT_MODEL = "tiny-deepseek-py"
# Bad input: a missing or corrupt file (mla_jax.checkpoint.errors.CheckpointError is a ValueError), a flag the
# engine cannot honour. Anything else is a bug in mla_jax and keeps its traceback.
USER_ERRORS = (ValueError, OSError)
# Loggers of libraries that log INFO lines a user did not ask for (orbax logs through absl: ~80 lines a convert).
LIBRARY_LOGGERS = ("absl", "orbax", "jax", "jaxlib", "tensorstore", "flax")
# Library argument names that error messages mention -> the script flag that sets them.
FLAG_FOR_ARGUMENT = {"interpret=True": "--interpret", "backend='auto'": "--attention-backend auto"}


def configure_logging(verbose: bool) -> None:
    """INFO from everything with verbose, else WARNING and above only (also from the libraries above)."""
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def error_line(exc: BaseException) -> str:
    """'error: <message>' on one line, library argument names replaced by the script's flags."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    for argument, flag in FLAG_FOR_ARGUMENT.items():
        text = text.replace(argument, flag)
    return f"error: {text}"


def report_error(exc: BaseException, verbose: bool) -> int:
    """Prints the error as one line on stderr (after its traceback when verbose); returns exit status 2."""
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    else:
        sys.stderr.flush()
    print(error_line(exc), file=sys.stderr, flush=True)
    return 2


class GenerationProgress:
    """A progress bar over a batch of requests: finished / total and generated tok/s since the start. Shown on a
    terminal only (tqdm's disable=None), so piped output and logs stay clean; gone when closed."""

    def __init__(self, total: int, desc: str = "generating"):
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=None, leave=False, file=sys.stderr)
        self.tokens = 0
        self.t0 = self._shown = time.perf_counter()

    def token(self, finished: bool) -> None:
        """One generated token; finished: it was its request's last."""
        self.tokens += 1
        now = time.perf_counter()
        if finished:
            self.bar.update(1)
        if now - self._shown >= 0.5:            # at most two redraws a second
            self._shown = now
            self.bar.set_postfix_str(f"{self.tokens / (now - self.t0):.1f} tok/s")

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "GenerationProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the engine's flags --------------------------------------------------------------------------------------

def add_engine_args(ap: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    """Adds the flags engine_kwargs() reads, plus --model."""
    ap.add_argument("--model", default=default_model,
                    help="HF-format or converted model directory, or the name of an embedded model (default: "
                         f"{default_model}, checkpoints/{DEFAULT_MODEL})")
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
    ap.add_argument("--expert-dispatch", default="all_gather", choices=["all_gather", "all_to_all"],
                    help="over several devices, how tokens reach the routed experts: all_gather (every device sees "
                         "every token; the reference) or all_to_all (each token goes only to the devices holding "
                         "its experts)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """mla_jax.LLM keyword arguments (all but the model path) from flags added by add_engine_args."""
    return dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, interpret=args.interpret, seed=args.seed,
                data_parallel_attention=args.data_parallel_attention, expert_dispatch=args.expert_dispatch)
