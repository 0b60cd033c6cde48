"""Text handling for the engine: tokenizer.json through `tokenizers`, chat templates through jinja2, and
incremental detokenization for streaming.

A model directory in HF layout may hold:
  tokenizer.json          the fast tokenizer (required for text; without it `Tokenizer.from_dir` returns None)
  tokenizer_config.json   bos_token / eos_token / pad_token / unk_token, add_bos_token / add_eos_token,
                          chat_template (a string, or a list of {"name", "template"} as some HF repos ship)
  generation_config.json  eos_token_id (int or list): extra stop tokens, as HF `generate` uses them
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from mla_jax.checkpoint.errors import CheckpointError, read_json
from mla_jax.checkpoint.files import read_generation_config

__all__ = ["Tokenizer", "IncrementalDetokenizer", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """A chat template failed to render (raised by the template's own raise_exception, or a jinja error)."""


def _token_content(value: Any, field: str, path: str) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {field} must be a string or an object with a 'content' string, got {value!r}")


def _select_chat_template(value: Any, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {}
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ValueError(f"{path}: chat_template list entries must be {{'name': str, 'template': str}}, "
                                 f"got {item!r}")
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise ValueError(f"{path}: chat_template list has no 'default' entry (names: {sorted(named)})")
        return named["default"]
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates, got "
                     f"{type(value).__name__}")


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Same keyword surface as HF's template filter; jinja's builtin tojson HTML-escapes, which templates don't want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _make_jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """A fast tokenizer plus the special-token and chat-template settings of its tokenizer_config.json."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False, chat_template: str | None = None,
                 extra_eos_token_ids: Iterable[int] = ()):
        self._tok = tokenizer
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.pad_token_id = self._special_id(pad_token, "pad_token")
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        if self.add_bos_token and self.bos_token_id is None:
            raise ValueError("add_bos_token is true but no bos_token is set; set bos_token in tokenizer_config.json")
        if self.add_eos_token and self.eos_token_id is None:
            raise ValueError("add_eos_token is true but no eos_token is set; set eos_token in tokenizer_config.json")
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        vocab_size = self.vocab_size
        for i in extra_eos_token_ids:
            if not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ValueError(f"eos token id {i!r} is not a valid id for a vocabulary of {vocab_size}")
            if i not in eos:
                eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

    def _special_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer's vocabulary; add it to tokenizer.json "
                             f"or fix tokenizer_config.json")
        return token_id

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer of an HF model directory, or None when it has no tokenizer.json."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a directory")
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            return None
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # tokenizers raises a plain Exception on malformed files
            raise CheckpointError(tok_path, f"cannot be read by the `tokenizers` library ({e})",
                                  "download tokenizer.json again (or remove it to pass prompts as token ids)") from e
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = read_json(cfg_path, "tokenizer_config.json") if os.path.isfile(cfg_path) else {}
        gen_eos = read_generation_config(path).get("eos_token_id")
        extra_eos: list[int] = []
        if isinstance(gen_eos, int):
            extra_eos = [gen_eos]
        elif isinstance(gen_eos, list) and all(isinstance(i, int) for i in gen_eos):
            extra_eos = list(gen_eos)
        elif gen_eos is not None:
            gen_path = os.path.join(path, "generation_config.json")
            raise ValueError(f"{gen_path}: eos_token_id must be an int or a list of ints, got {gen_eos!r}")
        return cls(
            tok,
            bos_token=_token_content(cfg.get("bos_token"), "bos_token", cfg_path),
            eos_token=_token_content(cfg.get("eos_token"), "eos_token", cfg_path),
            pad_token=_token_content(cfg.get("pad_token"), "pad_token", cfg_path),
            unk_token=_token_content(cfg.get("unk_token"), "unk_token", cfg_path),
            add_bos_token=cfg.get("add_bos_token", False),
            add_eos_token=cfg.get("add_eos_token", False),
            chat_template=_select_chat_template(cfg.get("chat_template"), cfg_path),
            extra_eos_token_ids=extra_eos,
        )

    # -- encode / decode ---------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, the tokenizer's post-processor runs and bos/eos are added
        as tokenizer_config's add_bos_token/add_eos_token say (never doubled: text that already starts with the
        bos token, e.g. a rendered chat template, keeps a single one)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        vocab_size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **template_kwargs: Any) -> str:
        """Render a conversation with the tokenizer's jinja chat template (HF semantics: sandboxed, trim_blocks,
        lstrip_blocks, loopcontrols; raise_exception, strftime_now and tojson available; bos_token, eos_token,
        pad_token, unk_token, messages and add_generation_prompt as variables). Encode the result with
        add_special_tokens=False: templates write their own special tokens."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of dicts like {'role': 'user', 'content': 'hi'}")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ValueError(f"message {i} has no 'role': {m!r}")
        if chat_template is not None:
            template = _make_jinja_env().from_string(chat_template)
        else:
            if self.chat_template is None:
                raise ValueError("this tokenizer has no chat_template (tokenizer_config.json); pass chat_template= "
                                 "or send plain prompts instead of chat messages")
            if self._compiled_template is None:
                self._compiled_template = _make_jinja_env().from_string(self.chat_template)
            template = self._compiled_template
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         pad_token=self.pad_token or "", unk_token=self.unk_token or "")
        variables.update(template_kwargs)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for streaming output.

    `push(id)` returns only text that is complete: a multi-byte UTF-8 character split over several byte-level
    tokens is held back until its last byte arrives (never a U+FFFD for an incomplete sequence). `flush()`
    returns whatever is still held (at the end of a stream; an incomplete sequence then decodes to U+FFFD, as
    `decode` does). The concatenation of every push plus flush equals tokenizer.decode(all ids).

    Works on a window: text is decoded from `prefix_offset` (a point where earlier text was complete) so each push
    costs O(window), not O(stream).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0    # ids before this have been emitted as text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        emitted = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) < len(emitted):
            return ""  # an incomplete UTF-8 sequence at the end: wait for its remaining bytes
        if not full.startswith(emitted):
            # Decoders such as Metaspace/cleanup can rewrite the boundary; fall back to the whole-stream diff.
            return self._resync()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(emitted):]

    def _resync(self) -> str:
        before = self._decode(self.token_ids[:self._read_offset])
        after = self._decode(self.token_ids)
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""
        # The new window starts at the old read point, so the next decode keeps the last chunk as context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still held back (an incomplete trailing sequence decodes to U+FFFD here, as in decode)."""
        emitted = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if not full.startswith(emitted):  # boundary rewritten by the decoder: diff the whole stream
            emitted = self._decode(self.token_ids[:self._read_offset])
            full = self._decode(self.token_ids)
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(emitted):]

    @property
    def text(self) -> str:
        """Everything decoded so far, including held-back bytes (for final outputs)."""
        return self._decode(self.token_ids)
