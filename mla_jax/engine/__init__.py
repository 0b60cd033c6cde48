"""The inference engine: LLM (batched generation), SamplingParams, RequestOutput, and the pure step functions.

    llm.py        LLM: request handling, the generation loop, jitted step + sampling per bucket
    steps.py      prefill_step / decode_step (pure; absorbed MLA decode through pallas_kernels.mla_decode)
    scheduler.py  continuous batching, chunked prefill, preemption by recompute
    paged.py      page allocator, block tables, slots
    sampling.py   on-device greedy / temperature / top-k / top-p sampling with per-request seeds
    params.py     SamplingParams, RequestOutput
    text.py       tokenizer, chat templates, incremental detokenization
"""
from .params import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StreamEvent", "EngineWeights", "split_model",
           "allocate_caches", "prefill_step", "decode_step"]


def __getattr__(name):
    # lazy: importing mla_jax.engine.text or .params must not pull in jax / flax / the kernels
    if name in ("LLM", "StreamEvent"):
        from . import llm
        return getattr(llm, name)
    if name in ("EngineWeights", "split_model", "allocate_caches", "prefill_step", "decode_step"):
        from . import steps
        return getattr(steps, name)
    raise AttributeError(f"module 'mla_jax.engine' has no attribute {name!r}")
