"""`python -m mla_jax.serve`: the OpenAI-compatible server (mla_jax.serve.launch)."""
import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
