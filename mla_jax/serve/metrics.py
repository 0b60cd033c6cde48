"""Server metrics in the Prometheus text format (version 0.0.4), without a client library.

Counters and histograms are updated by the engine loop thread and by HTTP handlers, gauges are set by the engine
loop after each step; `render()` may run on any thread (one lock guards everything).
"""
from __future__ import annotations

import bisect
import threading

PREFIX = "mla_jax"
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    # name -> help; counters with a label keep one series per label value
    COUNTERS = {
        "requests_received_total": "Requests accepted into the engine queue.",
        "requests_finished_total": "Requests finished, by finish_reason (stop, length, abort = client gone).",
        "requests_rejected_total": "Requests refused before the engine, by reason (invalid = 400, overloaded = 503).",
        "prompt_tokens_total": "Prompt tokens of accepted requests.",
        "generation_tokens_total": "Tokens generated.",
        "engine_steps_total": "Engine steps run.",
    }
    GAUGES = {
        "requests_running": "Requests in the running batch.",
        "requests_waiting": "Requests waiting for a batch slot or KV pages (engine queue and inbox).",
        "kv_pages_in_use": "KV-cache pages held by requests.",
        "kv_pages_usable": "KV-cache pages that requests can hold (all devices).",
    }
    HISTOGRAMS = {
        "step_seconds": ("Wall time of one engine step (schedule, device work, sampled tokens on the host).",
                         STEP_SECONDS_BUCKETS),
        "time_to_first_token_seconds": ("From a request's arrival to its first token.", TTFT_SECONDS_BUCKETS),
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = {name: {} for name in self.COUNTERS}
        self._gauges: dict[str, float] = {name: 0 for name in self.GAUGES}
        self._histograms = {name: _Histogram(buckets) for name, (_, buckets) in self.HISTOGRAMS.items()}

    def inc(self, name: str, value: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0) + value

    def set(self, name: str, value: float) -> None:
        if name not in self._gauges:
            raise KeyError(f"unknown gauge {name!r}")
        with self._lock:
            self._gauges[name] = value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)

    def get(self, name: str, **labels) -> float:
        """A counter's or gauge's current value (0 for a series not seen yet)."""
        with self._lock:
            if name in self._gauges:
                return self._gauges[name]
            return self._counters[name].get(tuple(sorted(labels.items())), 0)

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, help_text in self.COUNTERS.items():
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
                series = self._counters[name] or {(): 0}
                for key, value in sorted(series.items()):
                    lines.append(f"{full}{_labels(key)} {_number(value)}")
            for name, help_text in self.GAUGES.items():
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge",
                          f"{full} {_number(self._gauges[name])}"]
            for name, (help_text, _) in self.HISTOGRAMS.items():
                full, h = f"{PREFIX}_{name}", self._histograms[name]
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
                cumulative = 0
                for bound, count in zip((*h.buckets, float("inf")), h.counts):
                    cumulative += count
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f'{full}_bucket{{le="{le}"}} {cumulative}')
                lines += [f"{full}_sum {_number(h.sum)}", f"{full}_count {h.count}"]
        return "\n".join(lines) + "\n"


def _labels(key: tuple) -> str:
    if not key:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in key) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
