"""An OpenAI-compatible HTTP server over mla_jax.LLM (install with `pip install -e ".[serve]"`).

    python -m mla_jax.serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine flags]

    launch.py       flags, build_app (engine loop + app), main (uvicorn), ServerThread (in-process, for tests)
    app.py          FastAPI routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
                    /metrics; OpenAI error bodies
    protocol.py     request schemas (strict) and their translation into SamplingParams
    engine_loop.py  the one thread that owns the LLM: admits requests between steps, delivers tokens, stop strings
    metrics.py      Prometheus text format
"""
