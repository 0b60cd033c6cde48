"""DeepSeek-V3/R1-class inference in JAX with an FP8 paged MLA KV cache.

Public names are imported lazily, so a module that is not built yet (e.g. the engine) does not break
`import mla_jax`. To export a new name, add it to `_EXPORTS` as name -> module.
"""

import importlib

_EXPORTS = {
    "load_model": "mla_jax.checkpoint.load",
    "ModelConfig": "mla_jax.config",
    "AWQConfig": "mla_jax.config",
    "LLM": "mla_jax.engine",
    "SamplingParams": "mla_jax.engine",
    "RequestOutput": "mla_jax.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
