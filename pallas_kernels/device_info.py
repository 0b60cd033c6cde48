"""What the ops' backend rules read from a JAX device."""
from __future__ import annotations


def compute_capability(device) -> tuple[int, int] | None:
  """(major, minor) of a CUDA device (jax reports it as a string such as "9.0"); None for any other device."""
  cc = getattr(device, "compute_capability", None)
  if isinstance(cc, str) and cc:
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)
  return None
