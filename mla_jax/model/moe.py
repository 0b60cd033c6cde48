"""DeepSeekMoE: router (noaux_tc / group_limited_greedy / greedy), stacked routed experts, shared experts.

Routed experts, two exact implementations (no capacity limit, no token dropping), chosen by `Experts.impl`:
- "ragged_dot" (default): the T·K (token, expert) assignments are sorted by expert, each expert multiplies only
  its own contiguous rows (`jax.lax.ragged_dot`), results are weighted and scatter-added back. Work ∝ T·K on CPU;
  differentiable. jax 0.11 cannot vmap ragged_dot, so vmapping a model over a batch axis needs "dense".
- "dense": every expert runs on every token and a [T, E] combine matrix (zero for unchosen experts) weights the
  results. Work ∝ T·E; composes with vmap and with sharding the E axis.
On GPU XLA expands ragged_dot to a dense masked dot anyway (docs/architecture.md §9); a faster grouped GEMM for large
models belongs to the engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import ModelConfig
from mla_jax.model.layers import MLP, matmul_precision
from mla_jax.quant.awq import AWQExperts
from pallas_kernels import moe_router

_INIT_STD = 0.02


class Router(nnx.Module):
    """HF `mlp.gate`: kernel [D, E] (HF weight [E, D]) and, for noaux_tc, e_score_correction_bias [E]; fp32 always."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, select_backend: str = "auto"):
        self.cfg = cfg
        # noaux_tc's selection: pallas_kernels.moe_router ("auto": its Pallas Triton kernel on a CUDA GPU, else XLA's
        # jax.lax.top_k; the same ids and weights either way)
        self.select_backend = select_backend
        self.interpret = False
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (D, E), jnp.float32) * _INIT_STD)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (topk_idx int32 [T, K], topk_w float32 [T, K])."""
        cfg = self.cfg
        E, K, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
        T = x.shape[0]
        logits = jnp.dot(x.astype(jnp.float32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)  # [T, E]
        if cfg.scoring_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jax.nn.softmax(logits, axis=-1)

        if cfg.topk_method == "greedy":
            topk_w, topk_idx = jax.lax.top_k(scores, K)
        elif cfg.topk_method == "noaux_tc":
            # Selection uses bias-corrected scores; groups ranked by the sum of their top-2 corrected scores; the
            # weights are the unbiased scores (moe_router.reference.select_noaux_tc writes it out)
            topk_idx, topk_w = moe_router.select_experts(
                scores, self.e_score_correction_bias[...], k=K, n_group=G, topk_group=cfg.topk_group,
                backend=self.select_backend, interpret=self.interpret)                      # [T, K], [T, K]
        else:  # group_limited_greedy (DeepSeek-V2): groups ranked by their best expert; others' scores -> 0
            group_score = scores.reshape(T, G, E // G).max(-1)
            masked = jnp.where(self._group_mask(group_score), scores, 0.0)
            topk_w, topk_idx = jax.lax.top_k(masked, K)

        if cfg.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(-1, keepdims=True) + 1e-20)
        topk_w = topk_w * cfg.routed_scaling_factor
        return topk_idx.astype(jnp.int32), topk_w.astype(jnp.float32)

    def _group_mask(self, group_score: jax.Array) -> jax.Array:
        """[T, G] group scores -> bool [T, E], True for experts in the topk_group best groups."""
        cfg = self.cfg
        G, E = cfg.n_group, cfg.n_routed_experts
        _, gidx = jax.lax.top_k(group_score, cfg.topk_group)                             # [T, topk_group]
        keep = jnp.any(jax.nn.one_hot(gidx, G, dtype=jnp.bool_), axis=1)                # [T, G]
        return jnp.repeat(keep, E // G, axis=-1)


class Experts(nnx.Module):
    """Routed experts stacked: w_gate [E, D, I], w_up [E, D, I], w_down [E, I, D]."""

    IMPLS = ("ragged_dot", "dense")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs,
                 impl: str = "ragged_dot"):
        if impl not in self.IMPLS:
            raise ValueError(f"Experts impl={impl!r}: expected one of {self.IMPLS}")
        self.impl = impl

        def init(shape):
            return (jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype)

        self.w_gate = nnx.Param(init((num_experts, hidden, intermediate)))
        self.w_up = nnx.Param(init((num_experts, hidden, intermediate)))
        self.w_down = nnx.Param(init((num_experts, intermediate, hidden)))

    # Under expert parallelism a (token, expert) pair routed to another device's experts still needs an index
    # here; it gets weight 0. This call contract has no "no expert" index, so it is expert 0: a wasted row, still
    # exact. (AWQExperts.padding_expert_index skips such pairs.)
    padding_expert_index = 0

    def __call__(self, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array) -> jax.Array:
        """x [T, D], topk_idx int [T, K], topk_w [T, K] -> Σ_k w·down(silu(gate x)·up x)  [T, D] in x.dtype."""
        if self.impl == "dense":
            return self._dense(x, topk_idx, topk_w)
        T, K = topk_idx.shape
        E = self.w_gate.shape[0]
        flat_e = topk_idx.reshape(-1)                                   # [T*K]
        order = jnp.argsort(flat_e, stable=True)                        # assignments grouped by expert
        token = order // K                                              # source token of each sorted row
        group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)  # [E]
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]
        xs = x[token].astype(w_gate.dtype)                              # [T*K, D]
        prec = matmul_precision(w_gate.dtype)

        def rdot(a, w):
            return jax.lax.ragged_dot(a, w, group_sizes, precision=prec, preferred_element_type=jnp.float32)

        h = jax.nn.silu(rdot(xs, w_gate).astype(x.dtype)) * rdot(xs, w_up).astype(x.dtype)   # [T*K, I]
        y = rdot(h.astype(w_down.dtype), w_down).astype(x.dtype)                             # [T*K, D]
        y = y.astype(jnp.float32) * topk_w.reshape(-1)[order][:, None].astype(jnp.float32)
        return jnp.zeros((T, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


    def _dense(self, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array) -> jax.Array:
        E = self.w_gate.shape[0]
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]
        prec = matmul_precision(w_gate.dtype)
        combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(topk_idx, E, dtype=jnp.float32),
                             topk_w.astype(jnp.float32))                                    # [T, E]
        xw = x.astype(w_gate.dtype)
        g = jnp.einsum("td,edi->tei", xw, w_gate, preferred_element_type=jnp.float32, precision=prec)
        u = jnp.einsum("td,edi->tei", xw, w_up, preferred_element_type=jnp.float32, precision=prec)
        h = jax.nn.silu(g.astype(x.dtype)) * u.astype(x.dtype)                                # [T, E, I]
        y = jnp.einsum("tei,eid->ted", h.astype(w_down.dtype), w_down, preferred_element_type=jnp.float32,
                       precision=prec).astype(x.dtype)                                      # [T, E, D]
        return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine, precision=prec).astype(x.dtype)


def make_experts(cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
    """Routed experts of one MoE layer: `Experts`, or `mla_jax.quant.awq.AWQExperts` for AWQ checkpoints."""
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    hf_prefix = f"model.layers.{layer_idx}.mlp.experts"
    q = cfg.quantization
    if q is None or q.excludes(hf_prefix):
        return Experts(E, D, I, dtype=dtype, rngs=rngs)
    return AWQExperts(q, E, D, I, hf_prefix=hf_prefix, dtype=dtype, rngs=rngs)


class MoE(nnx.Module):
    """gate (Router), experts (routed), shared_experts (MLP of n_shared·moe_intermediate, or None)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = make_experts(cfg, layer_idx, dtype=dtype, rngs=rngs)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      f"model.layers.{layer_idx}.mlp.shared_experts", dtype=dtype, rngs=rngs)
        else:
            self.shared_experts = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (topk_idx int32 [T, K], topk_w float32 [T, K])."""
        return self.gate(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]."""
        flat = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = self.route(flat)
        out = self.experts(flat, topk_idx, topk_w).reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
