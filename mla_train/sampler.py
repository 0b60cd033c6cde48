"""Text generation for a quick look at the model during training (full forward, no cache: the engine,
mla_jax.LLM, is the real generation path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class TextSampler:
    """Greedy (temperature 0) or nucleus sampling by re-running the full forward on a fixed-size window: one
    compile for every prompt and setting. For a quick look at the model during training; the engine is the real
    generation path."""

    def __init__(self, model, window: int = 256):
        graphdef, self.state = nnx.split(model)
        self.window = window

        @jax.jit
        def next_token(state, ids, length, key, temperature, top_p):
            logits = nnx.merge(graphdef, state)(ids)[0, length - 1]
            probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6))
            order = jnp.argsort(-probs)
            sorted_p = probs[order]
            keep = jnp.cumsum(sorted_p) - sorted_p < top_p  # smallest prefix whose mass reaches top_p
            pick = order[jax.random.categorical(key, jnp.where(keep, jnp.log(sorted_p), -jnp.inf))]
            return jnp.where(temperature > 0, pick, jnp.argmax(logits)).astype(jnp.int32)

        self._next_token = next_token

    def continue_ids(self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
        ids, out = list(prompt_ids), []
        key = jax.random.key(seed)
        for i in range(max_new_tokens):
            ctx = ids[-self.window:]
            buf = np.zeros((1, self.window), np.int32)
            buf[0, :len(ctx)] = ctx
            t = int(self._next_token(self.state, jnp.asarray(buf), len(ctx), jax.random.fold_in(key, i),
                                     jnp.float32(temperature), jnp.float32(top_p)))
            ids.append(t)
            out.append(t)
            if eos_id is not None and t == eos_id:
                break
        return out
