"""Train the embedded tiny DeepSeek-V3-architecture model on the Python standard library (thin main over
mla_train.run_training; see the mla_train package).

    python scripts/train_tiny.py --out /tmp/tiny-bf16                      # defaults: the shipped model's recipe
    python scripts/train_tiny.py --out /tmp/t --max-files 40 --steps 5 --hidden-size 64 --num-layers 2 \
        --vocab-size 512 --batch-size 2 --seq-len 64                        # a CPU smoke run

Writes an HF-format directory (bf16 safetensors + tokenizer + configs + training.json). Make the shipped AWQ
checkpoint from it with `--awq-out DIR` (mla_jax.quant.pack.quantize_checkpoint, group size 128).

The shipped checkpoints/tiny-deepseek-py came from one H200 run (see its README.md):
    python scripts/train_tiny.py --out tmp/tiny-bf16 --corpus-root <copy of CPython 3.12.1's stdlib .py files> \
        --train-seconds 170 --deadline-seconds 360       # timing fixed 2062 steps; --steps 2062 repeats them
The corpus was copied because the H200's system Python (3.12.3, Debian layout) has no test suite: 569 files,
2.9 M tokens, which a first run over-fitted within a minute (test loss rising from step 750 on).
"""

import argparse
import json
import os
import time

from mla_train import RunOptions, TrainHParams, run_training


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output HF checkpoint directory (bf16)")
    ap.add_argument("--awq-out", help="also write the AWQ int4 checkpoint here (group size --awq-group-size)")
    ap.add_argument("--awq-group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--num-heads", type=int)
    ap.add_argument("--n-routed-experts", type=int)
    ap.add_argument("--moe-intermediate-size", type=int)
    ap.add_argument("--intermediate-size", type=int)
    ap.add_argument("--q-lora-rank", type=int)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--train-seconds", type=float, default=180.0,
                    help="training-loop budget; the step count is fixed after timing the first steps")
    ap.add_argument("--steps", type=int, help="exact number of steps (overrides --train-seconds)")
    ap.add_argument("--deadline-seconds", type=float,
                    help="hard wall-clock limit from start: training stops early to leave time for eval + export")
    ap.add_argument("--heldout-fraction", type=float, default=0.03, help="test files (scored only)")
    ap.add_argument("--valid-fraction", type=float, default=0.02, help="validation files (pick the best step)")
    ap.add_argument("--max-files", type=int, help="use only the first N corpus files (smoke runs)")
    ap.add_argument("--corpus-root", help="directory of .py files (default: this interpreter's stdlib)")
    ap.add_argument("--corpus-label", help="what --corpus-root is (recorded in training.json)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batch-size", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--final-eval-windows", type=int, help="default: the whole held-out stream")
    ap.add_argument("--sample-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    overrides = {k: v for k, v in {
        "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "n_routed_experts": args.n_routed_experts,
        "moe_intermediate_size": args.moe_intermediate_size, "intermediate_size": args.intermediate_size,
        "q_lora_rank": args.q_lora_rank,
    }.items() if v is not None}
    hp = TrainHParams(seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len, peak_lr=args.lr,
                      warmup_steps=args.warmup_steps, compute_dtype=args.compute_dtype)
    opts = RunOptions(out_dir=args.out, vocab_size=args.vocab_size, model_overrides=overrides, hp=hp,
                      heldout_fraction=args.heldout_fraction, valid_fraction=args.valid_fraction,
                      corpus_label=args.corpus_label, train_seconds=args.train_seconds, steps=args.steps,
                      deadline_seconds=args.deadline_seconds, log_every=args.log_every, eval_every=args.eval_every,
                      eval_windows=args.eval_windows, final_eval_windows=args.final_eval_windows,
                      eval_batch_size=args.eval_batch_size, corpus_root=args.corpus_root, max_files=args.max_files,
                      sample_tokens=args.sample_tokens)
    info = run_training(opts, log=lambda s: print(s, flush=True))
    if args.awq_out:
        from mla_jax.quant.pack import quantize_checkpoint

        t0 = time.time()
        qcfg = quantize_checkpoint(args.out, args.awq_out, group_size=args.awq_group_size, force=True)
        size = sum(os.path.getsize(os.path.join(args.awq_out, f)) for f in os.listdir(args.awq_out))
        print(f"AWQ checkpoint {args.awq_out}: {size / 2**20:.2f} MiB ({json.dumps(qcfg)}) in {time.time() - t0:.1f}s")
    print(json.dumps({k: info[k] for k in ("steps", "train_seconds", "final_train_loss", "heldout_loss",
                                           "heldout_ppl", "heldout_bits_per_byte")}))


if __name__ == "__main__":
    main()
