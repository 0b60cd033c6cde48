"""Register budgets of Hopper kernels whose warpgroups re-split the register file with setmaxnreg.

A CTA gets its registers at launch: `launch_registers(warpgroups)` a thread, the most ptxas gives a CTA of that many
128-thread warpgroups when one CTA fills an SM. `setmaxnreg` only moves registers between the CTA's warpgroups: a
decrease returns them to the CTA's pool, an increase waits until the pool can cover it, so a split whose sum is over
the launch's allocation waits forever (on an H100, six warpgroups asking 4 x 56 + 2 x 144 = 512 registers a thread-slot
of the 6 x 80 = 480 they launch with hung in the first increase). ptxas does not see this: each instruction only has
to fit the launch's count.

Also here: `register_owners`, which register of which thread holds which element of a Mosaic register layout (the
maps the kernels' inline PTX builds on, checked thread by thread).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

REGISTER_FILE = 65536      # 32-bit registers an SM (sm_90)
ALLOCATION_UNIT = 8        # registers a thread are allocated, and setmaxnreg takes them, in multiples of 8
MIN_REGISTERS, MAX_REGISTERS = 24, 256   # setmaxnreg's range


def launch_registers(warpgroups: int) -> int:
  """Registers a thread of a CTA of `warpgroups` x 128 threads at launch, one CTA an SM (3: 168, 4: 128, 6: 80)."""
  if warpgroups < 1:
    raise ValueError(f"warpgroups must be >= 1, got {warpgroups}")
  return min(255, REGISTER_FILE // (128 * warpgroups)) // ALLOCATION_UNIT * ALLOCATION_UNIT


def check_register_split(per_warpgroup: Sequence[int], where: str) -> None:
  """Raises ValueError unless every warpgroup's count is a multiple of 8 in [24, 256] and together they fit the
  registers the CTA launches with (a larger sum deadlocks the kernel's first setmaxnreg increase)."""
  counts = [int(r) for r in per_warpgroup]
  bad = [r for r in counts if r % ALLOCATION_UNIT or not MIN_REGISTERS <= r <= MAX_REGISTERS]
  if bad:
    raise ValueError(f"{where}: register counts must be multiples of {ALLOCATION_UNIT} in [{MIN_REGISTERS}, "
                     f"{MAX_REGISTERS}] (setmaxnreg), got {bad} in the split {counts}")
  budget = len(counts) * launch_registers(len(counts))
  if sum(counts) > budget:
    raise ValueError(f"{where}: the register split {counts} (one count a warpgroup) sums to {sum(counts)} registers "
                     f"a thread-slot, over the {budget} that {len(counts)} warpgroups launch with "
                     f"({launch_registers(len(counts))} each): its first setmaxnreg increase would wait forever. "
                     f"Lower the counts until they sum to at most {budget}.")


def register_owners(tiled_layout, shape) -> dict:
  """{(warp, lane, register index, vector element): logical index} of a Mosaic TiledLayout over `shape`, computed
  from its tiling in NumPy (what Mosaic's thread_idxs computes in MLIR); every index a tuple of Python ints."""
  tiling = tiled_layout.tiling
  tshape = tiling.tile_shape(tuple(shape))
  tstrides = tiling.tile_strides(tuple(int(v) for v in np.cumprod((1,) + tuple(shape[::-1]))[-2::-1]))
  rank = len(tshape)
  norm = lambda d: d % rank
  warp_dims = [norm(d) for d in tiled_layout.warp_dims]
  lane_dims = [norm(d) for d in tiled_layout.lane_dims]
  vdim = norm(tiled_layout.vector_dim)
  owners = {}
  for idx in np.ndindex(*tshape):
    linear = sum(i * st for i, st in zip(idx, tstrides))
    warp = lane = 0
    for d in warp_dims:
      warp = warp * tshape[d] + idx[d]
    for d in lane_dims:
      lane = lane * tshape[d] + idx[d]
    reg = tuple(0 if d in warp_dims or d in lane_dims or d == vdim else i for d, i in enumerate(idx))
    owners[(warp, lane, reg, idx[vdim])] = tuple(int(v) for v in np.unravel_index(linear, shape))
  return owners
