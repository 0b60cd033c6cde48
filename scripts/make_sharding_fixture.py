"""Write tests/fixtures/sharding_dims: a tiny DeepSeek-V3 HF checkpoint (+ HF golden logits) whose sizes split
over 2, 4 and 8 devices (8 heads, 8 routed experts; MLP, vocab and hidden sizes, and AWQ groups of 16, divisible
by 8) with the real MLA cache dims (kv_lora_rank 512, rope 64), for the sharding tests.

Uses scripts/make_fixtures.py's generator (HF transformers, torch CPU; Python 3.11 venv):
    /work/venv311/bin/python scripts/make_sharding_fixture.py [--out tests/fixtures]
"""
import argparse
import os

import make_fixtures  # scripts/make_fixtures.py: this script's own directory is first on sys.path

SPEC = dict(
    model_type="deepseek_v3", seq_len=9, save_dtype="bfloat16", shards=None, legacy_rope=False, mtp_layers=0,
    config=dict(
        make_fixtures.V3_BASE, vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=512,
        qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=4, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
                             mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096),
    ),
    extra_keys=dict(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make_fixtures.torch.set_num_threads(1)
    meta = make_fixtures.make_one("sharding_dims", SPEC, os.path.abspath(args.out), args.seed)
    print(meta)


if __name__ == "__main__":
    main()
