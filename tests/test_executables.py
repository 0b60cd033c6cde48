"""The engine's persistent step programs (mla_jax/engine/executables.py): a second process resolves every program
from disk without tracing, with the same results, and anything that changes the program gives a new key."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.engine import executables
from mla_jax.engine.executables import ExecutableStore, forget_process_programs

TRACES = []


def _step(w, cache, x, *, scale):
    TRACES.append(x.shape)                     # runs only while tracing
    return cache.at[: x.shape[0]].add(x * scale), jnp.tanh(w @ x) * scale


STEP = jax.jit(_step, static_argnames=("scale",), donate_argnums=(1,))


def _inputs(rng, n=4):
    return (jnp.asarray(rng.standard_normal((n, n)), jnp.float32), jnp.zeros(16, jnp.float32),
            jnp.asarray(rng.standard_normal(n), jnp.float32))


@pytest.fixture(autouse=True)
def fresh_process():
    forget_process_programs()
    TRACES.clear()
    yield
    forget_process_programs()


def test_second_store_loads_from_disk_without_tracing(tmp_path):
    rng = np.random.default_rng(0)
    w, cache, x = _inputs(rng)
    first = ExecutableStore("model A", str(tmp_path))
    cache1, y1 = first.call("step", STEP, (x.shape, 2.0), w, cache, x, scale=2.0)
    assert cache.is_deleted(), "the cache argument is donated"
    assert first.stats["compiled"] == 1 and first.stats["written"] == 1 and len(TRACES) == 1
    assert len(os.listdir(tmp_path)) == 1

    forget_process_programs()                  # as a new process: nothing in memory
    second = ExecutableStore("model A", str(tmp_path))
    cache2 = jnp.zeros(16, jnp.float32)
    cache2_out, y2 = second.call("step", STEP, (x.shape, 2.0), w, cache2, x, scale=2.0)
    assert second.stats == dict(memory=0, disk=1, compiled=0, written=0, not_written=0, load_errors=0)
    assert len(TRACES) == 1, "loading from disk must not trace"
    assert cache2.is_deleted(), "donation survives serialization"
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))
    np.testing.assert_array_equal(np.asarray(cache2_out), np.asarray(cache1))
    want = np.tanh(np.asarray(w, np.float64) @ np.asarray(x, np.float64)) * 2.0
    np.testing.assert_allclose(np.asarray(y2), want, rtol=1e-5, atol=1e-6)

    # the same signature again: from the store's own table (no lookup, no trace)
    second.call("step", STEP, (x.shape, 2.0), w, jnp.zeros(16, jnp.float32), x, scale=2.0)
    assert second.stats["disk"] == 1 and len(second) == 1 and second.count("step") == 1


def test_a_changed_program_is_never_a_stale_hit(tmp_path):
    """Identity, static values, shapes, dtypes and the source digest are all in the key."""
    rng = np.random.default_rng(1)
    w, cache, x = _inputs(rng)
    ExecutableStore("model A", str(tmp_path)).call("step", STEP, (4, 2.0), w, cache, x, scale=2.0)
    cases = [("model B", 2.0, 4, jnp.float32), ("model A", 3.0, 4, jnp.float32), ("model A", 2.0, 8, jnp.float32),
             ("model A", 2.0, 4, jnp.bfloat16)]
    for identity, scale, n, dtype in cases:
        forget_process_programs()
        w, cache, x = (a.astype(dtype) for a in _inputs(rng, n))
        store = ExecutableStore(identity, str(tmp_path))
        _, y = store.call("step", STEP, (n, scale, str(dtype)), w, cache, x, scale=scale)
        assert store.stats["compiled"] == 1 and store.stats["disk"] == 0, (identity, scale, n, dtype)
        want = np.tanh(np.asarray(w, np.float64) @ np.asarray(x, np.float64)) * scale
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-2, atol=2e-2)
    assert len(os.listdir(tmp_path)) == 1 + len(cases)


def test_source_change_changes_the_key(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    w, cache, x = _inputs(rng)
    store = ExecutableStore("model A", str(tmp_path))
    key = store._key("step", (w, cache, x), {"scale": 2.0})
    monkeypatch.setattr(executables, "_SOURCE_DIGEST", "0" * 64)
    assert store._key("step", (w, cache, x), {"scale": 2.0}) != key


def test_corrupt_file_is_compiled_again_and_replaced(tmp_path):
    rng = np.random.default_rng(3)
    w, cache, x = _inputs(rng)
    ExecutableStore("model A", str(tmp_path)).call("step", STEP, 0, w, cache, x, scale=1.0)
    (path,) = [tmp_path / p for p in os.listdir(tmp_path)]
    path.write_bytes(path.read_bytes()[:100])          # truncated, as by a crash mid-write elsewhere
    forget_process_programs()
    store = ExecutableStore("model A", str(tmp_path))
    _, y = store.call("step", STEP, 0, w, jnp.zeros(16, jnp.float32), x, scale=1.0)
    assert store.stats["load_errors"] == 1 and store.stats["compiled"] == 1 and store.stats["written"] == 1
    np.testing.assert_allclose(np.asarray(y), np.tanh(np.asarray(w) @ np.asarray(x)), rtol=1e-5, atol=1e-6)
    forget_process_programs()
    again = ExecutableStore("model A", str(tmp_path))
    again.call("step", STEP, 0, w, jnp.zeros(16, jnp.float32), x, scale=1.0)
    assert again.stats["disk"] == 1


def test_programs_with_host_callbacks_are_not_written(tmp_path):
    """Their executables point into this process (interpret-mode kernels call back into Python)."""
    f = jax.jit(lambda x: jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    store = ExecutableStore("callbacks", str(tmp_path))
    y = store.call("cb", f, 0, jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(y), [0.0, 2.0, 4.0])
    assert store.stats["not_written"] == 1 and os.listdir(tmp_path) == []


def test_without_a_directory_nothing_is_written(tmp_path):
    rng = np.random.default_rng(4)
    w, cache, x = _inputs(rng)
    store = ExecutableStore("model A", None)
    store.call("step", STEP, 0, w, cache, x, scale=1.0)
    assert store.stats["compiled"] == 1 and store.stats["written"] == 0


def test_wrong_argument_types_raise_instead_of_running(tmp_path):
    rng = np.random.default_rng(5)
    w, cache, x = _inputs(rng)
    store = ExecutableStore("model A", str(tmp_path))
    store.call("step", STEP, "sig", w, cache, x, scale=1.0)
    with pytest.raises(TypeError):      # a caller whose signature misses a shape change gets an error, not garbage
        store.call("step", STEP, "sig", w, jnp.zeros(16, jnp.float32), jnp.zeros(5, jnp.float32), scale=1.0)


def test_llm_second_engine_loads_every_program_and_generates_the_same(tmp_path, monkeypatch):
    """The embedded model, as two runs of generate.py would: the second resolves its prefill, decode loop and
    sampling programs from disk (nothing traced or compiled) and gives the same greedy tokens and logprobs."""
    from mla_jax.engine import llm as llm_module
    from mla_jax.engine.llm import LLM
    from mla_jax.engine.params import SamplingParams

    monkeypatch.setattr(llm_module, "default_directory", lambda: str(tmp_path))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = ["import os", "def f(x):", "x"]
    a = LLM("tiny-deepseek-py", max_num_seqs=4, max_model_len=128)
    out_a = a.generate(prompts, params)
    assert a._programs.stats["compiled"] == len(a._programs) > 0 and a._programs.stats["written"] == len(a._programs)

    forget_process_programs()
    b = LLM("tiny-deepseek-py", max_num_seqs=4, max_model_len=128)
    out_b = b.generate(prompts, params)
    assert b._programs.stats["compiled"] == 0 and b._programs.stats["disk"] == len(b._programs) == len(a._programs)
    for x, y in zip(out_a, out_b):
        assert x.token_ids == y.token_ids
        np.testing.assert_array_equal(np.asarray(x.logprobs), np.asarray(y.logprobs))

    # another multi_step is another decode loop (the engine's identity): compiled, not loaded
    forget_process_programs()
    c = LLM("tiny-deepseek-py", max_num_seqs=4, max_model_len=128, multi_step=4)
    c.generate(prompts, params)
    assert c._programs.stats["compiled"] == c._programs.count("decode_loop") == 1
    assert c._programs.stats["disk"] == len(c._programs) - 1 > 0      # prefill and sampling: loaded


CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from mla_jax.engine.compile_cache import enable_compilation_cache
    enable_compilation_cache(sys.argv[1])
    from mla_jax.engine.executables import ExecutableStore, default_directory
    f = jax.jit(lambda w, x: (jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32) * 3
                              + 1).sum(0))
    store = ExecutableStore("child", default_directory())
    w = jnp.asarray(np.arange(64.0).reshape(8, 8) / 64, jnp.float32)
    y = store.call("f", f, 0, w, jnp.ones((4, 8), jnp.float32))
    print("RESULT", store.stats["compiled"], store.stats["disk"], float(np.asarray(y).sum()))
""")


def test_programs_written_after_a_jax_cache_hit_still_load(tmp_path):
    """JAX's cache holds the program but the store's file is gone (deleted, or a source change gave a new key
    for an unchanged program): what the store writes must be a fresh compile. An executable that JAX read
    back from its own cache does not serialize again completely on XLA:CPU; loading that copy failed at the
    first call ("Function wrapped_convert.1 not found") before the store turned JAX's cache off for its compiles."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLA_JAX_COMPILATION_CACHE", None)
    cache = tmp_path / "cache"

    def run():
        proc = subprocess.run([sys.executable, "-c", CHILD, str(cache)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        compiled, disk, y = proc.stdout.split("RESULT")[1].split()
        return int(compiled), int(disk), float(y)

    first = run()
    assert first[:2] == (1, 0)
    for p in (cache / executables.SUBDIR).iterdir():
        p.unlink()                              # JAX's cache keeps its entries
    assert run()[:2] == (1, 0)                  # compiled again (JAX's cache bypassed) and written
    third = run()
    assert third[:2] == (0, 1) and third[2] == first[2]
