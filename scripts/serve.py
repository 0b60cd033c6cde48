"""OpenAI-compatible server over mla_jax.LLM (thin main; same as `python -m mla_jax.serve`).

    python scripts/serve.py                                   # embedded default model on http://127.0.0.1:8000/v1
    python scripts/serve.py --model DIR --kv-cache-dtype fp8_e4m3 --tensor-parallel-size 8 --port 8000

Engine flags are those of scripts/generate.py (mla_jax.cli.add_engine_args); server flags: --host, --port,
--served-model-name, --max-pending, --log-level. Exit status 2 if the engine cannot be built as asked.
"""
import sys

from mla_jax.serve.launch import main

if __name__ == "__main__":
    sys.exit(main())
