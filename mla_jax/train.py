"""Train the small embedded DeepSeek-V3-architecture model on the Python standard library's own source.

Everything here is deterministic given the seed and the interpreter's standard library:
  corpus     every .py file under sysconfig.get_paths()["stdlib"] (site-/dist-packages and caches skipped),
             walked in sorted order; files that are not UTF-8 are skipped and counted (the stdlib ships a few
             deliberately mis-encoded test files).
  split      by FILE: sha256(f"{seed}:{relpath}") as a fraction of its range puts a file in test (the lowest
             `heldout_fraction`), validation (the next `valid_fraction`) or train — stable per file, so another
             Python patch release moves no other file's side. Validation picks the checkpoint (the step with the
             best validation loss is kept); test is only scored, and is what eval_ppl reads.
  tokenizer  byte-level BPE trained by `tokenizers` on the training files only; special tokens <|bos|>,
             <|eos|>, <|pad|>. Each file becomes <|bos|> text <|eos|>; files are concatenated into one stream.
  batches    random windows of seq_len+1 tokens of the training stream, drawn on device from a fixed key.
  model      mla_jax.model.DeepseekV3 built from the HF config dict that is written as config.json; fp32 master
             weights, forward in bf16 (the router stays fp32, as the model computes it).
  routing    aux-loss-free balancing (DeepSeek-V3 §2.1.2): after every step each MoE layer's
             e_score_correction_bias moves by ±bias_update_rate toward balance (+ for under-loaded experts).
             The bias is not trained by the optimizer (no gradient reaches it: it only picks experts).
  optimizer  AdamW (b1 0.9, b2 0.95, weight decay on matrices only), global-norm clipping, linear warmup then
             cosine decay to 10 % of the peak over a step count fixed after timing the first steps (or given).
The result is an HF-format directory: config.json (model_type deepseek_v3), model.safetensors (bf16; the
router's e_score_correction_bias in fp32), tokenizer.json, tokenizer_config.json, generation_config.json and
training.json (hyper-parameters, corpus, held-out files with their sha256, loss curve).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

# A code model has no chat format of its own: system/user turns become Python comment lines, assistant turns are
# code followed by <|eos|>, so `--chat` prompts read as "write code for this comment".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user'] %}"
    "{% for line in message['content'].split('\n') %}{{ '# ' + line + '\n' }}{% endfor %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + '\n' }}"
    "{% else %}{{ raise_exception('unsupported role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{% endfor %}"
)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------------------------------------------
# corpus


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_python_files(root: str, max_files: int | None = None) -> tuple[list[SourceFile], list[str]]:
    """All .py files under root in sorted (relative path) order -> (files, relpaths skipped as non-UTF-8)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    rel = sorted(os.path.relpath(p, root) for p in paths)
    files, skipped = [], []
    for r in rel:
        with open(os.path.join(root, r), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(r)
            continue
        if text.strip():
            files.append(SourceFile(r.replace(os.sep, "/"), text))
        if max_files is not None and len(files) >= max_files:
            break
    if not files:
        raise ValueError(f"no UTF-8 .py files found under {root}")
    return files, skipped


def file_hash_fraction(relpath: str, seed: int) -> float:
    """Where the file's hash falls in [0, 1): a stable per-file draw (its position in the list plays no part)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{relpath}".encode()).digest()[:8], "big") / 2**64


def is_heldout(relpath: str, seed: int, fraction: float) -> bool:
    """Test split: the lowest `fraction` of the hash range."""
    return file_hash_fraction(relpath, seed) < fraction


def split_files(files: list[SourceFile], seed: int, test_fraction: float, valid_fraction: float = 0.0):
    """(train, valid, test) by file: test = hash in [0, test_fraction), valid = the next valid_fraction.
    valid picks the checkpoint (best validation loss); test is only ever scored."""
    if not 0.0 < test_fraction < 1.0 or not 0.0 <= valid_fraction < 1.0 - test_fraction:
        raise ValueError(f"need 0 < test_fraction < 1 and 0 <= valid_fraction < 1 - test_fraction, got "
                         f"{test_fraction}, {valid_fraction}")
    train, valid, test = [], [], []
    for f in files:
        u = file_hash_fraction(f.relpath, seed)
        (test if u < test_fraction else valid if u < test_fraction + valid_fraction else train).append(f)
    if not train or not test or (valid_fraction and not valid):
        raise ValueError(f"split of {len(files)} files left {len(train)} train / {len(valid)} validation / "
                         f"{len(test)} test files; use more files or other fractions")
    return train, valid, test


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization regex) with SPECIAL_TOKENS at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE training reached only {tok.get_vocab_size()} tokens of the {vocab_size} asked for; "
                         f"the corpus is too small for this vocabulary")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": None,  # filled by the caller
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def token_stream(tok, files: list[SourceFile]) -> np.ndarray:
    """<|bos|> file <|eos|> for each file, concatenated -> int32 [N]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.extend(([bos], e.ids, [eos]))
    return np.fromiter((i for p in parts for i in p), dtype=np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows [N, seq_len+1] that share one boundary token, so every token of the covered stream
    after the first is predicted exactly once."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"a held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


# ----------------------------------------------------------------------------------------------------------------
# model config


def tiny_hf_config(vocab_size: int, *, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                   q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                   intermediate_size=768, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=2,
                   n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   first_k_dense_replace=1, max_position_embeddings=2048, rope_original_max=512, rope_factor=4.0,
                   bos_token_id=0, eos_token_id=1, pad_token_id=2) -> dict:
    """An HF DeepseekV3Config dict for the tiny model (the real V3's structure at small width)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "moe_intermediate_size": moe_intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_attention_heads,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "n_shared_experts": n_shared_experts,
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": routed_scaling_factor,
        "first_k_dense_replace": first_k_dense_replace,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": rope_factor, "original_max_position_embeddings": rope_original_max,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def count_params(hf_config: dict) -> dict:
    """Parameter counts by kind, from the config alone (also the bytes the shipped AWQ checkpoint will need)."""
    c = hf_config
    D, H, L, V = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["vocab_size"]
    N, R, Vd, C, Q = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
    E, I, S = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    attn = (D * Q + Q * H * (N + R) if Q else D * H * (N + R)) + D * (C + R) + C * H * (N + Vd) + H * Vd * D
    k = c["first_k_dense_replace"]
    linears = L * attn + k * 3 * D * c["intermediate_size"] + (L - k) * (E + S) * 3 * D * I
    router = (L - k) * (E * D + E)
    norms = L * (2 * D + C + (Q or 0)) + D
    embed = 2 * V * D
    active = L * attn + k * 3 * D * c["intermediate_size"] + (L - k) * (c["num_experts_per_tok"] + S) * 3 * D * I
    return {"decoder_linears": linears, "router": router, "norms": norms, "embed_and_lm_head": embed,
            "total": linears + router + norms + embed, "active_per_token_linears": active}


# ----------------------------------------------------------------------------------------------------------------
# forward, loss, optimizer


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
        import optax
        from flax import nnx

        from mla_jax.model import DeepseekV3

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
        from flax import nnx

        params = jax.tree.map(lambda p: p.astype(dtype), self.params)
        return nnx.merge(self.graphdef, self.bias, self.router, params)


# ----------------------------------------------------------------------------------------------------------------
# export


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """HF DeepseekV3ForCausalLM tensor names -> numpy arrays (torch layouts: Linear weight [out, in])."""
    cfg = model.cfg
    out: dict[str, np.ndarray] = {}

    def lin(name, linear):
        out[f"{name}.weight"] = np.asarray(linear.kernel[...]).T

    def mlp(name, m):
        for p in ("gate_proj", "up_proj", "down_proj"):
            lin(f"{name}.{p}", getattr(m, p))

    out["model.embed_tokens.weight"] = np.asarray(model.embed_tokens.embedding[...])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = np.asarray(layer.input_layernorm.weight[...])
        out[f"{p}.post_attention_layernorm.weight"] = np.asarray(layer.post_attention_layernorm.weight[...])
        a = layer.self_attn
        if cfg.q_lora_rank is None:
            lin(f"{p}.self_attn.q_proj", a.q_proj)
        else:
            lin(f"{p}.self_attn.q_a_proj", a.q_a_proj)
            out[f"{p}.self_attn.q_a_layernorm.weight"] = np.asarray(a.q_a_layernorm.weight[...])
            lin(f"{p}.self_attn.q_b_proj", a.q_b_proj)
        lin(f"{p}.self_attn.kv_a_proj_with_mqa", a.kv_a_proj_with_mqa)
        out[f"{p}.self_attn.kv_a_layernorm.weight"] = np.asarray(a.kv_a_layernorm.weight[...])
        lin(f"{p}.self_attn.kv_b_proj", a.kv_b_proj)
        lin(f"{p}.self_attn.o_proj", a.o_proj)
        if cfg.is_moe_layer(i):
            m = layer.mlp
            out[f"{p}.mlp.gate.weight"] = np.asarray(m.gate.kernel[...]).T
            if cfg.topk_method == "noaux_tc":
                out[f"{p}.mlp.gate.e_score_correction_bias"] = np.asarray(m.gate.e_score_correction_bias[...])
            w_gate, w_up, w_down = (np.asarray(m.experts.w_gate[...]), np.asarray(m.experts.w_up[...]),
                                    np.asarray(m.experts.w_down[...]))
            for j in range(cfg.n_routed_experts):
                out[f"{p}.mlp.experts.{j}.gate_proj.weight"] = w_gate[j].T
                out[f"{p}.mlp.experts.{j}.up_proj.weight"] = w_up[j].T
                out[f"{p}.mlp.experts.{j}.down_proj.weight"] = w_down[j].T
            if m.shared_experts is not None:
                mlp(f"{p}.mlp.shared_experts", m.shared_experts)
        else:
            mlp(f"{p}.mlp", layer.mlp)
    out["model.norm.weight"] = np.asarray(model.norm.weight[...])
    if model.lm_head is not None:
        lin("lm_head", model.lm_head)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf_checkpoint(model, hf_config: dict, tok, out_dir: str, *, training_info: dict | None = None,
                       dtype: str = "bfloat16") -> list[str]:
    """Write an HF-format model directory; returns the file names written. Weights in `dtype`, except the
    router's e_score_correction_bias, which stays fp32 as in DeepSeek-V3's release."""
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: (v.astype(np.float32) if k.endswith("e_score_correction_bias") else v.astype(np_dtype))
               for k, v in hf_state_dict(model).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(hf_config, torch_dtype=dtype)
    files = {"config.json": config}
    tcfg = tokenizer_config()
    tcfg["model_max_length"] = hf_config["max_position_embeddings"]
    files["tokenizer_config.json"] = tcfg
    files["generation_config.json"] = {
        "bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"],
        "pad_token_id": hf_config["pad_token_id"], "do_sample": True, "temperature": 0.8, "top_p": 0.95,
    }
    if training_info is not None:
        files["training.json"] = training_info
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return ["model.safetensors", "tokenizer.json", *files]


# ----------------------------------------------------------------------------------------------------------------
# generation for a quick look (full forward, no cache: the engine is the real path)


class TextSampler:
    """Greedy (temperature 0) or nucleus sampling by re-running the full forward on a fixed-size window: one
    compile for every prompt and setting. For a quick look at the model during training; the engine is the real
    generation path."""

    def __init__(self, model, window: int = 256):
        from flax import nnx

        graphdef, self.state = nnx.split(model)
        self.window = window

        @jax.jit
        def next_token(state, ids, length, key, temperature, top_p):
            logits = nnx.merge(graphdef, state)(ids)[0, length - 1]
            probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6))
            order = jnp.argsort(-probs)
            sorted_p = probs[order]
            keep = jnp.cumsum(sorted_p) - sorted_p < top_p  # smallest prefix whose mass reaches top_p
            pick = order[jax.random.categorical(key, jnp.where(keep, jnp.log(sorted_p), -jnp.inf))]
            return jnp.where(temperature > 0, pick, jnp.argmax(logits)).astype(jnp.int32)

        self._next_token = next_token

    def continue_ids(self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
        ids, out = list(prompt_ids), []
        key = jax.random.key(seed)
        for i in range(max_new_tokens):
            ctx = ids[-self.window:]
            buf = np.zeros((1, self.window), np.int32)
            buf[0, :len(ctx)] = ctx
            t = int(self._next_token(self.state, jnp.asarray(buf), len(ctx), jax.random.fold_in(key, i),
                                     jnp.float32(temperature), jnp.float32(top_p)))
            ids.append(t)
            out.append(t)
            if eos_id is not None and t == eos_id:
                break
        return out


# ----------------------------------------------------------------------------------------------------------------
# the whole run


@dataclasses.dataclass
class RunOptions:
    out_dir: str
    vocab_size: int = 4096
    model_overrides: dict = dataclasses.field(default_factory=dict)
    hp: TrainHParams = dataclasses.field(default_factory=TrainHParams)
    heldout_fraction: float = 0.03       # test files (scored only)
    valid_fraction: float = 0.02         # validation files (pick the best step)
    train_seconds: float | None = 180.0  # time budget for the training loop (calibrates the step count)
    steps: int | None = None              # exact step count (overrides train_seconds for the schedule)
    deadline_seconds: float | None = None  # stop training this long after the run started, whatever happens
    reserve_seconds: float = 45.0         # kept free before the deadline for the final eval and export
    log_every: int = 50
    eval_every: int = 250
    eval_windows: int = 64                # validation windows for the periodic check
    final_eval_windows: int | None = None  # None: the whole test stream
    eval_batch_size: int = 32
    corpus_root: str | None = None
    corpus_label: str | None = None       # what corpus_root is, for training.json (e.g. a copied stdlib)
    max_files: int | None = None
    sample_prompts: tuple[str, ...] = ("def fibonacci(n):", "import os\n\n\nclass", "    def __repr__(self):")
    sample_tokens: int = 96


def run_training(opts: RunOptions, log: Callable[[str], None] = print) -> dict:
    from mla_jax.config import ModelConfig

    t_start = time.time()
    hp = opts.hp
    deadline = None if opts.deadline_seconds is None else t_start + opts.deadline_seconds

    root = opts.corpus_root or stdlib_root()
    files, skipped = read_python_files(root, opts.max_files)
    train_files, valid_files, held_files = split_files(files, hp.seed, opts.heldout_fraction, opts.valid_fraction)
    log(f"corpus: {len(files)} files ({sum(len(f.text) for f in files) / 1e6:.1f} M chars) under {root} "
        f"(this is Python {platform.python_version()}); {len(skipped)} non-UTF-8 skipped; {len(train_files)} train "
        f"/ {len(valid_files)} validation / {len(held_files)} test files")

    t0 = time.time()
    tok = train_tokenizer((f.text for f in train_files), opts.vocab_size)
    train_stream = token_stream(tok, train_files)
    held_stream = token_stream(tok, held_files)
    valid_stream = token_stream(tok, valid_files) if valid_files else None
    train_bytes = sum(len(f.text.encode()) for f in train_files)
    log(f"tokenizer: vocab {tok.get_vocab_size()} in {time.time() - t0:.1f}s; train {len(train_stream):,} tokens "
        f"({train_bytes / len(train_stream):.2f} bytes/token), validation "
        f"{0 if valid_stream is None else len(valid_stream):,}, test {len(held_stream):,} tokens")
    if len(train_stream) < hp.seq_len + 2:
        raise ValueError(f"training stream of {len(train_stream)} tokens is shorter than one window")

    hf_config = tiny_hf_config(opts.vocab_size, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
                               pad_token_id=tok.token_to_id(PAD), **opts.model_overrides)
    cfg = ModelConfig.from_hf_dict(hf_config)
    counts = count_params(hf_config)
    dims = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_shared_experts", "moe_intermediate_size", "intermediate_size")
    log(f"model: {json.dumps({k: hf_config[k] for k in dims})}")
    log(f"params: {counts['total'] / 1e6:.2f} M total ({counts['decoder_linears'] / 1e6:.2f} M in decoder linears, "
        f"{counts['embed_and_lm_head'] / 1e6:.2f} M embed+lm_head); devices {jax.devices()}")

    trainer = Trainer(cfg, hp)
    stream = jnp.asarray(train_stream)
    data_key = jax.random.key(hp.seed + 1)
    check_windows = eval_windows(valid_stream if valid_stream is not None else held_stream, hp.seq_len,
                                 opts.eval_windows)
    check_name = "validation" if valid_stream is not None else "test"

    curve: list[dict] = []
    best = {"loss": math.inf, "step": 0, "state": None}
    total_steps = opts.steps or 10**9
    calibrated = opts.steps is not None
    step = 0
    t_loop = time.time()
    t_compile = None
    pending: list[dict] = []
    stop_reason = "steps"
    while step < total_steps:
        metrics = trainer.step(stream, data_key, step, total_steps)
        pending.append(metrics)
        step += 1
        if step == 1:
            jax.block_until_ready(metrics["loss"])
            t_compile = time.time() - t_loop
            log(f"step 1 (compile + first step) {t_compile:.1f}s, loss {float(metrics['loss']):.3f}")
            t_timed = time.time()
        if not calibrated and step == 21:
            jax.block_until_ready(metrics["loss"])
            per_step = (time.time() - t_timed) / 20
            budget = opts.train_seconds - (time.time() - t_loop)
            if deadline is not None:
                budget = min(budget, deadline - opts.reserve_seconds - time.time())
            total_steps = max(step + 1, step + int(budget / per_step * 0.95))
            calibrated = True
            log(f"calibrated: {per_step * 1e3:.1f} ms/step ({hp.batch_size * hp.seq_len / per_step:,.0f} tok/s) "
                f"-> {total_steps} steps")
        if step % opts.log_every == 0 or step == total_steps:
            ms = jax.device_get(pending)
            pending = []
            entry = {"step": step, "time_s": round(time.time() - t_loop, 2),
                     "loss": float(np.mean([m["loss"] for m in ms])),
                     "grad_norm": float(np.mean([m["grad_norm"] for m in ms])),
                     "lr": float(ms[-1]["lr"]), "max_expert_load": float(np.max([m["max_load"] for m in ms]))}
            if step % opts.eval_every == 0 or step == total_steps:
                entry["valid_loss"] = trainer.eval_loss(check_windows, opts.eval_batch_size)
                if entry["valid_loss"] < best["loss"]:
                    best = {"loss": entry["valid_loss"], "step": step,
                            "state": jax.tree.map(jnp.copy, (trainer.router, trainer.params, trainer.bias))}
            curve.append(entry)
            log("step {step:6d} {time_s:7.1f}s loss {loss:.4f} gnorm {grad_norm:.3f} lr {lr:.2e} max-load "
                "{max_expert_load:.2f}".format(**entry)
                + (f" {check_name} {entry['valid_loss']:.4f}" if "valid_loss" in entry else ""))
        now = time.time()
        if opts.train_seconds is not None and not opts.steps and now - t_loop > opts.train_seconds * 1.1:
            stop_reason = "train_seconds"
            break
        if deadline is not None and now > deadline - opts.reserve_seconds:
            stop_reason = "deadline"
            break
    train_time = time.time() - t_loop
    if stop_reason != "steps":
        log(f"stopped early at step {step} of {total_steps} ({stop_reason})")

    t0 = time.time()
    final_windows = eval_windows(held_stream, hp.seq_len, opts.final_eval_windows)
    last_test_loss = trainer.eval_loss(final_windows, opts.eval_batch_size)
    if best["state"] is not None and best["step"] != step:
        trainer.router, trainer.params, trainer.bias = best["state"]
        log(f"keeping step {best['step']} ({check_name} {best['loss']:.4f}); the last step {step} scored test "
            f"{last_test_loss:.4f}")
        held_loss = trainer.eval_loss(final_windows, opts.eval_batch_size)
    else:
        held_loss = last_test_loss
    best.pop("state")
    held_tokens = final_windows.shape[0] * hp.seq_len
    held_bytes_per_token = sum(len(f.text.encode()) for f in held_files) / len(held_stream)
    log(f"test (held-out files): loss {held_loss:.4f} nats/token, ppl {math.exp(held_loss):.3f}, "
        f"{held_loss / math.log(2) / held_bytes_per_token:.3f} bits/byte over {held_tokens:,} tokens "
        f"({time.time() - t0:.1f}s)")

    model = trainer.model(jnp.dtype(hp.compute_dtype))
    samples = []
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    sampler = TextSampler(model)
    for prompt in opts.sample_prompts:
        ids = [bos] + tok.encode(prompt, add_special_tokens=False).ids
        greedy = tok.decode(sampler.continue_ids(ids, opts.sample_tokens, eos_id=eos))
        sampled = tok.decode(sampler.continue_ids(ids, opts.sample_tokens, temperature=0.8, top_p=0.95,
                                                  seed=hp.seed, eos_id=eos))
        samples.append({"prompt": prompt, "greedy": greedy, "sampled_t0.8_p0.95": sampled})
        log(f"--- greedy, {prompt!r}:\n{prompt}{greedy}\n--- sampled (T=0.8, top-p 0.95):\n{prompt}{sampled}\n---")

    info = {
        "script": "scripts/train_tiny.py",
        "python": platform.python_version(), "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
        "corpus": {"root": root, "label": opts.corpus_label or f"stdlib of Python {platform.python_version()}",
                   "files": len(files), "non_utf8_skipped": len(skipped),
                   "train_files": len(train_files), "validation_files": len(valid_files),
                   "heldout_files": len(held_files), "train_tokens": int(len(train_stream)),
                   "validation_tokens": 0 if valid_stream is None else int(len(valid_stream)),
                   "heldout_tokens": int(len(held_stream)), "heldout_fraction": opts.heldout_fraction,
                   "valid_fraction": opts.valid_fraction, "max_files": opts.max_files,
                   "bytes_per_token": train_bytes / len(train_stream)},
        "heldout": [{"path": f.relpath, "sha256": f.sha256} for f in held_files],
        "validation": [{"path": f.relpath, "sha256": f.sha256} for f in valid_files],
        "hparams": dataclasses.asdict(hp), "vocab_size": opts.vocab_size, "params": counts,
        "steps": step, "planned_steps": total_steps if calibrated else None, "stop_reason": stop_reason,
        "kept_step": best["step"] or step, "kept_valid_loss": best["loss"] if best["step"] else None,
        "train_seconds": round(train_time, 1), "compile_seconds": round(t_compile or 0.0, 1),
        "tokens_seen": step * hp.batch_size * hp.seq_len,
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "heldout_loss": held_loss, "heldout_ppl": math.exp(held_loss), "heldout_eval_tokens": int(held_tokens),
        "heldout_bits_per_byte": held_loss / math.log(2) / held_bytes_per_token,
        "last_step_heldout_loss": last_test_loss,
        "curve": curve, "samples": samples,
        "bias_update": f"DeepSeek-V3 aux-loss-free rule, gamma={hp.bias_update_rate} per step",
    }
    written = save_hf_checkpoint(model, hf_config, tok, opts.out_dir, training_info=info)
    size = sum(os.path.getsize(os.path.join(opts.out_dir, f)) for f in written)
    log(f"wrote {opts.out_dir}: {', '.join(written)} ({size / 2**20:.2f} MiB); total run {time.time() - t_start:.0f}s")
    return info


# ----------------------------------------------------------------------------------------------------------------
# held-out data of a trained checkpoint (for evaluation)


def load_heldout_files(model_dir: str, corpus_root: str | None = None) -> tuple[list[SourceFile], dict]:
    """The held-out files named in model_dir/training.json, read from this interpreter's stdlib (or corpus_root).

    A file whose sha256 differs from the recorded one (another Python patch release) is left out and counted,
    never silently substituted. Returns (files, {"listed", "matched", "changed", "missing"})."""
    info_path = os.path.join(model_dir, "training.json")
    if not os.path.isfile(info_path):
        raise FileNotFoundError(f"{info_path} not found: the held-out split is recorded there by "
                                f"scripts/train_tiny.py; evaluate a checkpoint it wrote")
    with open(info_path) as f:
        info = json.load(f)
    root = corpus_root or stdlib_root()
    files, changed, missing = [], [], []
    for entry in info["heldout"]:
        path = os.path.join(root, entry["path"])
        if not os.path.isfile(path):
            missing.append(entry["path"])
            continue
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
        f_ = SourceFile(entry["path"], text)
        if f_.sha256 != entry["sha256"]:
            changed.append(entry["path"])
            continue
        files.append(f_)
    stats = {"listed": len(info["heldout"]), "matched": len(files), "changed": changed, "missing": missing,
             "root": root}
    if not files:
        raise ValueError(f"none of the {len(info['heldout'])} held-out files of {info_path} were found unchanged "
                         f"under {root} (changed {len(changed)}, missing {len(missing)}); pass the corpus root "
                         f"of the Python that trained the model")
    return files, stats
