"""The HTTP front: an OpenAI-compatible FastAPI app over an EngineLoop.

    POST /v1/completions         prompt (str or token ids) -> text; stream=true sends server-sent events
    POST /v1/chat/completions    messages, rendered by the tokenizer's chat template
    GET  /v1/models              the one served model
    GET  /health                 200 while the engine loop runs, else 503
    GET  /metrics                Prometheus text (mla_jax.serve.metrics)

Handlers never touch the LLM's state: they tokenize and validate (LLM.validate_prompt reads fixed settings only),
hand a Submission to the engine loop and read its Deltas from an asyncio queue that the engine thread fills with
loop.call_soon_threadsafe. A client that disconnects (noticed while waiting for tokens) cancels its request,
which frees its KV-cache pages before the next engine step. Every error is an OpenAI error body:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Optional

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mla_jax.engine import SamplingParams
from .engine_loop import Delta, EngineLoop, Failed, Overloaded, Submission
from .protocol import (ChatCompletionRequest, CompletionRequest, RequestError, describe_validation_error,
                       error_body)

DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
_DISCONNECTED = object()


class _ClientGone(Exception):
    pass


def create_app(engine: EngineLoop, *, model_name: str, default_sampling: Optional[SamplingParams] = None) -> FastAPI:
    """default_sampling: temperature / top_p / top_k for requests that do not give them (the model's
    generation_config, as SamplingParams.from_generation_config reads it); None: SamplingParams' defaults."""
    llm = engine.llm            # fixed settings only (tokenizer, max_model_len, validate_prompt): see module doc
    tokenizer = llm.tokenizer
    metrics = engine.metrics
    defaults = default_sampling if default_sampling is not None else SamplingParams()
    created = int(time.time())
    app = FastAPI(title="mla_jax OpenAI-compatible server")

    def error_response(e: RequestError) -> JSONResponse:
        if e.status == 400:
            metrics.inc("requests_rejected_total", reason="invalid")
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if engine.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mla_jax", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def parse(request: Request, schema):
        try:
            raw = await request.body()
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = schema.model_validate(data)
        except pydantic.ValidationError as e:
            raise describe_validation_error(e) from None
        body.check()
        if body.model is not None and body.model != model_name:
            raise RequestError(f"model {body.model!r} is not served here; this server serves {model_name!r} "
                               "(GET /v1/models)", "model", code="model_not_found")
        return body

    def prompt_ids(prompt, param: str) -> list[int]:
        try:
            return llm.validate_prompt(prompt)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param) from None

    def check_context(n_prompt: int, max_tokens: int, param: str) -> None:
        if n_prompt + max_tokens > llm.max_model_len:
            raise RequestError(f"this model's maximum context length is {llm.max_model_len} tokens, but the prompt "
                               f"has {n_prompt} tokens and max_tokens is {max_tokens}; lower max_tokens or shorten "
                               "the prompt", param)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await parse(request, CompletionRequest)
            ids = prompt_ids(body.single_prompt(), "prompt")
            max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
            check_context(len(ids), max_tokens, "max_tokens")
            params = body.sampling_params(defaults, max_tokens, logprobs=body.logprobs is not None)
        except RequestError as e:
            return error_response(e)
        return await _serve(request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await parse(request, ChatCompletionRequest)
            if tokenizer is None:
                raise RequestError("this model has no tokenizer, so chat messages cannot be rendered; use "
                                   "/v1/completions with token ids", "messages")
            try:
                text = tokenizer.apply_chat_template([m.as_template_message() for m in body.messages])
            except ValueError as e:                      # ChatTemplateError included
                raise RequestError(f"messages: {e}", "messages") from None
            ids = prompt_ids(tokenizer.encode(text, add_special_tokens=False), "messages")
            max_tokens = body.max_tokens if body.max_tokens is not None else llm.max_model_len - len(ids)
            check_context(len(ids), max_tokens, "max_tokens")
            params = body.sampling_params(defaults, max_tokens, logprobs=body.logprobs)
        except RequestError as e:
            return error_response(e)
        return await _serve(request, body, ids, params, chat=True)

    async def _serve(request: Request, body, ids: list[int], params: SamplingParams, chat: bool):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def deliver(item):                       # engine thread
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:                 # the event loop is closed: the server is gone
                pass

        sub = Submission(ids, params, deliver, stop=body.stop_strings())
        try:
            engine.submit(sub)
        except Overloaded as e:
            return JSONResponse(error_body(str(e), "server_overloaded", code="overloaded"), status_code=503,
                                headers={"Retry-After": "1"})
        completion = _Completion(chat, model_name, created=int(time.time()), prompt_tokens=len(ids),
                                 logprobs=params.logprobs, token_text=_token_text(tokenizer))
        deltas = _deltas(request, engine, sub, inbox)
        if body.stream:
            return StreamingResponse(_sse_stream(completion, deltas, body.include_usage), media_type="text/event-stream")
        try:
            async for delta in deltas:
                completion.add(delta)
        except _ClientGone:
            return JSONResponse(error_body("client disconnected", "client_disconnected"), status_code=499)
        except ValueError as e:
            return error_response(RequestError(str(e)))
        except Exception as e:
            return JSONResponse(error_body(f"{type(e).__name__}: {e}", "internal_error"), status_code=500)
        return completion.response()

    return app


async def _deltas(request: Request, engine: EngineLoop, sub: Submission, inbox: asyncio.Queue
                  ) -> AsyncIterator[Delta]:
    """The submission's Deltas until its finish_reason. Raises _ClientGone when the client disconnects and the
    request's Failed error; in both cases, and whenever the consumer stops early (a streaming client gone), the
    request is cancelled in the engine."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, engine, sub, inbox))
    finished = False
    try:
        while True:
            item = await inbox.get()
            if item is _DISCONNECTED:
                raise _ClientGone()
            if isinstance(item, Failed):
                finished = True
                raise item.error
            if item.finish_reason is not None:
                finished = True
            yield item
            if finished:
                return
    finally:
        watcher.cancel()
        if not finished:
            engine.cancel(sub)


async def _watch_disconnect(request: Request, engine: EngineLoop, sub: Submission, inbox: asyncio.Queue) -> None:
    """Cancels the request as soon as its client disconnects, whether or not a token is being waited for."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.cancel(sub)          # a no-op if it finished meanwhile
            inbox.put_nowait(_DISCONNECTED)
            return


def _token_text(tokenizer):
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


class _Completion:
    """Accumulates Deltas into an OpenAI completion / chat completion, or renders them as stream chunks."""

    def __init__(self, chat: bool, model: str, *, created: int, prompt_tokens: int, logprobs: bool, token_text):
        self.chat, self.model, self.created = chat, model, created
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.token_text = token_text
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.finish_reason: Optional[str] = None

    def add(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids += delta.token_ids
        self.token_logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def usage(self) -> dict:
        n = len(self.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> Optional[dict]:
        if not self.logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                                for s, lp in zip(tokens, logprobs)]}
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": None}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self) -> dict:
        text = "".join(self.text_parts)
        choice = {"index": 0, "logprobs": self._logprobs(self.token_ids, self.token_logprobs),
                  "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(chunk=False), "choices": [choice], "usage": self.usage()}

    def chunk(self, delta: Optional[Delta], first: bool = False) -> dict:
        if delta is None:
            delta = Delta()
        choice = {"index": 0, "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                  "finish_reason": delta.finish_reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if first else {"content": delta.text})
        else:
            choice["text"] = delta.text
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse_stream(completion: _Completion, deltas: AsyncIterator[Delta], include_usage: bool):
    try:
        if completion.chat:
            yield _sse(completion.chunk(None, first=True))
        async for delta in deltas:
            completion.add(delta)
            if delta.text or delta.token_ids or delta.finish_reason is not None:
                yield _sse(completion.chunk(delta))
    except _ClientGone:
        return
    except Exception as e:     # the response has started: the error goes into the stream
        kind = "invalid_request_error" if isinstance(e, ValueError) else "internal_error"
        yield _sse(error_body(f"{type(e).__name__}: {e}", kind))
    finally:
        await deltas.aclose()       # cancels the request if it is unfinished (the client stopped reading)
    if include_usage:
        yield _sse(completion.usage_chunk())
    yield "data: [DONE]\n\n"
