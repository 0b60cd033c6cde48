"""A split-KV schedule computed once (pallas_kernels.mla_decode_schedule, FlashMLA's get_mla_metadata) and
passed to mla_decode gives the same results as mla_decode computing its own; a schedule made for another call
shape is refused; backends without a length-dependent split have none. mosaic_sm90 runs in GPU interpret mode
(slow: one small case)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.testing import random_problem

SCALE = 192 ** -0.5


def test_shared_schedule_gives_identical_results_mosaic_interpret():
    q, cache, table, lens = random_problem(11, lens=[70, 0, 129], sq=1, heads=16, dtype="fp8_e4m3")
    kw = dict(softmax_scale=SCALE, backend="mosaic_sm90", interpret=True)

    @jax.jit
    def two_layers(q, cache, table, lens):
        sched = pallas_kernels.mla_decode_schedule(lens, table, num_heads=16, cache_dtype="fp8_e4m3",
                                                   backend="mosaic_sm90", interpret=True)
        assert isinstance(sched, pallas_kernels.SplitKVSchedule)
        shared = [pallas_kernels.mla_decode(q * s, cache, table, lens, schedule=sched, **kw) for s in (1.0, 0.5)]
        alone = [pallas_kernels.mla_decode(q * s, cache, table, lens, **kw) for s in (1.0, 0.5)]
        return shared, alone

    shared, alone = two_layers(q, cache, table, lens)
    for (o1, l1), (o2, l2) in zip(shared, alone):
        np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
        assert np.isfinite(np.asarray(l1)[[0, 2]]).all()


def test_schedule_for_another_shape_is_refused_and_xla_triton_have_none():
    q, cache, table, lens = random_problem(12, lens=[5, 64], sq=1, heads=16, dtype="bfloat16")
    sched = pallas_kernels.mla_decode_schedule(lens, table, num_heads=8, cache_dtype="bfloat16",
                                               backend="mosaic_sm90", interpret=True)
    with pytest.raises(ValueError, match="schedule was made for"):
        pallas_kernels.mla_decode(q, cache, table, lens, softmax_scale=SCALE, backend="mosaic_sm90",
                                  interpret=True, schedule=sched)
    for backend in ("xla", "triton"):
        assert pallas_kernels.mla_decode_schedule(lens, table, num_heads=16, cache_dtype="bfloat16",
                                                  backend=backend, interpret=True) is None
    with pytest.raises(ValueError, match="vmap with a precomputed schedule"):
        full = pallas_kernels.mla_decode_schedule(lens, table, num_heads=16, cache_dtype="bfloat16",
                                                  backend="mosaic_sm90", interpret=True)
        jax.vmap(lambda q: pallas_kernels.mla_decode(q, cache, table, lens, softmax_scale=SCALE,
                                                     backend="mosaic_sm90", interpret=True, schedule=full))(
            jnp.stack([q, q]))
