"""Forward with expert loads, loss, learning-rate schedule and the `Trainer` (jitted train and eval steps).

  model      mla_jax.model.DeepseekV3 built from the HF config dict that is written as config.json; fp32 master
             weights, forward in `TrainHParams.compute_dtype` (bf16 by default; the router stays fp32, as the
             model computes it).
  batches    random windows of seq_len+1 tokens of the training stream, drawn on device from a fixed key.
  routing    aux-loss-free balancing (DeepSeek-V3 §2.1.2): after every step each MoE layer's
             e_score_correction_bias moves by ±bias_update_rate toward balance (+ for under-loaded experts).
             The bias is not trained by the optimizer (no gradient reaches it: it only picks experts).
  optimizer  AdamW (b1 0.9, b2 0.95, weight decay on matrices only), global-norm clipping, linear warmup then
             cosine decay to 10 % of the peak over a step count fixed after timing the first steps (or given).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.model import DeepseekV3


def forward_with_loads(model, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """model(input_ids) written out layer by layer so each MoE layer's expert load can be read.

    Same math as DeepseekV3.__call__ (tests check equality). Returns (logits float32 [B, S, V],
    loads float32 [num_moe_layers, E]: the fraction of (token, slot) assignments that went to each expert)."""
    B, S = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    h = model.embed(input_ids)
    loads = []
    for i, layer in enumerate(model.layers):
        h = h + layer.self_attn(layer.input_layernorm(h), positions)
        x = layer.post_attention_layernorm(h)
        if model.cfg.is_moe_layer(i):
            topk_idx, _ = layer.mlp.route(x.reshape(-1, x.shape[-1]))
            counts = jnp.zeros((model.cfg.n_routed_experts,), jnp.float32).at[topk_idx.reshape(-1)].add(1.0)
            loads.append(counts / topk_idx.size)
        h = h + layer.mlp(x)
    logits = model.logits(h)
    loads = jnp.stack(loads) if loads else jnp.zeros((0, 0), jnp.float32)
    return logits, jax.lax.stop_gradient(loads)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood in fp32: logits [..., V], targets int [...] -> [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def lr_at(step, total_steps, peak_lr: float, warmup_steps: int, final_fraction: float = 0.1):
    """Linear warmup to peak_lr, then cosine decay to final_fraction·peak_lr at total_steps (jnp or float)."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total_steps, jnp.float32), warmup_steps + 1.0)
    warm = peak_lr * (step + 1.0) / warmup_steps
    progress = jnp.clip((step - warmup_steps) / (total - warmup_steps), 0.0, 1.0)
    cos = peak_lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < warmup_steps, warm, cos)


@dataclasses.dataclass(frozen=True)
class TrainHParams:
    seed: int = 0
    batch_size: int = 64
    seq_len: int = 512
    peak_lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    bias_update_rate: float = 1e-3   # DeepSeek-V3's gamma
    compute_dtype: str = "bfloat16"


def _is_router(path) -> bool:
    return "gate" in path  # exactly the MoE router module (gate_proj is a different path element)


class Trainer:
    """Holds the split model (fp32 master params), the optimizer and the jitted train/eval steps."""

    def __init__(self, cfg, hp: TrainHParams):
        import optax  # the `train` extra: only the optimizer needs it

        self.cfg, self.hp = cfg, hp
        model = DeepseekV3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(params=hp.seed))
        bias_filter = nnx.All(nnx.Param, nnx.PathContains("e_score_correction_bias"))
        router_filter = nnx.All(nnx.Param, lambda path, _: _is_router(path))
        self.graphdef, self.bias, self.router, self.params = nnx.split(model, bias_filter, router_filter, nnx.Param)
        compute_dtype = jnp.dtype(hp.compute_dtype)

        decay_mask = lambda tree: jax.tree.map(lambda p: p.ndim >= 2, tree)  # noqa: E731 — matrices only
        self.tx = optax.chain(
            optax.clip_by_global_norm(hp.clip_norm),
            optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
            optax.add_decayed_weights(hp.weight_decay, mask=decay_mask),
        )
        self.opt_state = self.tx.init((self.router, self.params))
        graphdef = self.graphdef

        def merged(bias, router, params, cast: bool):
            if cast:
                params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
            return nnx.merge(graphdef, bias, router, params)

        def loss_fn(trainable, bias, tokens):
            router, params = trainable
            logits, loads = forward_with_loads(merged(bias, router, params, True), tokens[:, :-1])
            return token_nll(logits, tokens[:, 1:]).mean(), loads

        def train_step(router, params, bias, opt_state, stream, data_key, step, total_steps):
            key = jax.random.fold_in(data_key, step)
            starts = jax.random.randint(key, (hp.batch_size,), 0, stream.shape[0] - hp.seq_len - 1)
            tokens = stream[starts[:, None] + jnp.arange(hp.seq_len + 1)[None, :]]
            (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)((router, params), bias, tokens)
            grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
            updates, opt_state = self.tx.update(grads, opt_state, (router, params))
            lr = lr_at(step, total_steps, hp.peak_lr, hp.warmup_steps)
            router, params = jax.tree.map(lambda p, u: p - lr * u, (router, params), updates)
            # Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.
            model = merged(bias, router, params, False)
            moe_layers = [l for i, l in enumerate(model.layers) if cfg.is_moe_layer(i)]
            for layer, load in zip(moe_layers, loads):
                b = layer.mlp.gate.e_score_correction_bias
                b[...] = b[...] + hp.bias_update_rate * jnp.sign(jnp.mean(load) - load)
            bias = nnx.state(model, bias_filter)
            max_load = jnp.max(loads) * cfg.n_routed_experts if cfg.n_routed_experts else jnp.float32(0)
            return router, params, bias, opt_state, {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                                                     "max_load": max_load}

        def eval_nll(router, params, bias, windows, row_mask):
            logits, _ = forward_with_loads(merged(bias, router, params, True), windows[:, :-1])
            return (token_nll(logits, windows[:, 1:]).sum(-1) * row_mask).sum()

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1, 2, 3))
        self._eval_nll = jax.jit(eval_nll)

    def step(self, stream, data_key, step: int, total_steps: int) -> dict:
        self.router, self.params, self.bias, self.opt_state, metrics = self._train_step(
            self.router, self.params, self.bias, self.opt_state, stream, data_key, jnp.int32(step),
            jnp.int32(total_steps))
        return metrics

    def eval_loss(self, windows: np.ndarray, batch_size: int) -> float:
        """Mean per-token NLL (nats) over all windows [N, S+1]. The last batch is padded with copies of its last
        row that carry zero weight, so one compiled shape serves every batch."""
        total, count = 0.0, 0
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            n = len(chunk)
            mask = np.zeros((batch_size,), np.float32)
            mask[:n] = 1.0
            if n < batch_size:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - n, axis=0)])
            total += float(self._eval_nll(self.router, self.params, self.bias, jnp.asarray(chunk), jnp.asarray(mask)))
            count += n * (windows.shape[1] - 1)
        return total / count

    def model(self, dtype=jnp.float32):
        """The trained model as an NNX module (params in `dtype`; the router and its bias stay fp32)."""
        params = jax.tree.map(lambda p: p.astype(dtype), self.params)
        return nnx.merge(self.graphdef, self.bias, self.router, params)
