"""A timing probe for the Hopper kernel's consumers: wgmma steps alone, or with the register decode in front.

mosaic_sm90's consumers issue one m64nNk16 step per 1,024 weights (N = the row block, 8 at decode sizes) with the
decoded weights as a register A operand. Whether those steps, not the ALU work around them, bound the kernel
depends on the tensor core's time per step at small N, which no public table gives for Hopper. This kernel
measures it: every CTA's `warpgroups` warpgroups each issue `iters` x `calls` wgmma calls of [64, k] x [k, n]
(A from constant registers or from SMEM, B from uninitialized SMEM: values do not change the timing), keeping one
iteration's calls in flight as the kernel's `overlap` does; with `decode`, A is rebuilt every iteration from SMEM
words as the consumers build it. scripts/bench_wgmma.py times it. GPU only (a
register A operand has no interpret mode); tests lower it for CUDA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.w4a16 import mosaic_sm90 as ms

ROWS = ms.SUB_N             # wgmma M
B_COLS = 256                # the B tile's K extent in SMEM (one chunk, as the kernel's x tile)


@functools.lru_cache(maxsize=None)
def wgmma_steps(*, n: int, k_per_call: int, calls: int, iters: int, warpgroups: int, a_in_registers: bool,
                num_ctas: int, decode: bool = False):
  """A jitted () -> [num_ctas, warpgroups, n, 64] f32 (the accumulators, so nothing is dead code).

  decode: each iteration builds A as mosaic_sm90's consumers do, from a [32, 64] word tile loaded from SMEM: the
  register decode and the fma fold, one chunk (256 K rows) per iteration; needs a_in_registers and
  calls * k_per_call = 256."""
  if k_per_call % 16 or B_COLS % k_per_call or calls * k_per_call > B_COLS:
    raise ValueError(f"wgmma_steps: k_per_call {k_per_call} x calls {calls} must tile the {B_COLS}-column B tile "
                     "in multiples of 16.")
  if n % 8 or not 8 <= n <= 256:
    raise ValueError(f"wgmma_steps: n {n} must be a multiple of 8 in [8, 256].")
  if decode and (not a_in_registers or calls * k_per_call != B_COLS):
    raise ValueError("wgmma_steps: decode needs a_in_registers and one 256-row chunk per iteration.")
  ppw = k_per_call // ms.PLANE
  scratch = [plgpu.SMEM((n, B_COLS), jnp.bfloat16, transforms=ms._X_SWZ),
             plgpu.SMEM((ROWS, B_COLS), jnp.bfloat16, transforms=ms._X_SWZ),
             plgpu.SMEM((ms.WORD_ROWS, ms.SUB_N), jnp.int32, transforms=ms._W_SWZ)]

  def body(o_ref, b_smem, a_smem, w_smem):
    wg = lax.axis_index("wg")

    def run(acc_ref):
      if a_in_registers:
        a = plgpu.layout_cast(jnp.full((ROWS, k_per_call), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)
        bias = plgpu.layout_cast(jnp.full((ROWS, k_per_call), -136.0, jnp.bfloat16), plgpu.Layout.WGMMA)

      def it(i, _):
        if decode:
          words = plgpu.load(w_smem, (), layout=ms.WORDS_LAYOUT, optimized=False)
          arrays = ms._decode_planes_gpu(ppw)(words)
          operands = [ms._fma_gpu(k_per_call)(arr, a, bias) for arr in arrays]
        for c in range(calls):
          cols = pl.ds(c * k_per_call, k_per_call)
          bt = b_smem.at[:, cols].transpose((1, 0))                    # [k, n]
          plgpu.wgmma(acc_ref, operands[c] if decode else a if a_in_registers else a_smem.at[:, cols], bt)
        plgpu.wgmma_wait(calls)                                        # the previous iteration's calls are done
        return ()

      lax.fori_loop(0, iters, it, ())
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    acc = pl.run_scoped(run, plgpu.ACC((ROWS, n), jnp.float32))
    ms._store_transposed_gpu(acc, o_ref.at[lax.axis_index("c"), wg])

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_ctas, warpgroups, n, ROWS), jnp.float32), scratch_types=scratch,
      grid=(num_ctas,), grid_names=("c",), num_threads=warpgroups, thread_name="wg",
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True, reduction_scratch_bytes=0))
  return jax.jit(kernel)


def k16_steps(*, n: int, k_per_call: int, calls: int, iters: int, warpgroups: int, num_ctas: int, **_) -> int:
  """The m64nNk16 steps one call of wgmma_steps issues over all CTAs."""
  return num_ctas * warpgroups * iters * calls * (k_per_call // 16)
