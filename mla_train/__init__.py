"""Training of the small embedded DeepSeek-V3-architecture model on the Python standard library's own source.

This package sits above the inference package: it imports mla_jax (the model, its config, the engine's steps for
evaluation); mla_jax never imports it. scripts/train_tiny.py and scripts/eval_ppl.py are its command lines.

Everything is deterministic given the seed and the interpreter's standard library:
  corpus.py     the .py files under a root and their split by file into train / validation / test
  tokenizer.py  byte-level BPE with <|bos|> <|eos|> <|pad|>, the token streams and evaluation windows
  config.py     the HF config dict of the tiny model and its parameter count
  trainer.py    forward with expert loads, loss, lr schedule, `Trainer` (AdamW, aux-loss-free routing balance)
  sampler.py    a cache-free text sampler for a quick look during training
  export.py     the HF-format directory (config, bf16 safetensors, tokenizer, generation config, training.json)
  run.py        `run_training(RunOptions)`: the whole run, as scripts/train_tiny.py drives it
  evaluate.py   held-out windows of a trained checkpoint and their NLL through forward, prefill and decode paths
"""

from mla_train.config import count_params, tiny_hf_config
from mla_train.corpus import (SourceFile, file_hash_fraction, is_heldout, load_heldout_files, read_python_files,
                              split_files, stdlib_root)
from mla_train.export import hf_state_dict, save_hf_checkpoint
from mla_train.run import RunOptions, run_training
from mla_train.sampler import TextSampler
from mla_train.tokenizer import (BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, eval_windows, token_stream,
                                 tokenizer_config, train_tokenizer)
from mla_train.trainer import Trainer, TrainHParams, forward_with_loads, lr_at, token_nll

__all__ = [
    "BOS", "CHAT_TEMPLATE", "EOS", "PAD", "SPECIAL_TOKENS", "RunOptions", "SourceFile", "TextSampler", "Trainer",
    "TrainHParams", "count_params", "eval_windows", "file_hash_fraction", "forward_with_loads", "hf_state_dict",
    "is_heldout", "load_heldout_files", "lr_at", "read_python_files", "run_training", "save_hf_checkpoint",
    "split_files", "stdlib_root", "tiny_hf_config", "token_nll", "token_stream", "tokenizer_config",
    "train_tokenizer",
]
