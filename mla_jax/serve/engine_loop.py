"""The engine loop: one thread owns the LLM and runs its steps; HTTP handlers talk to it through a queue.

    loop = EngineLoop(llm, metrics, max_pending=256)
    loop.start()
    loop.submit(Submission(prompt_ids, params, stop=("\n\n",), deliver=callback))   # any thread; may raise Overloaded
    loop.cancel(submission)                                                          # any thread
    loop.close()

Between two steps the thread takes every new submission and cancellation from its inbox: a new request joins
the running batch at the next step (continuous batching across HTTP requests) and a cancelled one is aborted
at once, which frees its KV-cache pages. After each step every submission that got tokens receives one Delta
(through its `deliver` callback, called on the engine thread: it must be thread-safe and quick, e.g.
`loop.call_soon_threadsafe(queue.put_nowait, item)`); its last Delta has a finish_reason. A submission that
cannot run gets a Failed instead (ValueError: the request is at fault).

Stop strings are applied here, on the detokenized text: the text is cut before the first match, the request is
aborted in the engine (its pages freed) and finishes with "stop"; text that could be the start of a stop string
is held back until it is known not to be.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence, Union

from mla_jax.engine import SamplingParams
from mla_jax.engine.llm import LLM
from .metrics import Metrics

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The server holds max_pending unfinished requests; retry later (HTTP 503)."""


@dataclasses.dataclass
class Delta:
    """What one engine step produced for one request."""

    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None        # "stop" | "length" | "abort" on the last Delta


@dataclasses.dataclass
class Failed:
    error: BaseException


class StopStrings:
    """Cuts a growing text at the first occurrence of any stop string (the stop string itself is dropped)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0          # text[:sent] was released and holds no stop string nor the start of one

    def push(self, delta: str) -> tuple[str, bool]:
        """(text now safe to release, whether a stop string matched)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent:cut], cut
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        safe = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Submission:
    """One HTTP request's life in the engine. The engine thread sets request_id and done."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, deliver: Callable[[Union[Delta, Failed]], None],
                 stop: Sequence[str] = ()):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.deliver = deliver
        self.stop_strings = StopStrings(stop)
        self.arrival = time.perf_counter()
        self.request_id: Optional[int] = None
        self.num_tokens = 0
        self.done = False


class EngineLoop:
    """max_pending: unfinished requests (running, waiting in the engine or in the inbox) the server accepts;
    submit() raises Overloaded past it, so memory stays bounded however many clients call."""

    def __init__(self, llm: LLM, metrics: Optional[Metrics] = None, *, max_pending: int):
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.llm = llm
        self.metrics = metrics if metrics is not None else Metrics()
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0                         # guarded by _lock
        self._accepting = True                    # guarded by _lock
        self._by_id: dict[int, Submission] = {}   # engine thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mla_jax-engine-loop", daemon=True)
        self.metrics.set("kv_pages_usable", llm.stats()["kv_pages_usable"])

    # ---- any thread ------------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, sub: Submission) -> None:
        with self._lock:
            if not self._accepting:
                raise Overloaded("the server is shutting down")
            if self._pending >= self.max_pending:
                self.metrics.inc("requests_rejected_total", reason="overloaded")
                raise Overloaded(f"the server already holds {self._pending} unfinished requests (--max-pending "
                                 f"{self.max_pending}); retry later")
            self._pending += 1
        self._inbox.put(("add", sub))

    def cancel(self, sub: Submission) -> None:
        """Aborts the submission (no-op once it finished); its pages are freed before the next step."""
        self._inbox.put(("cancel", sub))

    def close(self, timeout: float = 30.0) -> None:
        """Stops the thread after its current step; unfinished submissions get Failed and their pages are freed."""
        with self._lock:
            self._accepting = False
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine loop did not stop within {timeout} s")

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.llm.has_unfinished())
                if self.llm.has_unfinished():
                    self._step()
                self._publish_gauges()
        finally:
            self._drain_inbox(block=False)
            for sub in list(self._by_id.values()):
                self.llm.abort_request(sub.request_id)
                self._fail(sub, RuntimeError("the server shut down before this request finished"))
            self._publish_gauges()

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                kind, sub = command
                if kind == "add":
                    self._add(sub)
                else:
                    self._cancel(sub)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _add(self, sub: Submission) -> None:
        if self._stopping.is_set():
            self._release(sub)
            sub.deliver(Failed(RuntimeError("the server is shutting down")))
            return
        try:
            sub.request_id = self.llm.add_request(sub.prompt_ids, sub.params)
        except (ValueError, TypeError) as e:
            self._release(sub)
            sub.deliver(Failed(e))
            return
        self._by_id[sub.request_id] = sub
        self.metrics.inc("requests_received_total")
        self.metrics.inc("prompt_tokens_total", len(sub.prompt_ids))

    def _cancel(self, sub: Submission) -> None:
        if sub.done or sub.request_id is None:
            return
        self.llm.abort_request(sub.request_id)      # frees its pages now
        self._finish(sub, "abort")
        sub.deliver(Delta(finish_reason="abort"))

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.llm.step()
        except Exception as e:    # an engine bug must not take the server down: fail the requests it was running
            logger.exception("engine step failed; failing its %d requests", len(self._by_id))
            for sub in list(self._by_id.values()):
                self.llm.abort_request(sub.request_id)
                self._fail(sub, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        self.metrics.observe("step_seconds", now - t0)
        self.metrics.inc("engine_steps_total")
        deltas: dict[Submission, Delta] = {}
        for ev in events:
            sub = self._by_id.get(ev.request_id)
            if sub is None:          # e.g. tokens after its stop string in the same step
                continue
            delta = deltas.setdefault(sub, Delta())
            if ev.token_id is not None:
                if sub.num_tokens == 0:
                    self.metrics.observe("time_to_first_token_seconds", now - sub.arrival)
                sub.num_tokens += 1
                delta.token_ids.append(ev.token_id)
                delta.logprobs.append(ev.logprob)
                self.metrics.inc("generation_tokens_total")
            text, stopped = sub.stop_strings.push(ev.text)
            delta.text += text
            if stopped:
                if ev.finish_reason is None:
                    self.llm.abort_request(ev.request_id)     # frees its pages now
                delta.finish_reason = "stop"
            elif ev.finish_reason is not None:
                delta.text += sub.stop_strings.flush()
                delta.finish_reason = ev.finish_reason
            if delta.finish_reason is not None:
                self._finish(sub, delta.finish_reason)
        for sub, delta in deltas.items():
            sub.deliver(delta)

    def _finish(self, sub: Submission, reason: str) -> None:
        sub.done = True
        del self._by_id[sub.request_id]
        self._release(sub)
        self.metrics.inc("requests_finished_total", finish_reason=reason)

    def _fail(self, sub: Submission, error: BaseException) -> None:
        sub.done = True
        self._by_id.pop(sub.request_id, None)
        self._release(sub)
        self.metrics.inc("requests_finished_total", finish_reason="error")
        sub.deliver(Failed(error))

    def _release(self, sub: Submission) -> None:
        with self._lock:
            self._pending -= 1

    def _publish_gauges(self) -> None:
        stats = self.llm.stats()
        self.metrics.set("requests_running", stats["running"])
        self.metrics.set("requests_waiting", self.num_pending - stats["running"])
        self.metrics.set("kv_pages_in_use", stats["kv_pages_in_use"])
