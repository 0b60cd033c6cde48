"""moe_router: the noaux_tc selection's Pallas Triton kernel (interpret mode) against the jax.lax.top_k reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.config import ModelConfig, deepseek_v3_hf_config
from mla_jax.model.moe import Router
from pallas_kernels import moe_router
from pallas_kernels.moe_router import reference, triton


def scores_case(rng, t, e, kind):
  logits = rng.standard_normal((t, e)).astype(np.float32) * 2
  scores = jax.nn.sigmoid(jnp.asarray(logits))
  if kind == "ties":                # few distinct values: every top-k breaks ties by index
    scores = jnp.round(scores * 4) / 4
  bias = rng.standard_normal(e).astype(np.float32) * (0 if kind == "ties" else 0.05)
  return scores, jnp.asarray(bias)


@pytest.mark.parametrize("t,e,g,tg,k,kind", [(64, 256, 8, 4, 8, "random"), (1, 256, 8, 4, 8, "random"),
                                             (7, 64, 4, 2, 6, "random"), (5, 256, 8, 4, 8, "ties"),
                                             (3, 16, 1, 1, 3, "ties"), (9, 32, 16, 5, 10, "random")])
def test_kernel_matches_reference(t, e, g, tg, k, kind):
  scores, bias = scores_case(np.random.default_rng(t * 31 + e), t, e, kind)
  want = reference.select_noaux_tc(scores, bias, k=k, n_group=g, topk_group=tg)
  got = triton.select_noaux_tc(scores, bias, k=k, n_group=g, topk_group=tg, interpret=True)
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ids = np.asarray(got[0])
  assert all(len(set(row)) == k for row in ids)                       # k distinct experts a token


def test_ids_come_from_the_best_groups():
  # an independent check of the rule: every chosen expert lies in one of the topk_group groups with the largest
  # top-2 sums, and no unchosen expert of those groups beats the weakest chosen one
  rng = np.random.default_rng(3)
  scores, bias = scores_case(rng, 16, 256, "random")
  ids, w = triton.select_noaux_tc(scores, bias, k=8, n_group=8, topk_group=4, interpret=True)
  choice = np.asarray(scores + bias, np.float64).reshape(16, 8, 32)
  top2 = np.sort(choice, axis=2)[:, :, -2:].sum(axis=2)
  for t in range(16):
    groups = set(np.argsort(-top2[t], kind="stable")[:4])
    assert {i // 32 for i in np.asarray(ids[t])} <= groups
    flat = choice[t].reshape(-1)
    chosen = set(np.asarray(ids[t]).tolist())
    weakest = min(flat[i] for i in chosen)
    assert all(flat[i] <= weakest for i in range(256) if i // 32 in groups and i not in chosen)
    np.testing.assert_array_equal(np.asarray(w[t]), np.asarray(scores[t])[np.asarray(ids[t])])


def test_backend_rules():
  assert moe_router.resolve_backend("auto", 256, 8, 8)[0] == "xla"                  # CPU here
  assert moe_router.resolve_backend("auto", 256, 8, 8, interpret=True)[0] == "triton"
  assert moe_router.resolve_backend("auto", 96, 8, 8, interpret=True)[0] == "xla"   # 12 experts a group
  with pytest.raises(ValueError, match="needs a CUDA GPU"):
    moe_router.resolve_backend("triton", 256, 8, 8)
  with pytest.raises(ValueError, match="powers of two"):
    moe_router.resolve_backend("triton", 96, 8, 8, interpret=True)
  with pytest.raises(ValueError, match="unknown"):
    moe_router.resolve_backend("cuda", 256, 8, 8)
  s, b = scores_case(np.random.default_rng(0), 2, 256, "random")
  with pytest.raises(ValueError, match="bias must be"):
    moe_router.select_experts(s, b[:8], k=8, n_group=8, topk_group=4)
  with pytest.raises(ValueError, match="kept groups"):
    moe_router.select_experts(s, b, k=40, n_group=8, topk_group=1)


def test_router_kernel_and_xla_route_the_same():
  # the model's Router (DeepSeek-V3's routing fields) with each selection backend: same ids and weights
  cfg = ModelConfig.from_hf_dict(deepseek_v3_hf_config())
  router = Router(cfg, rngs=nnx.Rngs(0))
  router.e_score_correction_bias[...] = jax.random.normal(jax.random.key(5), (256,), jnp.float32) * 0.01
  x = jax.random.normal(jax.random.key(1), (12, cfg.hidden_size), jnp.bfloat16)
  router.select_backend = "xla"
  want = router(x)
  router.select_backend, router.interpret = "triton", True
  got = router(x)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
