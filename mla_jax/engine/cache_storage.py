"""How the engine keeps its KV caches between jitted calls: fp8 latents as their uint8 bits.

An fp8 cache written inside a jitted step must be updated in place. XLA:CPU cannot scatter into a float8 buffer
in place: it widens the whole pool to f16 and back (a pool of 513 pages costs 145 ms per layer and step against
0.06 ms for a bf16 pool, NOTES.md). MLAKVCache.write scatters the bits as uint8 instead, and when the buffer also
enters and leaves the jitted call as uint8 the bit casts cancel and the scatter updates the donated buffer in
place. So the engine stores each fp8 latent as uint8 (`as_stored`) and every jitted step views it as float8 on
entry (`from_stored`) and stores it again on exit. Other caches pass through unchanged. The stored form is an
MLAKVCache whose latent is uint8: only these two functions may touch it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp


def as_stored(caches: Sequence) -> tuple:
    """Caches -> the stored form (fp8 latents bit-cast to uint8)."""
    return tuple(dataclasses.replace(c, latent=jax.lax.bitcast_convert_type(c.latent, jnp.uint8))
                 if c.latent.dtype == jnp.float8_e4m3fn else c for c in caches)


def from_stored(caches: Sequence) -> tuple:
    """The stored form -> caches (uint8 latents viewed as float8_e4m3fn again)."""
    return tuple(dataclasses.replace(c, latent=jax.lax.bitcast_convert_type(c.latent, jnp.float8_e4m3fn))
                 if c.latent.dtype == jnp.uint8 else c for c in caches)


def stored_step(step):
    """step(graphdef, weights, caches, ...) -> (caches, *out), as a function of the stored caches."""
    @functools.wraps(step)
    def run(graphdef, weights, stored, *args, **kwargs):
        caches, *out = step(graphdef, weights, from_stored(stored), *args, **kwargs)
        return (as_stored(caches), *out)
    return run
