"""pallas_kernels.moe_router.group_topk: the one-kernel selection (Pallas Triton, interpret mode on CPU; the
GPU-marked test on a CUDA GPU) against the lax.top_k reference: the same ids, including ties, weights within an
ulp; DeepSeek-V3's sizes and odd ones; bad requests refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_router import api, reference, triton

CASES = [(64, 256, 8, 4, 8), (5, 256, 8, 4, 8), (17, 64, 4, 2, 6), (3, 20, 4, 3, 5), (16, 16, 1, 1, 4), (1, 32, 2, 1, 2)]


def _inputs(rng, t, e, ties):
  s = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((t, e)), jnp.float32))
  if ties:                                  # a coarse grid of values: many equal scores and group sums
    s = jnp.round(s * 8) / 8
  return s, jnp.asarray(rng.standard_normal(e) * 0.01, jnp.float32)


def _check(ids, w, ref_ids, ref_w):
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=2 ** -22, atol=0)


@pytest.mark.parametrize("t,e,g,tg,k", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_equals_reference(t, e, g, tg, k, ties):
  rng = np.random.default_rng(t * 7 + e + ties)
  s, b = _inputs(rng, t, e, ties)
  kw = dict(top_k=k, num_groups=g, topk_group=tg, norm_topk_prob=True, scale=2.5)
  _check(*api.group_topk(s, b, backend="triton", interpret=True, **kw), *reference.group_topk(s, b, **kw))


def test_unnormalised_and_auto_on_cpu_is_the_reference():
  rng = np.random.default_rng(3)
  s, b = _inputs(rng, 9, 64, False)
  kw = dict(top_k=3, num_groups=4, topk_group=2, norm_topk_prob=False, scale=1.0)
  _check(*api.group_topk(s, b, backend="triton", interpret=True, **kw), *reference.group_topk(s, b, **kw))
  if jax.devices()[0].platform == "cpu":
    ids, w = api.group_topk(s, b, **kw)
    ref_ids, ref_w = reference.group_topk(s, b, **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref_w))


def test_bad_requests():
  s, b = jnp.zeros((2, 8)), jnp.zeros((8,))
  kw = dict(top_k=2, num_groups=2, topk_group=1, norm_topk_prob=True, scale=1.0)
  with pytest.raises(ValueError, match="unknown"):
    api.group_topk(s, b, backend="cuda", **kw)
  with pytest.raises(ValueError, match="bias"):
    api.group_topk(s, jnp.zeros((7,)), **kw)
  with pytest.raises(ValueError, match="outside the kernel's sizes"):
    api.group_topk(s, b, backend="triton", interpret=True, **dict(kw, top_k=5))   # 5 > one kept group of 4
  assert not triton.supported(2048, 8, 8, 4) and triton.supported(256, 8, 8, 4)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,e,g,tg,k", CASES + [(200, 256, 8, 4, 8)])
def test_kernel_equals_reference_on_gpu(t, e, g, tg, k):
  rng = np.random.default_rng(t + e)
  for ties in (False, True):
    s, b = _inputs(rng, t, e, ties)
    kw = dict(top_k=k, num_groups=g, topk_group=tg, norm_topk_prob=True, scale=2.5)
    _check(*api.group_topk(s, b, backend="triton", **kw), *reference.group_topk(s, b, **kw))
