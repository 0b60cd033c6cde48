"""Export of a trained model as an HF-format directory that mla_jax.load_model and mla_jax.LLM read.

config.json (model_type deepseek_v3), model.safetensors (bf16; the router's e_score_correction_bias in fp32),
tokenizer.json, tokenizer_config.json, generation_config.json and, from a training run, training.json
(hyper-parameters, corpus, held-out files with their sha256, loss curve).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from mla_train.tokenizer import tokenizer_config


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
