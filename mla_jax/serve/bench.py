"""Load generator for the server: N concurrent streams of completions, with per-request timings.

    results = asyncio.run(run_benchmark("http://127.0.0.1:8000", model="tiny-deepseek-py", num_requests=64,
                                        concurrency=16, prompt_len=64, max_tokens=64))

Each request is a streamed /v1/completions call with a random token-id prompt of `prompt_len` tokens,
`max_tokens` new tokens and ignore_eos (so every request produces exactly max_tokens tokens) and logprobs=0 (so
each chunk says how many tokens it carries). Per request: time to first token (request sent -> first token
chunk) and inter-token latencies (gap between successive token chunks divided by the tokens the later chunk
carries, one value per token). Summary: requests/s and output tokens/s over the wall time from the first
request to the last response, TTFT and ITL p50 / p99.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np


async def _one(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, last, itl, n_tokens = None, None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            k = len(data["choices"][0]["logprobs"]["token_logprobs"])
            if k == 0:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                itl += [(now - last) / k] * k
            last, n_tokens = now, n_tokens + k
    return {"ttft_s": ttft, "itl_s": itl, "tokens": n_tokens, "latency_s": time.perf_counter() - t0}


async def run_benchmark(url: str, *, model: str, num_requests: int, concurrency: int, prompt_len: int,
                        max_tokens: int, vocab_size: int = 4096, seed: int = 0, temperature: float = 0.0,
                        timeout_s: float = 600.0) -> dict:
    rng = np.random.default_rng(seed)
    bodies = [{"model": model, "prompt": [int(t) for t in rng.integers(3, vocab_size, prompt_len)],
               "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, "temperature": temperature,
               "seed": i, "stream": True} for i in range(num_requests)]
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def gated(body):
            async with gate:
                return await _one(client, body)

        t0 = time.perf_counter()
        per_request = await asyncio.wait_for(asyncio.gather(*(gated(b) for b in bodies)), timeout=timeout_s)
        wall = time.perf_counter() - t0
    wrong = [r["tokens"] for r in per_request if r["tokens"] != max_tokens]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests returned a token count other than max_tokens={max_tokens}: "
                           f"{wrong[:8]}")
    ttft = np.array([r["ttft_s"] for r in per_request])
    itl = np.array([x for r in per_request for x in r["itl_s"]] or [np.nan])
    tokens = sum(r["tokens"] for r in per_request)
    return {"num_requests": num_requests, "concurrency": concurrency, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "wall_s": wall, "requests_per_s": num_requests / wall,
            "output_tokens_per_s": tokens / wall,
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
            "itl_p50_ms": float(np.nanpercentile(itl, 50) * 1e3), "itl_p99_ms": float(np.nanpercentile(itl, 99) * 1e3),
            "mean_latency_s": float(np.mean([r["latency_s"] for r in per_request]))}
