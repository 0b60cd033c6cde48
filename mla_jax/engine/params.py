"""User-facing request types of the engine: SamplingParams (validated at construction) and RequestOutput."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from mla_jax.checkpoint.files import read_generation_config

_INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and meanings).

    temperature: 0.0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p (1.0 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    max_tokens: how many tokens to generate at most (0 = none: the request finishes at once with "length").
    stop_token_ids: extra token ids that end the request (finish_reason "stop"); the stop token is kept in the
        output, as eos is.
    ignore_eos: keep generating past the model's eos token(s) (stop_token_ids still stop).
    logprobs: return, for each generated token, its log-probability under the model's distribution before
        sampling (log_softmax of the raw logits, no temperature / top-k / top-p applied).
    seed: per-request seed; the sampled tokens then depend only on (seed, prompt, params), never on which other
        requests share the batch. None: derived from the LLM's seed and the request's index.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: bool = False
    seed: Optional[int] = None

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"SamplingParams: {msg}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            bad(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad(f"top_k must be -1 or 0 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            bad(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                bad(f"stop_token_ids must be a list of ints or None, got {self.stop_token_ids!r}")
            ids = tuple(self.stop_token_ids)
            for i in ids:
                if not _is_int(i) or i < 0:
                    bad(f"stop_token_ids must hold ints >= 0, got {i!r} in {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            bad(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.logprobs, bool):
            bad(f"logprobs must be a bool (True returns the logprob of each generated token), "
                f"got {self.logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= _INT32_MAX)):
            bad(f"seed must be None or an int in [0, 2**31 - 1], got {self.seed!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, model_dir, **fields) -> "SamplingParams":
        """SamplingParams for a checkpoint: temperature, top_p and top_k default to its generation_config.json
        (read by mla_jax.checkpoint.files.read_generation_config), everything else to this class's defaults;
        `fields` (any SamplingParams field) override both.

        "do_sample": false in the file means greedy (temperature 0; its temperature/top_p/top_k are not read);
        "top_k": 0 (HF's "off") becomes -1. Without the file the class defaults apply (greedy). Raises ValueError
        for an unreadable file or values SamplingParams rejects."""
        gen = read_generation_config(model_dir)
        if gen.get("do_sample") is False:
            defaults = {"temperature": 0.0}
        else:
            defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
            if defaults.get("top_k") == 0:
                defaults["top_k"] = -1
        return cls(**{**defaults, **fields})


@dataclasses.dataclass
class RequestOutput:
    """The result of one request, returned by LLM.generate in prompt order.

    finish_reason: "stop" (eos or a stop token; the token is the last of token_ids), "length" (max_tokens reached,
    or the sequence reached max_model_len), or "error" (the request could not run: `error` holds the ValueError,
    e.g. a prompt longer than max_model_len, and token_ids is empty; the other requests are unaffected).
    logprobs: list of floats (one per generated token) when SamplingParams.logprobs, else None.
    text: the detokenized generated tokens ("" when the model has no tokenizer).
    """

    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]
    error: Optional[Exception] = None
    num_preemptions: int = 0
    metrics: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def raise_for_error(self) -> "RequestOutput":
        """Raises the request's error (a ValueError) if it failed; else returns self."""
        if self.error is not None:
            raise self.error
        return self
