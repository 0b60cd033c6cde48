"""w4a16 kernels on a real GPU (marked `gpu`; skipped without one): the races and register hazards interpret mode
cannot show. Dense matmuls at every row-block size the backends pick (8 / 16 / 32 / 64 rows, one and several
blocks) and MoE calls from decode-sized to prefill-sized (block_m 64), each against the float64 reference on
fresh random AWQ weights. Run on the device with `python -m pytest -m gpu tests/test_gpu_w4a16.py`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16 import api, layout
from test_w4a16 import deq64, make_moe, max_rel, rand_awq, to_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")]


def gpu_backends():
  """The kernel backends this GPU runs: triton everywhere, mosaic_sm90 from Hopper (compute capability 9.0) on."""
  cc = float(getattr(jax.devices()[0], "compute_capability", "0"))
  return ["triton"] + (["mosaic_sm90"] if cc >= 9.0 else [])


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("m", [1, 5, 16, 32, 33, 64, 128, 200])
def test_dense_vs_float64(backend, m):
  rng = np.random.default_rng(1000 + m)
  k, n, g = 2048, 1536, 64
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  y = np.asarray(api.w4a16_matmul(x, w, backend=backend), np.float64)
  assert y.shape == (m, n) and np.isfinite(y).all()
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 33, 64, 128])
@pytest.mark.parametrize("sub", [2, 4])
def test_dense_sub_tiles_vs_float64(m, sub):
  """mosaic_sm90 with `sub` 64-column sub-tiles per consumer (opt-in sub_tiles): register A operands of several
  sub-tiles in flight, which interpret mode does not run."""
  if "mosaic_sm90" not in gpu_backends():
    pytest.skip("mosaic_sm90 needs Hopper")
  rng = np.random.default_rng(1100 + m + sub)
  k, n, g = 2048, 1536, 64
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  y = np.asarray(api.w4a16_matmul(x, w, backend="mosaic_sm90", config=dict(sub_tiles=sub)), np.float64)
  assert y.shape == (m, n) and np.isfinite(y).all()
  assert max_rel(y, np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2


def _moe_cases():
  extra = ["mosaic_sm90+gather_kernel", "mosaic_sm90+sub_tiles=1", "mosaic_sm90+sub_tiles=2",
           "mosaic_sm90+sub_tiles=2+splits=1"]
  return gpu_backends() + (extra if "mosaic_sm90" in gpu_backends() else [])


def _options(spec: str) -> dict | None:
  """"a+b=2" -> {"a": True, "b": 2}: the config options of a case name after its backend."""
  out = {}
  for item in filter(None, spec.split("+")):
    key, _, value = item.partition("=")
    out[key] = int(value) if value else True
  return out or None


@pytest.mark.parametrize("backend", _moe_cases())
@pytest.mark.parametrize("t", [1, 16, 64, 256, 512])
def test_moe_vs_float64(backend, t):
  """E = 16, top-2: block_m 8 / 8 / 16 / 32 / 64 (256 and 512 tokens average 32 and 64 rows per expert, as a
  prefill). "+gather_kernel": the opt-in row gather that writes only valid rows (gather_sm90); "+sub_tiles=R":
  R 64-column sub-tiles per consumer warpgroup (2: the MoE's default at 8-row blocks from 16 tokens; 1: one),
  "+splits=1": unsplit units."""
  rng = np.random.default_rng(2000 + t)
  e, d, i, g, k = 16, 1024, 512, 64, 2
  gate, up, down, w13, w2 = make_moe(rng, e, d, i, g)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  wts = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
  name, _, options = backend.partition("+")
  y = np.asarray(api.w4a16_moe(x, jnp.asarray(ids), jnp.asarray(wts), w13, w2, backend=name,
                               config=_options(options)), np.float64)
  assert np.isfinite(y).all()
  xd = np.asarray(x, np.float64)
  ref = np.zeros((t, d))
  for ex in range(e):                               # the float64 reference, one dequantization per expert
    tok, slot = np.nonzero(ids == ex)
    if len(tok):
      gg, uu = (xd[tok] @ deq64(*[a[ex] for a in ws], g) for ws in (gate, up))
      ref[tok] += wts[tok, slot, None] * ((gg / (1 + np.exp(-gg)) * uu) @ deq64(*[a[ex] for a in down], g))
  assert max_rel(y, ref) < 1.5e-2


@pytest.mark.parametrize("m,k", [(1, 2048), (16, 2304), (32, 2048), (64, 2048), (128, 2304)])
def test_dense_unroll_2_vs_float64_and_overlap_off(m, k):
  """unroll=2 (two chunks a consumer loop body, each with its own A registers; with the overlap at every block
  size, 64-row blocks included, where one chunk a body gave wrong results): within 1e-2 of float64 and the same
  bits as the overlap off (the same products in the same order). K = 2304 gives 9 chunks: an odd last one."""
  if "mosaic_sm90" not in gpu_backends():
    pytest.skip("mosaic_sm90 needs Hopper")
  rng = np.random.default_rng(1200 + m)
  n, g = 1536, 64
  q, z, s = rand_awq(rng, k, n, g)
  w = to_device(layout.pack(q, z, s, g, xp=np))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  y = np.asarray(api.w4a16_matmul(x, w, backend="mosaic_sm90", config=dict(unroll=2, overlap=True)), np.float32)
  y_off = np.asarray(api.w4a16_matmul(x, w, backend="mosaic_sm90", config=dict(overlap=False)), np.float32)
  assert y.shape == (m, n) and np.isfinite(y).all()
  assert max_rel(y.astype(np.float64), np.asarray(x, np.float64) @ deq64(q, z, s, g)) < 1e-2
  np.testing.assert_array_equal(y, y_off)


@pytest.mark.parametrize("t,k,e,block_m,kind", [(64, 8, 256, 8, "uniform"), (128, 8, 256, 16, "dropped"),
                                                (7, 6, 160, 16, "repeats"), (33, 3, 5, 4, "few"),
                                                (16, 8, 256, 8, "one_expert")])
def test_align_kernel_on_gpu_matches_align(t, k, e, block_m, kind):
  """The grouping's Pallas Triton kernel compiled for the GPU (its scattered and masked stores from many threads)
  against the XLA grouping, every array to the bit."""
  from pallas_kernels.w4a16 import routing, routing_triton
  from test_w4a16 import routing_case
  ids, wts = routing_case(np.random.default_rng(t * 1000 + e), t, k, e, kind)
  want = routing.align(jnp.asarray(ids), jnp.asarray(wts), e, block_m)
  got = routing_triton.align_kernel(jnp.asarray(ids), jnp.asarray(wts), e, block_m)
  for field in ("block_expert", "row_token", "row_weight", "pair_row"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)


@pytest.mark.parametrize("t,kind", [(1, "random"), (64, "random"), (33, "ties"), (256, "random")])
def test_router_select_kernel_on_gpu_matches_reference(t, kind):
  """moe_router's selection kernel on the GPU against the jax.lax.top_k reference (DeepSeek-V3's 8 x 32 experts,
  top-4 groups, top-8), ids and weights to the bit."""
  from pallas_kernels.moe_router import reference, triton
  from test_moe_router import scores_case
  scores, bias = scores_case(np.random.default_rng(t), t, 256, kind)
  want = reference.select_noaux_tc(scores, bias, k=8, n_group=8, topk_group=4)
  got = triton.select_noaux_tc(scores, bias, k=8, n_group=8, topk_group=4)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
