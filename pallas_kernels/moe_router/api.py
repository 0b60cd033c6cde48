"""group_topk: the MoE router's group-limited top-k after the logits, and its backend choice.

  group_topk(scores [T, E] f32, bias [E] f32, *, top_k, num_groups, topk_group, norm_topk_prob, scale)
      -> (ids int32 [T, K], weights f32 [T, K])

Backends: "xla" (reference.py, jax.lax.top_k; any device) and "triton" (triton.py, one Pallas Triton kernel;
CUDA compute capability >= 8.0, or interpret=True). "auto" takes triton on such a GPU for the sizes it supports,
else xla. Same ids as the reference; the weights may differ from it by an ulp (triton.py says why).
"""
from __future__ import annotations

import jax

from pallas_kernels.moe_router import reference, triton

BACKEND_NAMES = ("auto", "triton", "xla")


def _triton_gpu(device) -> bool:
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not isinstance(cc, str) or not cc:
    return False
  major, _, minor = cc.partition(".")
  return (int(major), int(minor or 0)) >= (8, 0)


def group_topk(scores: jax.Array, bias: jax.Array, *, top_k: int, num_groups: int, topk_group: int,
               norm_topk_prob: bool, scale: float, backend: str = "auto", interpret: bool = False):
  """reference.group_topk's contract; backend as in the module docstring. A backend named explicitly that cannot
  run raises ValueError saying why."""
  if backend not in BACKEND_NAMES:
    raise ValueError(f"group_topk backend {backend!r} is unknown; choose one of {BACKEND_NAMES}.")
  if scores.ndim != 2 or bias.shape != scores.shape[1:]:
    raise ValueError(f"group_topk: scores must be [T, E] and bias [E], got {tuple(scores.shape)} and "
                     f"{tuple(bias.shape)}.")
  e = scores.shape[1]
  kw = dict(top_k=top_k, num_groups=num_groups, topk_group=topk_group, norm_topk_prob=norm_topk_prob, scale=scale)
  fits = triton.supported(e, num_groups, top_k, topk_group)
  if backend == "triton":
    if not (interpret or _triton_gpu(jax.devices()[0])):
      raise ValueError("group_topk backend 'triton' needs a CUDA GPU of compute capability >= 8.0 or "
                       "interpret=True; backend='xla' runs anywhere.")
    return triton.group_topk(scores, bias, interpret=interpret, **kw)
  if backend == "auto" and fits and not interpret and _triton_gpu(jax.devices()[0]) and scores.shape[0] > 0:
    return triton.group_topk(scores, bias, **kw)
  return reference.group_topk(scores, bias, **kw)
