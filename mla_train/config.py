"""The HF config of the embedded model (DeepSeek-V3's structure at small width) and its parameter count."""

from __future__ import annotations


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
