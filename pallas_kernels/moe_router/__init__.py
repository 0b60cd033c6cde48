"""moe_router: the expert selection of DeepSeek-V3's router (noaux_tc) after its logits.

`select_experts(scores, bias, k=, n_group=, topk_group=, backend=)`: "auto" takes the Pallas Triton kernel
(triton.py, one launch) on a CUDA GPU of compute capability >= 8.0 where it supports the shape, the XLA reference
(reference.py, jax.lax.top_k) elsewhere; "triton" / "xla" by name. Both give the same ids and weights to the bit.
"""
from __future__ import annotations

import logging

import jax

from pallas_kernels.device_info import compute_capability
from pallas_kernels.moe_router import reference, triton

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "triton", "xla")
_logged: set = set()


def resolve_backend(requested: str, num_experts: int, n_group: int, k: int, interpret: bool = False,
                    device=None) -> tuple[str, str]:
  """(backend, reason) for a selection; raises ValueError for a named backend that cannot run."""
  if requested not in BACKENDS:
    raise ValueError(f"moe_router backend {requested!r} is unknown; choose one of {BACKENDS}.")
  if requested == "xla":
    return "xla", "requested"
  device = device or jax.devices()[0]
  cc = compute_capability(device)
  on_gpu = device.platform == "gpu" and cc is not None and cc >= (8, 0)
  shape_ok = triton.supports(num_experts, n_group, k)
  if requested == "triton":
    if not (interpret or on_gpu):
      raise ValueError(f"moe_router backend 'triton' needs a CUDA GPU of compute capability >= 8.0 or "
                       f"interpret=True; this is a {device.platform} device. backend='xla' runs here.")
    if not shape_ok:
      raise ValueError(f"moe_router backend 'triton' takes n_group and E / n_group powers of two and 1 <= k <= E; "
                       f"got E={num_experts}, n_group={n_group}, k={k}. Use backend='xla'.")
    return "triton", "requested"
  if interpret:
    return ("triton", "interpret=True") if shape_ok else ("xla", "a shape the kernel does not take")
  if on_gpu and shape_ok:
    return "triton", f"{device.device_kind}: CUDA GPU >= 8.0"
  return "xla", ("a shape the kernel does not take" if on_gpu else "no CUDA GPU of compute capability >= 8.0")


def select_experts(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
                   backend: str = "auto", interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """scores f32 [T, E] (sigmoid of the router logits), bias f32 [E] (e_score_correction_bias) -> (ids int32 [T, k],
  weights f32 [T, k]): noaux_tc's choice (reference.select_noaux_tc has the rule); weights not normalised."""
  t, e = scores.shape
  if bias.shape != (e,):
    raise ValueError(f"select_experts: bias must be [E={e}], got {tuple(bias.shape)}")
  if e % n_group or not 1 <= topk_group <= n_group or not 1 <= k <= e * topk_group // n_group:
    raise ValueError(f"select_experts: needs E divisible by n_group, 1 <= topk_group <= n_group and k at most the "
                     f"experts of the kept groups; got E={e}, n_group={n_group}, topk_group={topk_group}, k={k}")
  name, reason = resolve_backend(backend, e, n_group, k, interpret)
  if (backend, name, reason) not in _logged:
    _logged.add((backend, name, reason))
    logger.info("moe_router backend: %s (%s)", name, reason)
  if name == "xla" or t == 0:
    return reference.select_noaux_tc(scores, bias, k=k, n_group=n_group, topk_group=topk_group)
  return triton.select_noaux_tc(scores, bias, k=k, n_group=n_group, topk_group=topk_group, interpret=interpret)
