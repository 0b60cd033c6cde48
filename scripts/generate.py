"""Generate text with mla_jax.LLM (thin argparse main over the library).

    python scripts/generate.py                                   # embedded default model, default prompt
    python scripts/generate.py --prompt "def quicksort(xs):" --max-tokens 64 --stream
    python scripts/generate.py --model /path/to/DeepSeek-V3-AWQ --kv-cache-dtype fp8_e4m3 --chat --prompt "Hi"

Prints the attention backend line (choice and reason), each prompt's generated text, and a summary (prompt and
generated tokens, output tok/s, time to first token). Sampling defaults come from the model's
generation_config.json (temperature, top_p, top_k) when it has one, else greedy; flags override them
(mla_jax.SamplingParams.from_generation_config).
Exit status: 0 on success; 1 if a request failed (its reason is printed, the other requests still run);
2 on bad input, reported on one line before any model is loaded where it can be (flags, prompts), else once the
engine cannot be built as asked (a missing or corrupt checkpoint file, --attention-backend mosaic_sm90 on a CPU:
the file or reason is named). --verbose adds the traceback and INFO logging.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from mla_jax.checkpoint.files import resolve_model_dir
from mla_jax.cli import (DEFAULT_MODEL, USER_ERRORS, GenerationProgress, add_engine_args, configure_logging,
                         engine_kwargs, report_error)
from mla_jax.engine.params import SamplingParams
from mla_jax.engine.text import Tokenizer

DEFAULT_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", help="a file with one prompt per line (or a JSON list of strings)")
    ap.add_argument("--prompt-token-ids", action="append", default=None,
                    help="a prompt given as comma-separated token ids (repeatable; for models without a tokenizer)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    add_engine_args(ap)       # --model, --dtype, ..., --max-num-seqs, TP/DP (mla_jax.cli)
    ap.add_argument("--coordinator-address", default=None,
                    help="host:port of process 0, to run one process per host (jax.distributed); every process "
                         "runs this same command with its own --process-id and prints the same results")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    ap.add_argument("--stream", action="store_true", help="print text as it is generated")
    ap.add_argument("--verbose", action="store_true", help="INFO logging; tracebacks with errors")
    ap.add_argument("--compilation-cache", default=None, metavar="DIR|off",
                    help="JAX's persistent compilation cache: a second run with the same shapes compiles nothing "
                         "(default: $MLA_JAX_COMPILATION_CACHE, else ~/.cache/mla_jax/jax_compilation_cache; "
                         "'off' disables it)")
    return ap.parse_args(argv)


def check_args(args) -> None:
    """Flag values the engine would reject only after loading the model."""
    for flag, value, low in (("--max-tokens", args.max_tokens, 0), ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--tensor-parallel-size", args.tensor_parallel_size, 1),
                             ("--max-model-len", args.max_model_len, 1), ("--num-processes", args.num_processes, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: must be >= {low}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id}: must be in [0, --num-processes {args.num_processes})")


def read_prompts(args, tokenizer) -> tuple[list, list]:
    """(prompts for the engine: text or token ids, prompts as shown: with --chat the rendered template text)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            text = f.read()
        if args.prompts_file.endswith(".json"):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file} is not valid JSON ({e}); a .json prompts file holds a list "
                                 "of strings") from None
            if not isinstance(loaded, list) or not all(isinstance(p, str) for p in loaded):
                raise ValueError(f"{args.prompts_file}: a .json prompts file must hold a list of strings")
            prompts += loaded
        else:
            prompts += [line for line in text.splitlines() if line.strip()]
    for ids in args.prompt_token_ids or []:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise ValueError(f"--prompt-token-ids {ids!r}: give comma-separated integers") from None
    if not prompts:
        prompts = list(DEFAULT_PROMPTS)
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer.json, so text prompts cannot be encoded; pass "
                         "--prompt-token-ids")
    shown = list(prompts)
    if args.chat:
        shown = [p if not isinstance(p, str) else tokenizer.apply_chat_template([{"role": "user", "content": p}])
                 for p in prompts]
        prompts = [s if not isinstance(s, str) else tokenizer.encode(s, add_special_tokens=False) for s in shown]
    return prompts, shown



def programs_line(stats: dict) -> str:
    """Where this run's step programs came from (a second run with the same shapes loads them all)."""
    loaded = stats["disk"] + stats["memory"]
    return f"step programs: {stats['compiled']} compiled, {loaded} loaded (the first steps include this)"

def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    # Everything that can be checked without the model is checked first: flags, prompts, sampling parameters.
    try:
        check_args(args)
        args.model = resolve_model_dir(args.model)
        if not os.path.isdir(args.model):
            raise FileNotFoundError(f"model directory {args.model!r} does not exist (give an HF-format or converted "
                                    f"model directory, or the name of an embedded model: {DEFAULT_MODEL})")
        prompts, shown = read_prompts(args, Tokenizer.from_dir(args.model))
        flags = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
        params = SamplingParams.from_generation_config(args.model, max_tokens=args.max_tokens,
                                                       ignore_eos=args.ignore_eos, **flags)
    except USER_ERRORS as e:
        return report_error(e, args.verbose)

    if args.coordinator_address is not None:      # before anything touches a jax device
        from mla_jax import sharding
        sharding.initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    import jax
    import mla_jax
    from mla_jax.engine.compile_cache import enable_compilation_cache

    try:
        enable_compilation_cache(args.compilation_cache)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    try:
        llm = mla_jax.LLM(args.model, **engine_kwargs(args))
    except USER_ERRORS as e:
        return report_error(e, args.verbose)
    t_loaded = time.perf_counter()
    print(f"attention backend: {llm.backend} ({llm.backend_reason}); kv cache {llm.kv_cache_dtype}; "
          f"device {jax.devices()[0].device_kind}; model loaded in {t_loaded - t_start:.1f} s", flush=True)

    t0 = time.perf_counter()
    outputs = None
    # --stream: prompts are shown in order; the lowest unfinished one streams live, the others' text is held until
    # their turn (several prompts never interleave on the screen).
    n = len(prompts)
    pending = [[] for _ in range(n)]
    finished = {}                          # index -> line to print after its text
    focus = 0

    def header(i):
        print(f"\n=== [{i}] prompt: {shown[i]!r}", flush=True)

    def advance():
        nonlocal focus
        while focus < n:
            print("".join(pending[focus]), end="", flush=True)
            pending[focus] = []
            if focus not in finished:
                return
            print(finished[focus], flush=True)
            focus += 1
            if focus < n:
                header(focus)

    if args.stream and n:
        header(0)
    counts = [0] * n
    progress = None if args.stream else GenerationProgress(n)     # finished / total and tok/s, on a terminal
    for ev in llm.generate_stream(prompts, params):
        if ev.outputs is not None:
            outputs = ev.outputs
            continue
        counts[ev.index] += 1
        if progress is not None:
            progress.token(ev.finish_reason is not None)
        else:
            pending[ev.index].append(ev.text)
            if ev.finish_reason is not None:
                finished[ev.index] = f"\n--- finish_reason={ev.finish_reason} tokens={counts[ev.index]}"
            advance()
    elapsed = time.perf_counter() - t0
    if progress is not None:
        progress.close()

    failed = sum(o.error is not None for o in outputs)
    for o in outputs:
        line = (f"error: {o.error}" if o.error is not None else
                f"--- finish_reason={o.finish_reason} tokens={len(o.token_ids)}")
        if args.stream:
            finished.setdefault(o.request_id, line)     # requests that produced no token events
        else:
            header(o.request_id)
            if o.error is None:
                print(o.text if llm.tokenizer is not None else o.token_ids)
            print(line)
    if args.stream:
        advance()
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs if o.error is None)
    n_gen = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics["time_to_first_token_s"] for o in outputs if o.metrics.get("time_to_first_token_s")]
    ttft = (f"time to first token {min(ttfts):.3f} s (first request) / {sum(ttfts) / len(ttfts):.3f} s (mean)"
            if ttfts else "no tokens generated")
    print(f"\nsummary: {len(outputs)} prompts ({failed} failed), {n_prompt} prompt tokens, {n_gen} generated "
          f"tokens in {elapsed:.2f} s = {n_gen / elapsed if elapsed > 0 else 0.0:.1f} tok/s; {ttft}; "
          f"{llm.scheduler.num_preemptions} preemptions; {programs_line(llm.program_stats())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
