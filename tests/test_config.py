"""ModelConfig parsing from HF config.json dicts (deepseek_v3 / deepseek_v2, legacy and transformers-5 keys)."""

import dataclasses
import json
import logging
import math

import pytest

from mla_jax.config import AWQConfig, ModelConfig
from mla_jax.model.rope import rope_inv_freq

# deepseek-ai/DeepSeek-V3 config.json (its fp8 quantization_config left out; tested separately below).
V3_REAL = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# deepseek-ai/DeepSeek-V2-Lite config.json
V2_LITE_REAL = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def with_(base, **kw):
    d = json.loads(json.dumps(base))
    for k, v in kw.items():
        if v is _DEL:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DEL = object()


def test_deepseek_v3_real_config():
    cfg = ModelConfig.from_hf_dict(V3_REAL)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 61, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert cfg.qk_head_dim == 192
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert cfg.routed_scaling_factor == 2.5 and cfg.rope_interleave is True and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling_dict["factor"] == 40.0 and cfg.rope_scaling_dict["original_max_position_embeddings"] == 4096
    assert cfg.num_nextn_predict_layers == 1 and cfg.quantization is None
    # docs/architecture.md §5: mscale = 0.1·1·ln 40 + 1; softmax scale = 192^-0.5 · mscale².
    mscale = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(0.1352337788608801, rel=1e-9)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert cfg.is_moe_layer(60)
    # YaRN attention_factor = mscale(40, 1.0) / mscale(40, 1.0) = 1 (cos/sin not rescaled).
    inv_freq, attention_factor = rope_inv_freq(cfg)
    assert inv_freq.shape == (32,) and attention_factor == 1.0


def test_config_is_hashable_and_frozen():
    a, b = ModelConfig.from_hf_dict(V3_REAL), ModelConfig.from_hf_dict(V3_REAL)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 1  # type: ignore[misc]


def test_deepseek_v2_lite_real_config():
    cfg = ModelConfig.from_hf_dict(V2_LITE_REAL)
    assert cfg.model_type == "deepseek_v2" and cfg.q_lora_rank is None
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("softmax", "greedy", False)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (64, 6, 2)
    assert cfg.rope_interleave is True  # V2 always rotates interleaved pairs
    assert cfg.routed_scaling_factor == 1.0 and cfg.first_k_dense_replace == 1
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # V2-Lite: mscale == mscale_all_dim == 0.707 -> softmax scale uses mscale(40, 0.707)².
    m = 0.1 * 0.707 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)


def test_v2_defaults_differ_from_v3_defaults():
    d = with_(V2_LITE_REAL, scoring_func=_DEL, topk_method=_DEL, norm_topk_prob=_DEL, routed_scaling_factor=_DEL)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.routed_scaling_factor) == (
        "softmax", "greedy", False, 1.0)
    d = with_(V3_REAL, scoring_func=_DEL, topk_method=_DEL, norm_topk_prob=_DEL, rope_interleave=_DEL)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.rope_interleave) == (
        "sigmoid", "noaux_tc", True, True)


def test_legacy_and_transformers5_rope_keys_agree():
    legacy = ModelConfig.from_hf_dict(V3_REAL)
    rp = dict(V3_REAL["rope_scaling"])
    rp["rope_type"] = rp.pop("type")
    rp["rope_theta"] = 10000.0
    v5 = ModelConfig.from_hf_dict(with_(V3_REAL, rope_scaling=_DEL, rope_theta=_DEL, rope_parameters=rp))
    assert v5 == legacy
    # rope_scaling wins over rope_parameters when both are given (as in HF).
    both = with_(V3_REAL, rope_parameters={"rope_type": "default", "rope_theta": 5.0})
    assert ModelConfig.from_hf_dict(both) == legacy


def test_plain_rope_in_both_forms():
    a = ModelConfig.from_hf_dict(with_(V3_REAL, rope_scaling=None, rope_theta=50000))
    b = ModelConfig.from_hf_dict(with_(V3_REAL, rope_scaling=_DEL, rope_theta=_DEL,
                                       rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    assert a == b and a.rope_scaling is None and a.rope_theta == 50000.0
    assert a.softmax_scale == pytest.approx(192 ** -0.5)
    inv_freq, attention_factor = rope_inv_freq(a)
    assert attention_factor == 1.0 and inv_freq[0] == 1.0 and inv_freq[1] == pytest.approx(50000 ** (-2 / 64))


def test_yarn_missing_factor_and_original_max_follow_hf():
    rp = {"type": "yarn", "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0, "mscale": 1.0}
    cfg = ModelConfig.from_hf_dict(with_(V3_REAL, rope_scaling=rp, max_position_embeddings=16384))
    assert cfg.rope_scaling_dict["factor"] == 4.0
    cfg = ModelConfig.from_hf_dict(with_(V3_REAL, rope_scaling={"type": "yarn", "factor": 2.0}))
    assert cfg.rope_scaling_dict["original_max_position_embeddings"] == V3_REAL["max_position_embeddings"]
    assert rope_inv_freq(cfg)[1] == pytest.approx(0.1 * math.log(2.0) + 1)  # attention_factor from factor only


def test_v3_rope_interleave_false_is_read():
    assert ModelConfig.from_hf_dict(with_(V3_REAL, rope_interleave=False)).rope_interleave is False


@pytest.mark.parametrize("key,value,needle", [
    ("model_type", "llama", "model_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("topk_method", "top1", "topk_method"),
    ("scoring_func", "relu", "scoring_func"),
    ("num_key_value_heads", 16, "num_key_value_heads"),
    ("index_topk", 2048, "index_topk"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type"),
    ("rope_scaling", {"type": "yarn", "factor": 2.0, "low_freq_factor": 1.0}, "rope_scaling.low_freq_factor"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "rope_parameters.rope_type"),
    ("n_group", 3, "n_group"),
    ("topk_group", 9, "topk_group"),
    ("kv_lora_rank", None, "kv_lora_rank"),
])
def test_unsupported_math_keys_raise_naming_the_key(key, value, needle):
    d = with_(V3_REAL, **{key: value})
    if key == "rope_parameters":
        d.pop("rope_scaling")
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        ModelConfig.from_hf_dict(d)


def test_missing_required_key_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict(with_(V3_REAL, hidden_size=_DEL))


def test_unknown_harmless_key_is_logged_not_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="mla_jax.config"):
        ModelConfig.from_hf_dict(with_(V3_REAL, some_future_flag=True))
    assert "some_future_flag" in caplog.text


def test_mtp_layers_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="mla_jax.config"):
        cfg = ModelConfig.from_hf_dict(V3_REAL)
    assert cfg.num_nextn_predict_layers == 1
    assert "multi-token-prediction" in caplog.text and "model.layers.61" in caplog.text


def test_awq_quantization_config():
    q = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": ["model.layers.0.self_attn.kv_b_proj", "mlp.gate"]}
    cfg = ModelConfig.from_hf_dict(with_(V3_REAL, quantization_config=q))
    assert cfg.quantization == AWQConfig(4, 64, True, "gemm",
                                         ("model.layers.0.self_attn.kv_b_proj", "mlp.gate"))
    assert cfg.quantization.excludes("model.layers.0.self_attn.kv_b_proj")
    assert not cfg.quantization.excludes("model.layers.1.self_attn.kv_b_proj")
    hash(cfg)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("q,needle", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "quant_method"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
])
def test_unsupported_quantization_raises(q, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict(with_(V3_REAL, quantization_config=q))


def test_to_hf_dict_round_trips():
    for d in (V3_REAL, V2_LITE_REAL):
        cfg = ModelConfig.from_hf_dict(d)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_from_pretrained_reads_fixture_config():
    from conftest import fixture_path

    cfg = ModelConfig.from_pretrained(fixture_path("v3_yarn"))
    assert cfg.model_type == "deepseek_v3" and cfg.rope_scaling_dict["factor"] == 40.0
    assert cfg.num_nextn_predict_layers == 1 and cfg.n_group == 4
    cfg = ModelConfig.from_pretrained(fixture_path("v2_lite"))
    assert cfg.model_type == "deepseek_v2" and cfg.q_lora_rank is None and cfg.rope_scaling is None
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(fixture_path("v2_lite") + "/nope")
