"""DeepSeek-V3/R1-class inference in JAX with an FP8 paged MLA KV cache.

Public names are imported lazily, so a module that is not built yet (e.g. the engine) does not break
`import mla_jax`. To export a new name, add it to `_EXPORTS` as name -> module.
"""

from mla_jax._lazy import lazy_exports

_EXPORTS = {
    "load_model": "mla_jax.checkpoint.load",
    "ModelConfig": "mla_jax.config",
    "AWQConfig": "mla_jax.config",
    "LLM": "mla_jax.engine",
    "SamplingParams": "mla_jax.engine",
    "RequestOutput": "mla_jax.engine",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
