"""Store HF transformers greedy-generate goldens next to the model fixtures (tests/fixtures/<name>/).

Runs in the Python 3.11 venv with torch (CPU) + transformers (not part of CI; CI compares against the files):
    /work/venv311/bin/python scripts/make_generate_fixtures.py [--fixtures tests/fixtures] [--only NAME ...]

For each fixture checkpoint (written by scripts/make_fixtures.py) it loads the model as a user would
(AutoModelForCausalLM, float32, eager attention), runs `generate` greedily for a few prompts of different lengths,
one prompt at a time (no padding), with eos disabled, and writes generate_golden.json:
  prompts          list of token-id lists
  max_new_tokens   int
  token_ids        generated ids per prompt
  logprobs         log_softmax(raw logits)[chosen token] per generated token (float64 from HF's fp32 logits)
  top2_margin      per generated token, logit(best) - logit(second best): how robust the greedy choice is
  meta             versions
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT_LENGTHS = (1, 6, 13, 29)
MAX_NEW_TOKENS = 16


def make_one(fixture_dir: str, seed: int) -> dict:
    with open(os.path.join(fixture_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(2, vocab, size=n)] for n in PROMPT_LENGTHS]
    model = AutoModelForCausalLM.from_pretrained(fixture_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None      # generate exactly MAX_NEW_TOKENS tokens (the engine test uses ignore_eos)
    gen_cfg.pad_token_id = 0
    token_ids, logprobs, margins = [], [], []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS,
                                 output_logits=True, return_dict_in_generate=True, generation_config=gen_cfg)
        new = out.sequences[0, len(p):].tolist()
        assert len(new) == MAX_NEW_TOKENS, (fixture_dir, len(new))
        lg = torch.stack(out.logits, 0)[:, 0].double()                      # [T, V]
        lp = torch.log_softmax(lg, dim=-1)
        top2 = torch.topk(lg, 2, dim=-1).values
        token_ids.append(new)
        logprobs.append([float(lp[t, tok]) for t, tok in enumerate(new)])
        margins.append([float(m) for m in (top2[:, 0] - top2[:, 1])])
        assert all(int(lg[t].argmax()) == tok for t, tok in enumerate(new))
    return dict(prompts=prompts, max_new_tokens=MAX_NEW_TOKENS, token_ids=token_ids, logprobs=logprobs,
                top2_margin=margins,
                meta=dict(torch=torch.__version__, transformers=transformers.__version__, dtype="float32",
                          attn_implementation="eager", seed=seed, eos="disabled", batch="one prompt per call"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names; default every directory with a config.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = os.path.abspath(args.fixtures)
    names = args.only or sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "config.json")))
    for n in names:
        golden = make_one(os.path.join(root, n), args.seed)
        with open(os.path.join(root, n, "generate_golden.json"), "w") as f:
            json.dump(golden, f, indent=1)
        m = min(min(x) for x in golden["top2_margin"])
        print(f"{n:18s} prompts {PROMPT_LENGTHS} -> {MAX_NEW_TOKENS} tokens each; smallest top-2 logit margin {m:.2e}")


if __name__ == "__main__":
    main()
