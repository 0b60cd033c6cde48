"""The tokenizer of the embedded model and the token streams it cuts.

Byte-level BPE trained by `tokenizers` on the training files only; special tokens <|bos|>, <|eos|>, <|pad|> at ids
0, 1, 2. Each file becomes <|bos|> text <|eos|>; files are concatenated into one stream, from which training draws
random windows and evaluation cuts non-overlapping ones (`eval_windows`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mla_train.corpus import SourceFile

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

# A code model has no chat format of its own: system/user turns become Python comment lines, assistant turns are
# code followed by <|eos|>, so `--chat` prompts read as "write code for this comment".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user'] %}"
    "{% for line in message['content'].split('\n') %}{{ '# ' + line + '\n' }}{% endfor %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + '\n' }}"
    "{% else %}{{ raise_exception('unsupported role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization regex) with SPECIAL_TOKENS at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE training reached only {tok.get_vocab_size()} tokens of the {vocab_size} asked for; "
                         f"the corpus is too small for this vocabulary")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": None,  # filled by the caller
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def token_stream(tok, files: list[SourceFile]) -> np.ndarray:
    """<|bos|> file <|eos|> for each file, concatenated -> int32 [N]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.extend(([bos], e.ids, [eos]))
    return np.fromiter((i for p in parts for i in p), dtype=np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows [N, seq_len+1] that share one boundary token, so every token of the covered stream
    after the first is predicted exactly once."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"a held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]
