"""Write tiny random DeepSeek-V3/V2 HF checkpoints and HF transformers golden logits into tests/fixtures/.

Runs in a Python 3.11 venv with torch (CPU) + transformers (not part of CI; CI compares against the stored files):
    /work/venv311/bin/python scripts/make_fixtures.py [--out tests/fixtures] [--only NAME ...]

Each fixture directory holds config.json, safetensors weights and golden.npz with
  input_ids int32 [2, S], logits_fp32 float32 [2, S, V] (HF eager attention, fp32),
  logits_bf16 float32 [2, S, V] (HF run in bfloat16), meta (JSON string: versions, seed, routing margins).
Weights are random but not default-initialised (norm weights != 1, correction bias != 0, weight scale
~1/sqrt(fan_in)) so routing and attention are not flat. Seeds are retried until every routing decision has a
clear margin, so that bf16 rounding cannot flip an expert choice between implementations.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

# Smallest allowed gap at every routing decision: sigmoid-score (+ bias) units for deepseek_v3 (noaux_tc), router
# logit units for deepseek_v2 (softmax). bf16 runs perturb router logits by up to ~0.1 on these fixtures.
MIN_ROUTING_MARGIN = {"deepseek_v3": 0.03, "deepseek_v2": 0.1}

V3_BASE = dict(
    hidden_act="silu", attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    rms_norm_eps=1e-6, max_position_embeddings=163840,
)

FIXTURES = {
    # (a) DeepSeek-V3 style: YaRN (real V3 parameters), q_lora, group-limited sigmoid noaux_tc routing with
    # correction bias, 2 MoE layers after 1 dense layer, 2 shared experts, interleaved rope, an MTP layer in the
    # checkpoint; config.json rewritten in the legacy (rope_scaling + rope_theta) form real V3 ships.
    "v3_yarn": dict(
        model_type="deepseek_v3", seq_len=9, save_dtype="float32", shards=None, legacy_rope=True, mtp_layers=1,
        config=dict(
            V3_BASE, vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, rope_interleave=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
                                 mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096),
        ),
        extra_keys=dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, n_group=4,
                        num_nextn_predict_layers=1, ep_size=1, aux_loss_alpha=0.001, seq_aux=True),
    ),
    # (b) DeepSeek-V2-Lite style: no q_lora, softmax scoring, greedy top-k, no top-k renormalisation, plain RoPE;
    # fp16 weights in a sharded checkpoint (model.safetensors.index.json).
    "v2_lite": dict(
        model_type="deepseek_v2", seq_len=7, save_dtype="float16", shards="40KB", legacy_rope=False, mtp_layers=0,
        config=dict(
            V3_BASE, vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
            routed_scaling_factor=1.0, first_k_dense_replace=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        extra_keys=dict(scoring_func="softmax", moe_layer_freq=1),
    ),
    # (c) Real MLA attention dims (kv_lora_rank 512, rope 64, nope 128, v 128) so kernels can run on it; bf16
    # weights; YaRN with mscale != mscale_all_dim (cos/sin scaled by attention_factor != 1).
    "real_dims": dict(
        model_type="deepseek_v3", seq_len=11, save_dtype="bfloat16", shards=None, legacy_rope=False, mtp_layers=0,
        config=dict(
            V3_BASE, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, rope_interleave=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
                                 mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=4096),
        ),
        extra_keys=dict(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0),
    ),
    # (d) DeepSeek-V2 group_limited_greedy routing, q_lora, every layer MoE (first_k_dense_replace=0), YaRN with
    # V2's mscale 0.707.
    "v2_group_limited": dict(
        model_type="deepseek_v2", seq_len=10, save_dtype="float32", shards=None, legacy_rope=False, mtp_layers=0,
        config=dict(
            V3_BASE, vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
            routed_scaling_factor=4.0, first_k_dense_replace=0,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
                                 mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096),
        ),
        extra_keys=dict(scoring_func="softmax"),
    ),
    # (e) DeepSeek-V3 with rope_interleave=false (rotate_half), plain RoPE, tied embeddings, one group.
    "v3_plain": dict(
        model_type="deepseek_v3", seq_len=8, save_dtype="float32", shards=None, legacy_rope=False, mtp_layers=0,
        config=dict(
            V3_BASE, vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_group=1, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=1.5, rope_interleave=False, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        ),
        extra_keys=dict(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0),
    ),
}


def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-default init: fan-in-scaled linears, unit-scale embeddings, norms in [0.5, 1.5], bias != 0."""
    for name, p in model.named_parameters(recurse=True):
        with torch.no_grad():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(p.shape[-1])))
            elif p.ndim == 3:  # fused experts: gate_up_proj [E, 2I, D], down_proj [E, D, I]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif p.ndim == 2:  # nn.Linear weight [out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def routing_margins(model: torch.nn.Module, input_ids: torch.Tensor, cfg) -> list[float]:
    """Smallest gap between the last chosen and first rejected candidate, per MoE layer (groups and experts)."""
    margins: list[float] = []

    def hook(mod, args, out):
        logits = out[0].float()
        # HF: deepseek_v3 routes on sigmoid scores (+ bias), deepseek_v2 on softmax. Softmax is monotone in the
        # logits, so its margins are measured as logit gaps (selection flips when a logit gap changes sign).
        scores = logits.sigmoid() if cfg.model_type == "deepseek_v3" else logits
        E, K = logits.shape[-1], cfg.num_experts_per_tok
        method = "noaux_tc" if cfg.model_type == "deepseek_v3" else cfg.topk_method
        if method == "noaux_tc":
            choice = scores + mod.e_score_correction_bias
            grp = choice.view(-1, cfg.n_group, E // cfg.n_group).topk(2, dim=-1)[0].sum(-1)
        elif method == "group_limited_greedy":
            choice = scores
            grp = scores.view(-1, cfg.n_group, E // cfg.n_group).max(-1).values
        else:
            choice, grp = scores, None
        if grp is not None and cfg.topk_group < cfg.n_group:
            g = grp.sort(-1, descending=True).values
            margins.append(float((g[:, cfg.topk_group - 1] - g[:, cfg.topk_group]).min()))
            keep = torch.zeros_like(grp).scatter_(1, grp.topk(cfg.topk_group, -1)[1], 1)
            keep = keep.repeat_interleave(E // cfg.n_group, -1).bool()
            choice = choice.masked_fill(~keep, float("-inf"))
        c = choice.sort(-1, descending=True).values
        if K < E:
            gap = c[:, K - 1] - c[:, K]
            margins.append(float(gap[torch.isfinite(gap)].min()) if torch.isfinite(gap).any() else float("inf"))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    return margins


def add_mtp_tensors(out_dir: str, cfg: dict, n_mtp: int, gen: torch.Generator) -> None:
    """Append the tensors of fake multi-token-prediction layers (model.layers.{L+k}.*) as real V3 ships them."""
    fn = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(fn)
    D, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    for k in range(n_mtp):
        p = f"model.layers.{L + k}"
        tensors[f"{p}.enorm.weight"] = torch.rand(D, generator=gen) + 0.5
        tensors[f"{p}.hnorm.weight"] = torch.rand(D, generator=gen) + 0.5
        tensors[f"{p}.eh_proj.weight"] = torch.randn(D, 2 * D, generator=gen)
        tensors[f"{p}.input_layernorm.weight"] = torch.rand(D, generator=gen) + 0.5
        tensors[f"{p}.shared_head.norm.weight"] = torch.rand(D, generator=gen) + 0.5
    save_file(tensors, fn, metadata={"format": "pt"})


def to_legacy_rope(out_dir: str) -> None:
    """Rewrite config.json the way DeepSeek ships it: rope_scaling {type: yarn, ...} + top-level rope_theta."""
    fn = os.path.join(out_dir, "config.json")
    with open(fn) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    c["rope_scaling"] = rp
    with open(fn, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def make_one(name: str, spec: dict, out_root: str, seed: int) -> dict:
    out_dir = os.path.join(out_root, name)
    ConfigCls = DeepseekV3Config if spec["model_type"] == "deepseek_v3" else DeepseekV2Config
    save_dtype = getattr(torch, spec["save_dtype"])
    for attempt in range(200):
        s = seed + 1000 * attempt
        gen = torch.Generator().manual_seed(s)
        cfg = ConfigCls(**spec["config"], attn_implementation="eager")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager",
                                                 dtype=torch.float32).eval()
        randomize_(model, gen)
        # Round every weight to a bf16-representable value (exact in fp16/fp32 storage too): the fp32 reference
        # runs on exactly the stored values, and a bf16 load adds no weight rounding, only bf16 compute error.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
                if save_dtype == torch.float16:  # below fp16's normal range bf16 values are not exact in fp16
                    p.masked_fill_(p.abs() < torch.finfo(torch.float16).tiny, 0.0)
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(b.to(torch.bfloat16).float())
        ids = torch.randint(0, cfg.vocab_size, (2, spec["seq_len"]), generator=gen)
        margins = routing_margins(model, ids, cfg)
        if not margins or min(margins) >= MIN_ROUTING_MARGIN[spec["model_type"]]:
            break
    else:
        raise RuntimeError(f"{name}: no seed gave routing margins >= {MIN_ROUTING_MARGIN[spec['model_type']]}")

    with torch.no_grad():
        direct = model(ids).logits.float().numpy()
    if os.path.isdir(out_dir):  # remove only what this script writes (others keep their files beside ours)
        for fn in os.listdir(out_dir):
            if fn.endswith((".safetensors", ".safetensors.index.json")) or fn in ("config.json", "golden.npz"):
                os.remove(os.path.join(out_dir, fn))
    kw = {"max_shard_size": spec["shards"]} if spec["shards"] else {}
    # (.to() also casts the in-memory RoPE buffers, so `model` is not used for reference after this.)
    model.to(save_dtype).save_pretrained(out_dir, safe_serialization=True, **kw)
    for junk in ("generation_config.json",):
        if os.path.exists(os.path.join(out_dir, junk)):
            os.remove(os.path.join(out_dir, junk))
    with open(os.path.join(out_dir, "config.json")) as f:
        c = json.load(f)
    c.update(spec["extra_keys"])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    if spec["legacy_rope"]:
        to_legacy_rope(out_dir)
    if spec["mtp_layers"]:
        add_mtp_tensors(out_dir, spec["config"], spec["mtp_layers"], gen)

    # Golden logits from what is on disk, as a user would load it.
    logits = {}
    for dt in ("float32", "bfloat16"):
        m = AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dt), attn_implementation="eager",
                                                 experts_implementation="eager").eval()
        with torch.no_grad():
            logits[dt] = m(ids).logits.float().numpy()
    # The reloaded checkpoint (legacy config, MTP tensors, storage dtype) must reproduce the in-memory model.
    err = np.abs(logits["float32"] - direct).max() / np.abs(direct).max()
    assert err < 1e-6, f"{name}: reloaded checkpoint differs from the generated model by {err}"
    bf16_err = float(np.abs(logits["bfloat16"] - logits["float32"]).max() / np.abs(logits["float32"]).max())
    meta = dict(
        fixture=name, seed=s, torch=torch.__version__, transformers=transformers.__version__,
        attn_implementation="eager", experts_implementation="eager", model_type=spec["model_type"], save_dtype=spec["save_dtype"],
        min_routing_margin=min(margins) if margins else None, hf_bf16_vs_fp32_rel_err=bf16_err,
    )
    np.savez(os.path.join(out_dir, "golden.npz"), input_ids=ids.numpy().astype(np.int32),
             logits_fp32=logits["float32"].astype(np.float32), logits_bf16=logits["bfloat16"].astype(np.float32),
             meta=np.array(json.dumps(meta)))
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate; default all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.only or list(FIXTURES)
    for n in names:
        meta = make_one(n, FIXTURES[n], os.path.abspath(args.out), args.seed)
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(args.out, n))
                   for f in fs)
        print(f"{n:18s} {size / 1024:8.1f} KiB  seed={meta['seed']}  margin={meta['min_routing_margin']}  "
              f"hf bf16 vs fp32 rel err={meta['hf_bf16_vs_fp32_rel_err']:.2e}")


if __name__ == "__main__":
    main()
