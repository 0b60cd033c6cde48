"""Model configuration parsed from a Hugging Face `config.json` (model_type deepseek_v3 / deepseek_v2).

`ModelConfig` is a frozen, hashable dataclass, so it can be a `jax.jit` static argument. Field names follow HF.
Keys that change the math and that we do not implement raise `ValueError` naming the key; keys that only matter
for training or bookkeeping are accepted and ignored (listed in `_IGNORED_KEYS`); other unknown keys are logged.

Where HF transformers hard-codes what DeepSeek's own code reads from the config, we read the config (identical
for every published DeepSeek-V2/V3 checkpoint): `scoring_func`/`topk_method` for deepseek_v3 (HF: always sigmoid
+ noaux_tc), `norm_topk_prob` for deepseek_v2 (HF: never renormalises), `moe_layer_freq` (HF: ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from mla_jax.checkpoint.errors import read_json

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
_YARN_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    "mscale", "mscale_all_dim", "attention_factor", "truncate",
}

# Keys that do not change inference math (training-only, bookkeeping, generation defaults).
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "attention_dropout", "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp", "output_router_logits",
    "router_aux_loss_coef", "pad_token_id", "_name_or_path", "name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "generation_config", "task_specific_params", "use_return_dict",
    "head_dim", "qk_head_dim", "num_mtp_layers", "model_type", "_attn_implementation", "attn_implementation",
    "max_window_layers", "use_sliding_window", "sliding_window", "ignore_keys_at_rope_validation",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "prefix", "finetuning_task",
    "decoder_start_token_id", "sep_token_id", "bad_words_ids", "min_length", "max_length", "do_sample",
    "num_beams", "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "torchscript",
    "pruned_heads", "is_decoder",
}


@dataclasses.dataclass(frozen=True)
class AWQConfig:
    """AutoAWQ GEMM quantization (docs/architecture.md §6): 4-bit weights, per-group scales and zero points."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf_dict(cls, q: dict[str, Any]) -> "AWQConfig":
        method = str(q.get("quant_method", "")).lower()
        if method != "awq":
            raise ValueError(
                f"config.json quantization_config.quant_method={q.get('quant_method')!r} is not supported; only "
                f"'awq' (AutoAWQ GEMM, 4-bit) checkpoints or unquantized bf16/fp16/fp32 checkpoints can be loaded. "
                f"Convert the checkpoint (e.g. dequantize to bf16, or quantize with AutoAWQ) first."
            )
        bits = int(q.get("bits", q.get("w_bit", 4)))
        group_size = int(q.get("group_size", q.get("q_group_size", 128)))
        zero_point = bool(q.get("zero_point", True))
        version = str(q.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"quantization_config.bits={bits}: only 4-bit AWQ is supported.")
        if version != "gemm":
            raise ValueError(
                f"quantization_config.version={version!r}: only the AutoAWQ 'gemm' packing is supported."
            )
        if group_size <= 0:
            raise ValueError(f"quantization_config.group_size={group_size}: must be a positive group size.")
        skip = q.get("modules_to_not_convert") or ()
        return cls(bits=bits, group_size=group_size, zero_point=zero_point, version=version,
                   modules_to_not_convert=tuple(str(s) for s in skip))

    def excludes(self, hf_module_name: str) -> bool:
        """True when `hf_module_name` stays unquantized (AutoAWQ matches by substring of the module name)."""
        return any(m in hf_module_name for m in self.modules_to_not_convert)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    num_experts_per_tok: int | None
    n_shared_experts: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    # Sorted (key, value) items of the resolved rope scaling dict (yarn), or None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    num_nextn_predict_layers: int = 0
    model_type: str = "deepseek_v3"
    quantization: AWQConfig | None = None

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 · mscale², mscale from YaRN's mscale_all_dim (HF `yarn_apply_mscale`)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling_dict
        if rs is not None:
            mscale_all_dim = rs.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_get_mscale(rs["factor"], mscale_all_dim)
                scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts is not None
            and self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path} not found: expected a Hugging Face model directory with config.json; "
                                    "give the directory that holds the model's config.json")
        return cls.from_hf_dict(read_json(cfg_path, "the model's config.json"))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _parse_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config dict (legacy `rope_scaling` + `rope_theta` keys) that parses back to this config."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "rope_scaling":
                v = dict(v) if v is not None else None
            elif f.name == "quantization":
                continue
            elif f.name == "eos_token_id" and isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        if self.quantization is not None:
            q = dataclasses.asdict(self.quantization)
            q["modules_to_not_convert"] = list(q["modules_to_not_convert"])
            out["quantization_config"] = {"quant_method": "awq", **q}
        return out


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _unsupported(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json key {key!r}={value!r} is not supported: {why}")


def _resolve_rope(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """Legacy `rope_scaling` + `rope_theta` or transformers-5 `rope_parameters` -> (theta, yarn items | None).

    Like HF, `rope_scaling` wins when both are present and non-empty."""
    legacy = d.get("rope_scaling")
    params = d.get("rope_parameters")
    if legacy:
        src_key, rp = "rope_scaling", dict(legacy)
    elif params:
        src_key, rp = "rope_parameters", dict(params)
    else:
        src_key, rp = "rope_scaling", {}
    if rp and any(isinstance(v, dict) for v in rp.values()):
        raise _unsupported(src_key, rp, "per-layer-type RoPE parameters are not used by DeepSeek models")
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    for prf in (d.get("partial_rotary_factor"), rp.get("partial_rotary_factor")):
        if prf is not None and float(prf) != 1.0:
            raise _unsupported("partial_rotary_factor", prf, "DeepSeek MLA rotates the whole qk_rope_head_dim")
    if rope_type == "default":
        extra = set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if extra:
            raise _unsupported(f"{src_key}.{sorted(extra)[0]}", rp[sorted(extra)[0]],
                               "unknown key for rope_type 'default'")
        return theta, None
    if rope_type != "yarn":
        raise _unsupported(f"{src_key}.rope_type", rope_type, "only 'yarn' rope scaling (or none) is implemented")
    unknown = set(rp) - _YARN_KEYS - {"partial_rotary_factor"}
    if unknown:
        k = sorted(unknown)[0]
        raise _unsupported(f"{src_key}.{k}", rp[k], "unknown YaRN parameter")
    y: dict[str, Any] = {"rope_type": "yarn"}
    # As HF standardize_rope_params: a top-level original_max_position_embeddings wins, else the rope dict's, else
    # max_position_embeddings; a missing factor is max_position_embeddings / original_max_position_embeddings.
    max_pos = int(d.get("max_position_embeddings", 4096))
    orig = int(d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or max_pos)
    y["original_max_position_embeddings"] = orig
    factor = rp.get("factor")
    y["factor"] = float(factor) if factor is not None else max_pos / orig
    for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if rp.get(k) is not None:
            y[k] = float(rp[k])
    if "truncate" in rp:
        y["truncate"] = bool(rp["truncate"])
    return theta, tuple(sorted(y.items()))


def _parse_hf_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    v3 = model_type == "deepseek_v3"

    def req(key: str) -> Any:
        if d.get(key) is None:
            raise ValueError(f"config.json is missing required key {key!r} (model_type {model_type})")
        return d[key]

    # Keys that change the math and that we do not implement.
    if d.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", d["hidden_act"], "only 'silu' gated MLPs are implemented")
    if d.get("attention_bias", False):
        raise _unsupported("attention_bias", d["attention_bias"], "MLA projections without bias only")
    if d.get("mlp_bias", False):
        raise _unsupported("mlp_bias", d["mlp_bias"], "MLP projections without bias only")
    for k in ("index_topk", "index_head_dim", "index_n_heads"):  # DeepSeek-V3.2 sparse attention
        if k in d:
            raise _unsupported(k, d[k], "DeepSeek sparse attention (V3.2 indexer) is not implemented")
    heads = int(req("num_attention_heads"))
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise _unsupported("num_key_value_heads", kv_heads,
                           f"MLA expands the latent to all {heads} heads; num_key_value_heads must equal it")
    if d.get("kv_lora_rank") is None:
        raise _unsupported("kv_lora_rank", None, "MLA needs a latent KV rank")

    scoring = d.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring not in SCORING_FUNCS:
        raise _unsupported("scoring_func", scoring, f"expected one of {SCORING_FUNCS}")
    topk_method = d.get("topk_method", "noaux_tc" if v3 else "greedy")
    if topk_method not in TOPK_METHODS:
        raise _unsupported("topk_method", topk_method, f"expected one of {TOPK_METHODS}")

    n_routed = d.get("n_routed_experts")
    n_routed = int(n_routed) if n_routed is not None else None
    n_group = int(d.get("n_group") or 1)
    topk_group = int(d.get("topk_group") or 1)
    top_k = d.get("num_experts_per_tok")
    if n_routed:
        if top_k is None:
            raise ValueError("config.json has n_routed_experts but no num_experts_per_tok")
        if n_routed % n_group:
            raise _unsupported("n_group", n_group, f"n_routed_experts={n_routed} must be divisible by it")
        if topk_method in ("noaux_tc", "group_limited_greedy") and not 1 <= topk_group <= n_group:
            raise _unsupported("topk_group", topk_group, f"must be in [1, n_group={n_group}]")
        if int(top_k) > n_routed:
            raise _unsupported("num_experts_per_tok", top_k, f"more than n_routed_experts={n_routed}")
        if topk_method == "noaux_tc" and n_routed // n_group < 2:
            raise _unsupported("n_group", n_group, "noaux_tc scores a group by its top-2 experts; "
                                                   "each group needs >= 2 experts")

    rope_theta, rope_scaling = _resolve_rope(d)
    # deepseek_v2 rotates interleaved pairs (complex multiply) unconditionally; deepseek_v3 reads rope_interleave.
    rope_interleave = bool(d.get("rope_interleave", True)) if v3 else True

    quant = None
    if d.get("quantization_config"):
        quant = AWQConfig.from_hf_dict(d["quantization_config"])

    nextn = int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0)
    if nextn:
        logger.info("config: skipping %d multi-token-prediction (MTP) layer(s) model.layers.%d.* — not used for "
                    "next-token inference", nextn, int(req("num_hidden_layers")))

    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(int(e) for e in eos)

    known = {f.name for f in dataclasses.fields(ModelConfig)} | {
        "rope_parameters", "quantization_config", "hidden_act", "attention_bias", "mlp_bias", "num_key_value_heads",
        "partial_rotary_factor", "num_nextn_predict_layers", "original_max_position_embeddings",
    }
    unknown = sorted(set(d) - known - _IGNORED_KEYS)
    if unknown:
        # Not silently accepted: we name them. They are not known to change DeepSeek math; if one does, add it here.
        logger.warning("config.json: ignoring keys not used by mla_jax: %s", ", ".join(unknown))

    v_head = d.get("v_head_dim")
    cfg = ModelConfig(
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        intermediate_size=int(req("intermediate_size")),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        num_hidden_layers=int(req("num_hidden_layers")),
        num_attention_heads=heads,
        q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") is not None else None,
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(req("qk_nope_head_dim")),
        qk_rope_head_dim=int(req("qk_rope_head_dim")),
        v_head_dim=int(v_head) if v_head is not None else int(req("qk_nope_head_dim")),
        n_routed_experts=n_routed,
        num_experts_per_tok=int(top_k) if top_k is not None else None,
        n_shared_experts=int(d["n_shared_experts"]) if d.get("n_shared_experts") is not None else None,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        scoring_func=scoring,
        topk_method=topk_method,
        first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(d.get("moe_layer_freq") or 1),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_interleave=rope_interleave,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
        num_nextn_predict_layers=nextn,
        model_type=model_type,
        quantization=quant,
    )
    if cfg.qk_rope_head_dim % 2:
        raise _unsupported("qk_rope_head_dim", cfg.qk_rope_head_dim, "RoPE needs an even dimension")
    if n_routed and cfg.moe_intermediate_size <= 0:
        raise ValueError("config.json has n_routed_experts but no moe_intermediate_size")
    return cfg


def deepseek_v3_hf_config(awq_group_size: int | None = None, **overrides: Any) -> dict[str, Any]:
    """config.json of the full-size DeepSeek-V3 (61 layers, hidden 7168, 128 heads, MLA with q_lora_rank 1536 and
    kv_lora_rank 512, 256 routed experts top-8 in 8 groups, the first 3 layers dense, YaRN x40 over 4096) as this
    package serves it: without the multi-token-prediction layer (num_nextn_predict_layers 0).

    awq_group_size: add an AutoAWQ GEMM int4 quantization_config with this group size (nothing excluded).
    overrides: replace top-level keys (e.g. num_hidden_layers for a slice, smaller dims for a CPU check).
    Benchmarks and the full-size run build their random-weight models from it; `ModelConfig.from_hf_dict` parses it.
    """
    d: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
        first_k_dense_replace=3, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096),
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    )
    if awq_group_size is not None:
        d["quantization_config"] = dict(quant_method="awq", bits=4, group_size=awq_group_size, zero_point=True,
                                        version="gemm", modules_to_not_convert=[])
    d.update(overrides)
    return d
