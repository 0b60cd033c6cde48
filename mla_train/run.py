"""The whole training run of the embedded model: corpus, tokenizer, training loop with periodic validation
(the best validation step is kept), test-set score, samples and the HF export (scripts/train_tiny.py is its
command line)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.config import ModelConfig
from mla_train.config import count_params, tiny_hf_config
from mla_train.corpus import read_python_files, split_files, stdlib_root
from mla_train.export import save_hf_checkpoint
from mla_train.sampler import TextSampler
from mla_train.tokenizer import BOS, EOS, PAD, eval_windows, token_stream, train_tokenizer
from mla_train.trainer import Trainer, TrainHParams


@dataclasses.dataclass
class RunOptions:
    out_dir: str
    vocab_size: int = 4096
    model_overrides: dict = dataclasses.field(default_factory=dict)
    hp: TrainHParams = dataclasses.field(default_factory=TrainHParams)
    heldout_fraction: float = 0.03       # test files (scored only)
    valid_fraction: float = 0.02         # validation files (pick the best step)
    train_seconds: float | None = 180.0  # time budget for the training loop (calibrates the step count)
    steps: int | None = None              # exact step count (overrides train_seconds for the schedule)
    deadline_seconds: float | None = None  # stop training this long after the run started, whatever happens
    reserve_seconds: float = 45.0         # kept free before the deadline for the final eval and export
    log_every: int = 50
    eval_every: int = 250
    eval_windows: int = 64                # validation windows for the periodic check
    final_eval_windows: int | None = None  # None: the whole test stream
    eval_batch_size: int = 32
    corpus_root: str | None = None
    corpus_label: str | None = None       # what corpus_root is, for training.json (e.g. a copied stdlib)
    max_files: int | None = None
    sample_prompts: tuple[str, ...] = ("def fibonacci(n):", "import os\n\n\nclass", "    def __repr__(self):")
    sample_tokens: int = 96


def run_training(opts: RunOptions, log: Callable[[str], None] = print) -> dict:
    """Runs `opts` end to end and writes the HF directory opts.out_dir; returns what training.json holds."""
    t_start = time.time()
    hp = opts.hp
    deadline = None if opts.deadline_seconds is None else t_start + opts.deadline_seconds

    root = opts.corpus_root or stdlib_root()
    files, skipped = read_python_files(root, opts.max_files)
    train_files, valid_files, held_files = split_files(files, hp.seed, opts.heldout_fraction, opts.valid_fraction)
    log(f"corpus: {len(files)} files ({sum(len(f.text) for f in files) / 1e6:.1f} M chars) under {root} "
        f"(this is Python {platform.python_version()}); {len(skipped)} non-UTF-8 skipped; {len(train_files)} train "
        f"/ {len(valid_files)} validation / {len(held_files)} test files")

    t0 = time.time()
    tok = train_tokenizer((f.text for f in train_files), opts.vocab_size)
    train_stream = token_stream(tok, train_files)
    held_stream = token_stream(tok, held_files)
    valid_stream = token_stream(tok, valid_files) if valid_files else None
    train_bytes = sum(len(f.text.encode()) for f in train_files)
    log(f"tokenizer: vocab {tok.get_vocab_size()} in {time.time() - t0:.1f}s; train {len(train_stream):,} tokens "
        f"({train_bytes / len(train_stream):.2f} bytes/token), validation "
        f"{0 if valid_stream is None else len(valid_stream):,}, test {len(held_stream):,} tokens")
    if len(train_stream) < hp.seq_len + 2:
        raise ValueError(f"training stream of {len(train_stream)} tokens is shorter than one window")

    hf_config = tiny_hf_config(opts.vocab_size, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
                               pad_token_id=tok.token_to_id(PAD), **opts.model_overrides)
    cfg = ModelConfig.from_hf_dict(hf_config)
    counts = count_params(hf_config)
    dims = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_shared_experts", "moe_intermediate_size", "intermediate_size")
    log(f"model: {json.dumps({k: hf_config[k] for k in dims})}")
    log(f"params: {counts['total'] / 1e6:.2f} M total ({counts['decoder_linears'] / 1e6:.2f} M in decoder linears, "
        f"{counts['embed_and_lm_head'] / 1e6:.2f} M embed+lm_head); devices {jax.devices()}")

    trainer = Trainer(cfg, hp)
    stream = jnp.asarray(train_stream)
    data_key = jax.random.key(hp.seed + 1)
    check_windows = eval_windows(valid_stream if valid_stream is not None else held_stream, hp.seq_len,
                                 opts.eval_windows)
    check_name = "validation" if valid_stream is not None else "test"

    curve: list[dict] = []
    best = {"loss": math.inf, "step": 0, "state": None}
    total_steps = opts.steps or 10**9
    calibrated = opts.steps is not None
    step = 0
    t_loop = time.time()
    t_compile = None
    pending: list[dict] = []
    stop_reason = "steps"
    while step < total_steps:
        metrics = trainer.step(stream, data_key, step, total_steps)
        pending.append(metrics)
        step += 1
        if step == 1:
            jax.block_until_ready(metrics["loss"])
            t_compile = time.time() - t_loop
            log(f"step 1 (compile + first step) {t_compile:.1f}s, loss {float(metrics['loss']):.3f}")
            t_timed = time.time()
        if not calibrated and step == 21:
            jax.block_until_ready(metrics["loss"])
            per_step = (time.time() - t_timed) / 20
            budget = opts.train_seconds - (time.time() - t_loop)
            if deadline is not None:
                budget = min(budget, deadline - opts.reserve_seconds - time.time())
            total_steps = max(step + 1, step + int(budget / per_step * 0.95))
            calibrated = True
            log(f"calibrated: {per_step * 1e3:.1f} ms/step ({hp.batch_size * hp.seq_len / per_step:,.0f} tok/s) "
                f"-> {total_steps} steps")
        if step % opts.log_every == 0 or step == total_steps:
            ms = jax.device_get(pending)
            pending = []
            entry = {"step": step, "time_s": round(time.time() - t_loop, 2),
                     "loss": float(np.mean([m["loss"] for m in ms])),
                     "grad_norm": float(np.mean([m["grad_norm"] for m in ms])),
                     "lr": float(ms[-1]["lr"]), "max_expert_load": float(np.max([m["max_load"] for m in ms]))}
            if step % opts.eval_every == 0 or step == total_steps:
                entry["valid_loss"] = trainer.eval_loss(check_windows, opts.eval_batch_size)
                if entry["valid_loss"] < best["loss"]:
                    best = {"loss": entry["valid_loss"], "step": step,
                            "state": jax.tree.map(jnp.copy, (trainer.router, trainer.params, trainer.bias))}
            curve.append(entry)
            log("step {step:6d} {time_s:7.1f}s loss {loss:.4f} gnorm {grad_norm:.3f} lr {lr:.2e} max-load "
                "{max_expert_load:.2f}".format(**entry)
                + (f" {check_name} {entry['valid_loss']:.4f}" if "valid_loss" in entry else ""))
        now = time.time()
        if opts.train_seconds is not None and not opts.steps and now - t_loop > opts.train_seconds * 1.1:
            stop_reason = "train_seconds"
            break
        if deadline is not None and now > deadline - opts.reserve_seconds:
            stop_reason = "deadline"
            break
    train_time = time.time() - t_loop
    if stop_reason != "steps":
        log(f"stopped early at step {step} of {total_steps} ({stop_reason})")

    t0 = time.time()
    final_windows = eval_windows(held_stream, hp.seq_len, opts.final_eval_windows)
    last_test_loss = trainer.eval_loss(final_windows, opts.eval_batch_size)
    if best["state"] is not None and best["step"] != step:
        trainer.router, trainer.params, trainer.bias = best["state"]
        log(f"keeping step {best['step']} ({check_name} {best['loss']:.4f}); the last step {step} scored test "
            f"{last_test_loss:.4f}")
        held_loss = trainer.eval_loss(final_windows, opts.eval_batch_size)
    else:
        held_loss = last_test_loss
    best.pop("state")
    held_tokens = final_windows.shape[0] * hp.seq_len
    held_bytes_per_token = sum(len(f.text.encode()) for f in held_files) / len(held_stream)
    log(f"test (held-out files): loss {held_loss:.4f} nats/token, ppl {math.exp(held_loss):.3f}, "
        f"{held_loss / math.log(2) / held_bytes_per_token:.3f} bits/byte over {held_tokens:,} tokens "
        f"({time.time() - t0:.1f}s)")

    model = trainer.model(jnp.dtype(hp.compute_dtype))
    samples = []
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    sampler = TextSampler(model)
    for prompt in opts.sample_prompts:
        ids = [bos] + tok.encode(prompt, add_special_tokens=False).ids
        greedy = tok.decode(sampler.continue_ids(ids, opts.sample_tokens, eos_id=eos))
        sampled = tok.decode(sampler.continue_ids(ids, opts.sample_tokens, temperature=0.8, top_p=0.95,
                                                  seed=hp.seed, eos_id=eos))
        samples.append({"prompt": prompt, "greedy": greedy, "sampled_t0.8_p0.95": sampled})
        log(f"--- greedy, {prompt!r}:\n{prompt}{greedy}\n--- sampled (T=0.8, top-p 0.95):\n{prompt}{sampled}\n---")

    info = {
        "script": "scripts/train_tiny.py",
        "python": platform.python_version(), "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
        "corpus": {"root": root, "label": opts.corpus_label or f"stdlib of Python {platform.python_version()}",
                   "files": len(files), "non_utf8_skipped": len(skipped),
                   "train_files": len(train_files), "validation_files": len(valid_files),
                   "heldout_files": len(held_files), "train_tokens": int(len(train_stream)),
                   "validation_tokens": 0 if valid_stream is None else int(len(valid_stream)),
                   "heldout_tokens": int(len(held_stream)), "heldout_fraction": opts.heldout_fraction,
                   "valid_fraction": opts.valid_fraction, "max_files": opts.max_files,
                   "bytes_per_token": train_bytes / len(train_stream)},
        "heldout": [{"path": f.relpath, "sha256": f.sha256} for f in held_files],
        "validation": [{"path": f.relpath, "sha256": f.sha256} for f in valid_files],
        "hparams": dataclasses.asdict(hp), "vocab_size": opts.vocab_size, "params": counts,
        "steps": step, "planned_steps": total_steps if calibrated else None, "stop_reason": stop_reason,
        "kept_step": best["step"] or step, "kept_valid_loss": best["loss"] if best["step"] else None,
        "train_seconds": round(train_time, 1), "compile_seconds": round(t_compile or 0.0, 1),
        "tokens_seen": step * hp.batch_size * hp.seq_len,
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "heldout_loss": held_loss, "heldout_ppl": math.exp(held_loss), "heldout_eval_tokens": int(held_tokens),
        "heldout_bits_per_byte": held_loss / math.log(2) / held_bytes_per_token,
        "last_step_heldout_loss": last_test_loss,
        "curve": curve, "samples": samples,
        "bias_update": f"DeepSeek-V3 aux-loss-free rule, gamma={hp.bias_update_rate} per step",
    }
    written = save_hf_checkpoint(model, hf_config, tok, opts.out_dir, training_info=info)
    size = sum(os.path.getsize(os.path.join(opts.out_dir, f)) for f in written)
    log(f"wrote {opts.out_dir}: {', '.join(written)} ({size / 2**20:.2f} MiB); total run {time.time() - t_start:.0f}s")
    return info
