"""`ParamTarget`: where one checkpoint tensor goes in the model. Its own module because both the HF loader
(checkpoint/hf.py) and the AWQ layers (quant/awq.py, which build the targets of quantized linears) need it, and
the model sits between them (docs/architecture.md §1). Imports numpy only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamTarget:
    """Where one HF tensor goes.

    module: path of the owning module in the NNX tree, e.g. ('layers', 3, 'self_attn', 'q_a_proj');
    param: attribute name on it ('kernel', 'weight', 'embedding', 'w_gate', 'e_score_correction_bias', ...);
    hf_shape: the tensor's shape in the checkpoint; transpose: HF [out, in] -> our [in, out];
    expert: index into the stacked leading expert axis (per-expert HF tensors), else None;
    dtype: None -> the model dtype; otherwise a fixed dtype name ('float32' for the router, 'int32' for packed
    AWQ weights, ...); quantizable: a decoder linear that AWQ may replace (router/embeddings/norms/lm_head not).
    """

    module: tuple[str | int, ...]
    param: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    expert: int | None = None
    dtype: str | None = None
    quantizable: bool = False
    # AWQ hook (mla_jax.quant.awq.awq_linear_targets): when set, convert(host_array) -> final host array (layout
    # and dtype, e.g. int32-packed AWQ -> int4); transpose/dtype are then not applied.
    convert: Callable[[np.ndarray], np.ndarray] | None = None
    # (start, width) of the parameter's last axis that this tensor fills, when several tensors share one
    # parameter (AWQ experts: gate_proj and up_proj are the two column halves of `w13`); None: all of it.
    columns: tuple[int, int] | None = None

    @property
    def path(self) -> tuple[str | int, ...]:
        return self.module + (self.param,)
