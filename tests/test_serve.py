"""mla_jax.serve: the OpenAI-compatible server on the embedded model (CPU, 127.0.0.1, a free port).

The engine-level tests of LLM's incremental API run first, on the module's LLM, before the server's engine loop
thread takes that LLM over (the server tests share it, so nothing compiles twice). Every client call has a
timeout; the server fixture stops uvicorn and the engine loop with timeouts.
"""
import asyncio
import json
import os
import random
import time

import httpx
import numpy as np
import openai
import pytest

import mla_jax
import mla_jax.cli
from mla_jax.serve.engine_loop import Delta, Failed, StopStrings, Submission
from mla_jax.serve import launch
from mla_jax.serve.launch import ServerThread, build_app
from mla_jax.serve.metrics import Metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "checkpoints", "tiny-deepseek-py")
NAME = "tiny-deepseek-py"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
TIMEOUT = httpx.Timeout(120.0)       # first requests compile step variants (seconds each on a 2-core CPU)

pytestmark = pytest.mark.skipif(not os.path.isdir(MODEL), reason="embedded model not in this checkout")

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef", "class Stack:\n    def push(self", "for i in range(10):\n"]
GREEDY = mla_jax.SamplingParams(temperature=0.0, max_tokens=10, logprobs=True)


@pytest.fixture(scope="module")
def llm():
    return mla_jax.LLM(MODEL, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def references(llm):
    """LLM.generate, one prompt at a time (a batch of one, as the sequential HTTP requests below run)."""
    tok = llm.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "sort a list"}]),
                          add_special_tokens=False)
    prompts = PROMPTS + [[0, 17, 42, 99, 5]]
    return {"prompts": prompts, "outputs": [llm.generate([p], GREEDY)[0] for p in prompts],
            "chat": llm.generate([chat_ids], GREEDY)[0]}


@pytest.fixture(scope="module")
def server(llm, references):
    app, engine = build_app(llm, model_name=NAME, model_dir=MODEL)
    try:
        with ServerThread(app) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.close()
    assert llm.stats()["kv_pages_in_use"] == 0          # every page came back


def metric(srv, name: str, **labels) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    want = f"mla_jax_{name}" + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.split(" ")[0] == want:
            return float(line.split(" ")[1])
    return 0.0


def wait_idle(srv, timeout=30.0):
    """Waits until no request runs or waits and no KV page is held; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(srv, "requests_running") == 0 and metric(srv, "requests_waiting") == 0
                and metric(srv, "kv_pages_in_use") == 0):
            return
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout} s: {httpx.get(srv.url + '/metrics', timeout=10).text}")


# ---------------------------------------------------------------- pieces without a server
def test_stop_strings_match_a_plain_search():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[:min(hits)] if hits else text
        checker, out, stopped, i = StopStrings(stops), "", False, 0
        while i < len(text) and not stopped:
            piece = text[i:i + rng.randint(1, 3)]
            i += len(piece)
            released, stopped = checker.push(piece)
            out += released
            assert not any(s in out for s in stops)     # released text never holds a stop string
        if not stopped:
            out += checker.flush()
        assert out == expected and stopped == bool(hits), (text, stops)


def test_command_line_takes_the_engine_flags_and_exits_2_on_an_impossible_engine(capsys):
    args = launch.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--tensor-parallel-size", "2", "--max-num-seqs", "4",
                              "--max-model-len", "128", "--data-parallel-attention", "--port", "9"])
    assert (args.model, args.port, args.host) == ("tiny-deepseek-py", 9, "127.0.0.1")   # the embedded model by name
    assert mla_jax.cli.engine_kwargs(args) == dict(
        dtype="bfloat16", kv_cache_dtype="fp8_e4m3", attention_backend="auto", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=2048, tensor_parallel_size=2, interpret=False, seed=0, data_parallel_attention=True,
        expert_dispatch="all_gather")
    assert launch.main(["--attention-backend", "mosaic_sm90"]) == 2
    assert "mosaic_sm90' cannot run" in capsys.readouterr().err


def test_metrics_text_format():
    m = Metrics()
    m.inc("requests_finished_total", finish_reason="stop")
    m.inc("requests_finished_total", 2, finish_reason="length")
    m.set("kv_pages_in_use", 7)
    for v in (0.003, 0.02, 20.0):
        m.observe("step_seconds", v)
    lines = m.render().splitlines()
    assert 'mla_jax_requests_finished_total{finish_reason="length"} 2' in lines
    assert 'mla_jax_requests_finished_total{finish_reason="stop"} 1' in lines
    assert "mla_jax_kv_pages_in_use 7" in lines
    assert 'mla_jax_step_seconds_bucket{le="0.005"} 1' in lines
    assert 'mla_jax_step_seconds_bucket{le="0.025"} 2' in lines
    assert 'mla_jax_step_seconds_bucket{le="+Inf"} 3' in lines
    assert "mla_jax_step_seconds_count 3" in lines
    step_sum = next(x for x in lines if x.startswith("mla_jax_step_seconds_sum"))
    assert float(step_sum.split()[1]) == pytest.approx(20.023)
    for line in lines:      # every sample line is `name{labels} number`
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_incremental_api_matches_generate_and_frees_pages(llm, references):
    usable = llm.stats()["kv_pages_usable"]
    prompt, ref = references["prompts"][0], references["outputs"][0]
    rid = llm.add_request(prompt, GREEDY)
    tokens, logprobs, text, reasons = [], [], "", []
    while llm.has_unfinished():
        for ev in llm.step():
            assert ev.request_id == rid
            tokens.append(ev.token_id)
            logprobs.append(ev.logprob)
            text += ev.text
            reasons.append(ev.finish_reason)
    assert tokens == ref.token_ids and text == ref.text
    np.testing.assert_allclose(logprobs, ref.logprobs, rtol=1e-6)
    assert reasons == [None] * (len(tokens) - 1) + [ref.finish_reason]
    # an abort in the middle frees the pages at once, and nothing more is reported for it
    keep = llm.add_request(PROMPTS[1], mla_jax.SamplingParams(max_tokens=5, ignore_eos=True))
    drop = llm.add_request(PROMPTS[2] * 20, mla_jax.SamplingParams(max_tokens=100, ignore_eos=True))
    zero = llm.add_request(PROMPTS[3], mla_jax.SamplingParams(max_tokens=0))
    first = llm.step()
    assert [(e.token_id, e.finish_reason) for e in first if e.request_id == zero] == [(None, "length")]
    held_by_drop = llm.allocator.pages_for(len(llm.validate_prompt(PROMPTS[2] * 20)))
    assert llm.stats()["kv_pages_in_use"] >= held_by_drop
    assert llm.abort_request(drop) and not llm.abort_request(drop) and not llm.abort_request(12345)
    assert llm.stats()["kv_pages_in_use"] <= llm.allocator.pages_for(len(llm.validate_prompt(PROMPTS[1])) + 5)
    counts = {keep: sum(e.request_id == keep for e in first)}
    while llm.has_unfinished():
        for ev in llm.step():
            counts[ev.request_id] = counts.get(ev.request_id, 0) + 1
    assert counts == {keep: 5}
    assert llm.stats() == {"running": 0, "waiting": 0, "kv_pages_in_use": 0, "kv_pages_usable": usable}
    # bad prompts raise and queue nothing; generate() refuses to share the engine with live requests
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.add_request([5] * (MAX_MODEL_LEN + 1))
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request("x", {"max_tokens": 3})
    assert not llm.has_unfinished()
    rid = llm.add_request("x", mla_jax.SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="add_request"):
        llm.generate(["y"])
    assert llm.abort_request(rid) and llm.stats()["kv_pages_in_use"] == 0


# ---------------------------------------------------------------- over HTTP
def test_openai_client_completion_chat_and_streamed_chat(server, references):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.completions.create(model=NAME, prompt="def add(a, b):\n", max_tokens=6, temperature=0.7, seed=3,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens > 0 and out.choices[0].text
    messages = [{"role": "user", "content": "sort a list"}]
    ref = references["chat"]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == ref.text
    assert chat.usage.completion_tokens == len(ref.token_ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    lps = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    np.testing.assert_allclose(lps, ref.logprobs, rtol=1e-6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and not chunks[-1].choices


def test_greedy_over_http_equals_llm_generate(server, references):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for prompt, ref in zip(references["prompts"], references["outputs"]):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 0}
            got = http.post("/v1/completions", json=body).json()
            choice = got["choices"][0]
            assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
            n_prompt, n_out = len(ref.prompt_token_ids), len(ref.token_ids)
            assert got["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                    "total_tokens": n_prompt + n_out}
            np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], ref.logprobs, rtol=1e-6)
            # streamed: the same text, one logprob per token
            text, lps = "", []
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                lines = [ln for ln in r.iter_lines() if ln]
            assert lines[-1] == "data: [DONE]"
            for ln in lines[:-1]:
                c = json.loads(ln.removeprefix("data: "))["choices"][0]
                text += c["text"]
                lps += c["logprobs"]["token_logprobs"]
            assert text == ref.text
            np.testing.assert_allclose(lps, ref.logprobs, rtol=1e-6)
            # a stop string cuts the text before it and finishes with "stop"
            if len(ref.text) > 4:
                stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 2]
                got = http.post("/v1/completions", json={**body, "stop": [stop, "@@@"]}).json()["choices"][0]
                assert got["text"] == ref.text[:ref.text.index(stop)] and got["finish_reason"] == "stop"


BAD_INPUTS = [
    ("/v1/completions", '{"prompt": "x", ', "not valid JSON", None),
    ("/v1/completions", '["x"]', "JSON object", None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "not served here", "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "at least 1", "max_tokens"),
    ("/v1/completions", {"prompt": "def f():\n    pass\n" * 80}, "longer than max_model_len", "prompt"),
    ("/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 1)}, "longer than max_model_len", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "maximum context length", "max_tokens"),
    ("/v1/completions", {"prompt": [1, 99999]}, "vocab_size", "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "empty", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "valid integer", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "valid number", "temperature"),
    ("/v1/completions", {"prompt": 5}, "valid", "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "valid boolean", "stream"),
    ("/v1/completions", {"prompt": "x", "top_p": 2.0}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n=1", "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs=0", "logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of_everything": 1}, "Extra inputs", "best_of_everything"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "valid list", "messages"),
    ("/v1/chat/completions", {"messages": []}, "at least one", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "unsupported role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs"),
]


def test_bad_inputs_get_400_with_an_openai_error_body(server):
    rejected = metric(server, "requests_rejected_total", reason="invalid")
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for path, body, words, param in BAD_INPUTS:
            content = body if isinstance(body, str) else json.dumps(body)
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["type"] == "invalid_request_error", (body, err)
            assert err["param"] == param, (body, err)
        assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
        # the server keeps serving
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
        assert 1 <= ok["usage"]["completion_tokens"] <= 2 and http.get("/health").json() == {"status": "ok"}
    assert metric(server, "requests_rejected_total", reason="invalid") == rejected + len(BAD_INPUTS)


def test_continuous_batching_and_disconnects_free_pages(server):
    aborted = metric(server, "requests_finished_total", finish_reason="abort")
    long_body = {"prompt": "import sys\n", "max_tokens": 150, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json=long_body) as r:
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
            # a request that arrives while the long one runs joins its batch and finishes first
            short = http.post("/v1/completions", json={"prompt": "x = 1\n", "max_tokens": 4, "ignore_eos": True})
            assert short.json()["usage"]["completion_tokens"] == 4
            assert metric(server, "requests_running") == 1      # the long one is still going
            # leaving the block closes the connection mid-stream
        # a non-streamed request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**long_body, "stream": False}, timeout=httpx.Timeout(30, read=1.0))
    wait_idle(server, timeout=20)
    assert metric(server, "requests_finished_total", finish_reason="abort") == aborted + 2


def test_load_200_requests_32_connections(server):
    """Mixed prompt and output lengths, streamed and not, some cancelled midway; /health answers throughout;
    every other request gets exactly max_tokens tokens; every page is free at the end."""
    rng = np.random.default_rng(7)
    specs = []
    for i in range(200):
        kind = rng.choice(["plain", "stream", "cancel"], p=[0.45, 0.4, 0.15])
        prompt = [int(t) for t in rng.integers(3, 4096, size=int(rng.integers(1, 30)))]
        max_tokens = 100 if kind == "cancel" else int(rng.integers(1, 12))
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0,
                "temperature": float(rng.choice([0.0, 0.8])), "seed": i, "stream": kind != "plain"}
        if kind == "stream":
            body["stream_options"] = {"include_usage": True}
        specs.append((kind, body))
    before = {r: metric(server, "requests_finished_total", finish_reason=r) for r in ("length", "abort")}
    steps_before, compiles_before = metric(server, "engine_steps_total"), server.engine.llm.num_compiles()

    async def one(client, kind, body):
        if kind == "plain":
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            return got["usage"]["completion_tokens"], len(got["choices"][0]["logprobs"]["token_logprobs"])
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n_tokens, usage, chunks = 0, None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data["choices"]:
                    n_tokens += len(data["choices"][0]["logprobs"]["token_logprobs"])
                    chunks += 1
                    if kind == "cancel" and chunks == 2:
                        return None                     # leaves mid-stream
                else:
                    usage = data["usage"]["completion_tokens"]
            return usage, n_tokens

    health, running = [], []

    async def watch(client, stop: asyncio.Event):
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await client.get("/health", timeout=10)
            health.append((r.status_code, time.perf_counter() - t0))
            text = (await client.get("/metrics", timeout=10)).text
            running.append(float(next(x for x in text.splitlines()
                                      if x.startswith("mla_jax_requests_running ")).split()[1]))
            await asyncio.sleep(0.2)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT,
                                     limits=httpx.Limits(max_connections=40)) as client:
            gate, stop = asyncio.Semaphore(32), asyncio.Event()
            watcher = asyncio.create_task(watch(client, stop))

            async def gated(kind, body):
                async with gate:
                    return await one(client, kind, body)

            results = await asyncio.wait_for(asyncio.gather(*(gated(k, b) for k, b in specs)), timeout=400)
            stop.set()
            await asyncio.wait_for(watcher, timeout=30)
            return results

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    for (kind, body), got in zip(specs, results):
        if kind == "cancel":
            assert got is None
        else:
            assert got == (body["max_tokens"], body["max_tokens"]), (kind, body["max_tokens"], got)
    assert len(health) >= 3 and all(code == 200 for code, _ in health), health
    assert max(running) > 1          # requests of different HTTP connections shared engine steps
    wait_idle(server, timeout=30)
    n_cancel = sum(kind == "cancel" for kind, _ in specs)
    assert metric(server, "requests_finished_total", finish_reason="abort") - before["abort"] == n_cancel
    assert metric(server, "requests_finished_total", finish_reason="length") - before["length"] == \
        len(specs) - n_cancel
    print(f"\nload: {len(specs)} requests ({n_cancel} cancelled) in {elapsed:.1f} s; /health worst "
          f"{max(t for _, t in health) * 1e3:.0f} ms over {len(health)} checks; most running {max(running):.0f}; "
          f"{metric(server, 'engine_steps_total') - steps_before:.0f} steps, "
          f"{server.engine.llm.num_compiles() - compiles_before} new compiled variants")


def test_full_queue_answers_503_and_recovers(server):
    engine = server.engine
    saved, engine.max_pending = engine.max_pending, 3
    body = {"prompt": "def f(x):\n", "max_tokens": 20, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            return await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=body)
                                                           for _ in range(12))), timeout=120)
    try:
        responses = asyncio.run(main())
    finally:
        engine.max_pending = saved
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503} and codes.count(200) >= 3, codes
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "server_overloaded" and r.headers["retry-after"] == "1"
        else:
            assert r.json()["usage"]["completion_tokens"] == 20
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_idle(server)
    assert metric(server, "requests_rejected_total", reason="overloaded") >= codes.count(503)


def test_close_fails_unfinished_requests_and_frees_pages(server):
    """Last test of the module: it stops the server's engine loop."""
    engine, got = server.engine, []
    ids = engine.llm.validate_prompt("import sys\n")
    engine.submit(Submission(ids, mla_jax.SamplingParams(max_tokens=200, ignore_eos=True), got.append))
    deadline = time.monotonic() + 60
    while not any(isinstance(x, Delta) and x.token_ids for x in got) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.llm.stats()["kv_pages_in_use"] > 0
    engine.close()
    assert isinstance(got[-1], Failed) and "shut down" in str(got[-1].error)
    assert engine.llm.stats()["kv_pages_in_use"] == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
