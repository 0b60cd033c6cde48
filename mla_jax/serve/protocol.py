"""OpenAI request schemas (the subset we serve) and their translation into engine requests.

Requests are parsed strictly: a field of the wrong type, a field we do not know, or a value we cannot honour
(n != 1, top alternatives in logprobs, non-zero penalties, echo) is a 400 with an OpenAI-style error body that
names the field; nothing is silently ignored or coerced. Extensions beyond OpenAI's fields, as vLLM names them:
`top_k` and `ignore_eos`.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict

from mla_jax.engine import SamplingParams

SEED_MAX = 2**31 - 1


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI error body with this status."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe_validation_error(e: pydantic.ValidationError) -> RequestError:
    """The first problem of a failed parse as a RequestError naming the field."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    # for a union pydantic appends the member it tried ("prompt.str"); the field is what the client sent
    field = ".".join(p for p in loc if not _is_union_member(p)) or None
    what = f"{field}: " if field else ""
    got = err.get("input")
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RequestError(f"{what}{err['msg']} (got {shown})", param=field)


def _is_union_member(part: str) -> bool:
    """pydantic's name for the member of a union it tried: str, int, list[int], TextPart, function-after[...]."""
    return part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None

    def check_common(self) -> None:
        if self.n != 1:
            raise RequestError(f"n={self.n}: only n=1 is supported; send n requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported (only 0)", name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise RequestError(f"seed must be in [0, 2**31 - 1], got {self.seed}", "seed")
        for s in self.stop_strings():
            if not s:
                raise RequestError("stop strings must not be empty", "stop")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, defaults: SamplingParams, max_tokens: int, logprobs: bool) -> SamplingParams:
        """SamplingParams: fields the request gives, else `defaults` (the model's generation_config)."""
        fields = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        fields = {k: (getattr(defaults, k) if v is None else v) for k, v in fields.items()}
        try:
            return SamplingParams(max_tokens=max_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                                  seed=self.seed, **fields)
        except ValueError as e:       # "SamplingParams: top_p must be in (0, 1] ..."
            message = str(e).removeprefix("SamplingParams: ")
            raise RequestError(message, message.split(" ", 1)[0]) from None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check(self) -> None:
        self.check_common()
        if self.logprobs is not None and self.logprobs != 0:
            raise RequestError(f"logprobs={self.logprobs}: only logprobs=0 is supported (the log-probability of "
                               "each generated token; top alternatives are not computed)", "logprobs")
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise RequestError("best_of is not supported (only 1)", "best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt of the request (a batch of several prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(f"prompt holds {len(p)} prompts; send one prompt per request", "prompt")
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None:
                raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        self.check_common()
        if not self.messages:
            raise RequestError("messages must hold at least one message", "messages")
        if self.top_logprobs not in (None, 0):
            raise RequestError(f"top_logprobs={self.top_logprobs}: top alternatives are not computed; use "
                               "logprobs=true with top_logprobs 0 or absent", "top_logprobs")
