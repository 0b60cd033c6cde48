"""The inference engine: LLM (batched generation), SamplingParams, RequestOutput, and the pure step functions.

    llm.py        LLM: request handling, the generation loop, jitted step + sampling per bucket
    steps.py      prefill_step / decode_step (pure; absorbed MLA decode through pallas_kernels.mla_decode)
    decode_loop.py  k decode steps + sampling + stop checks in one jitted call, inputs in one int32 buffer
    runner.py     the decode fast path: multi-step calls, overlapped scheduling (NOTES.md)
    cache_storage.py  fp8 latents kept as uint8 bits between jitted calls (in-place writes on XLA:CPU)
    compile_cache.py  JAX's persistent compilation cache for the entry points
    executables.py  the engine's compiled step programs kept on disk, loaded without tracing or lowering
    scheduler.py  continuous batching, chunked prefill, preemption by recompute
    paged.py      page allocator, block tables, slots
    pools.py      per-device page pools and decode rows for data-parallel attention
    memory.py     bytes per device of the engine's weights and caches over a sharding plan (dry runs)
    sampling.py   on-device greedy / temperature / top-k / top-p sampling with per-request seeds
    params.py     SamplingParams, RequestOutput
    text.py       tokenizer, chat templates, incremental detokenization
"""
from mla_jax._lazy import lazy_exports

from .params import RequestOutput, SamplingParams

# Names from llm.py and steps.py are imported on first use: importing mla_jax.engine.text or .params must not
# pull in jax / flax / the kernels (mla_jax._lazy, as mla_jax/__init__.py does): name -> module.
_EXPORTS = {
    "LLM": "mla_jax.engine.llm",
    "StreamEvent": "mla_jax.engine.llm",
    "TokenEvent": "mla_jax.engine.llm",
    "EngineWeights": "mla_jax.engine.steps",
    "split_model": "mla_jax.engine.steps",
    "allocate_caches": "mla_jax.engine.steps",
    "prefill_step": "mla_jax.engine.steps",
    "decode_step": "mla_jax.engine.steps",
}

__all__ = ["SamplingParams", "RequestOutput", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
