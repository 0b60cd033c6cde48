"""Builds and runs the server: flags, the engine, the engine loop thread, uvicorn.

    python -m mla_jax.serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine flags of scripts/generate.py]

`ServerThread` runs the same server inside a Python process (tests, benchmarks): uvicorn on a thread, started
and stopped with timeouts.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional

import jax
import uvicorn
from fastapi import FastAPI

from mla_jax import cli
from mla_jax.engine import SamplingParams
from mla_jax.engine.llm import LLM
from .app import create_app
from .engine_loop import EngineLoop
from .metrics import Metrics

DEFAULT_MAX_PENDING = 512


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mla_jax.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None,
                    help="the model id clients send and /v1/models lists (default: the model directory's name)")
    ap.add_argument("--max-pending", type=int, default=DEFAULT_MAX_PENDING,
                    help="unfinished requests (running + queued) the server holds; more get HTTP 503")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return ap.parse_args(argv)


def build_app(llm: LLM, *, model_name: str, model_dir: Optional[str] = None,
              max_pending: int = DEFAULT_MAX_PENDING) -> tuple[FastAPI, EngineLoop]:
    """The app and its engine loop (started). Sampling defaults come from model_dir's generation_config.json."""
    defaults = SamplingParams.from_generation_config(model_dir) if model_dir is not None else SamplingParams()
    engine = EngineLoop(llm, Metrics(), max_pending=max_pending).start()
    return create_app(engine, model_name=model_name, default_sampling=defaults), engine


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, **cli.engine_kwargs(args))
        app, engine = build_app(llm, model_name=args.served_model_name or os.path.basename(
            os.path.normpath(args.model)), model_dir=args.model, max_pending=args.max_pending)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"attention backend: {llm.backend} ({llm.backend_reason}); kv cache {llm.kv_cache_dtype}; "
          f"device {jax.devices()[0].device_kind}; model loaded in {time.perf_counter() - t0:.1f} s; "
          f"serving on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on a daemon thread; `with ServerThread(app) as server: server.url ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: Optional[int] = None,
                 start_timeout: float = 30.0, stop_timeout: float = 30.0):
        self.host, self.port = host, port or free_port(host)
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url} within {self.start_timeout} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(self.stop_timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)
            raise RuntimeError(f"uvicorn on {self.url} did not stop within {self.stop_timeout} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
