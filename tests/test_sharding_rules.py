"""Partition rules of mla_jax.sharding on abstract parameter trees (no devices needed: specs are computed from
paths and shapes). Multi-device behaviour is tested in tests/sharding_8dev_cases.py (run by test_sharding.py)."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mla_jax import sharding
from mla_jax.checkpoint import hf
from mla_jax.config import ModelConfig
from mla_jax.sharding import AXIS


def tiny_cfg(**over):
    d = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=8, q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=16,
             qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
             topk_method="noaux_tc", first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1)
    d.update(over)
    return ModelConfig.from_hf_dict(d)


def abstract_state(cfg, dtype=jnp.float32):
    from mla_jax.model.transformer import DeepseekV3
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.state(model)


def specs_by_path(cfg, n, dp=False):
    state = abstract_state(cfg)
    out = {}
    jax.tree_util.tree_map_with_path(
        lambda kp, x: out.__setitem__(sharding.path_str(kp),
                                      (x.shape, sharding.spec_for(sharding.path_str(kp), x.shape, n, dp))), state)
    return out


def test_tp_rules_cover_every_parameter_and_split_heads_experts_mlp_vocab():
    cfg = tiny_cfg()
    H, D, V = cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size
    specs = specs_by_path(cfg, 4)
    want = {
        "embed_tokens/embedding": P(None, AXIS),
        "layers/0/self_attn/q_a_proj/kernel": P(),
        "layers/0/self_attn/q_a_layernorm/weight": P(),
        "layers/0/self_attn/q_b_proj/kernel": P(None, AXIS),
        "layers/0/self_attn/kv_a_proj_with_mqa/kernel": P(),
        "layers/0/self_attn/kv_a_layernorm/weight": P(),
        "layers/0/self_attn/kv_b_proj/kernel": P(None, AXIS),
        "layers/0/self_attn/o_proj/kernel": P(AXIS),
        "layers/0/input_layernorm/weight": P(),
        "layers/0/post_attention_layernorm/weight": P(),
        "layers/0/mlp/gate_proj/kernel": P(None, AXIS),
        "layers/0/mlp/up_proj/kernel": P(None, AXIS),
        "layers/0/mlp/down_proj/kernel": P(AXIS),
        "layers/1/mlp/gate/kernel": P(),
        "layers/1/mlp/gate/e_score_correction_bias": P(),
        "layers/1/mlp/experts/w_gate": P(AXIS),
        "layers/1/mlp/experts/w_up": P(AXIS),
        "layers/1/mlp/experts/w_down": P(AXIS),
        "layers/1/mlp/shared_experts/gate_proj/kernel": P(None, AXIS),
        "layers/1/mlp/shared_experts/down_proj/kernel": P(AXIS),
        "norm/weight": P(),
        "lm_head/kernel": P(None, AXIS),
    }
    for path, spec in want.items():
        assert specs[path][1] == spec, (path, specs[path])
    # q_b columns are head-major [H, nope+rope]: a contiguous quarter is exactly H/4 heads.
    assert specs["layers/0/self_attn/q_b_proj/kernel"][0] == (24, H * 80)
    assert specs["lm_head/kernel"][0] == (D, V)


def test_dp_attention_replicates_attention_weights_but_keeps_experts_and_mlp_split():
    specs = specs_by_path(tiny_cfg(), 8, dp=True)
    for name in ("q_b_proj", "kv_b_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa"):
        assert specs[f"layers/0/self_attn/{name}/kernel"][1] == P(), name
    assert specs["layers/1/mlp/experts/w_gate"][1] == P(AXIS)
    assert specs["layers/0/mlp/down_proj/kernel"][1] == P(AXIS)
    assert specs["lm_head/kernel"][1] == P(None, AXIS)


def test_absorbed_weights_split_by_head_in_tp_only():
    assert sharding.spec_for("absorbed/0/w_uk", (8, 16, 512), 4, False) == P(AXIS)
    assert sharding.spec_for("absorbed/0/w_uv", (8, 16, 512), 4, True) == P()


def test_awq_params_follow_their_linear():
    # AWQLinear: packed int32 [K_pad/8, N_pad], zeros/scales [K_pad/G, N_pad]; AWQExperts: w13_packed [E, ...] ...
    assert sharding.spec_for("layers/0/self_attn/q_b_proj/packed", (192, 128 * 192), 8, False) == P(None, AXIS)
    assert sharding.spec_for("layers/0/self_attn/o_proj/scales", (128, 7168), 8, False) == P(AXIS)
    assert sharding.spec_for("layers/0/self_attn/o_proj/zeros", (128, 7168), 8, False) == P(AXIS)
    assert sharding.spec_for("layers/3/mlp/experts/w2_scales", (256, 16, 7168), 8, False) == P(AXIS)
    assert sharding.spec_for("layers/3/mlp/experts/w13_packed", (256, 896, 4096), 8, True) == P(AXIS)
    # o_proj with 12 quantization groups cannot be cut into 8 row blocks: the error names the tensor.
    with pytest.raises(ValueError, match=r"o_proj/scales.*quantization groups.*12"):
        sharding.spec_for("layers/0/self_attn/o_proj/scales", (12, 7168), 8, False)


def test_every_parameter_needs_a_rule():
    with pytest.raises(ValueError, match="no partition rule for parameter 'layers/0/self_attn/new_proj/kernel'"):
        sharding.spec_for("layers/0/self_attn/new_proj/kernel", (4, 4), 2, False)


def test_heads_and_experts_that_do_not_divide_raise_clear_errors():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=8.*"
                                         r"\[1, 2, 4, 8\].*data_parallel_attention"):
        sharding.check_config(tiny_cfg(), 3, False)
    # With data-parallel attention the heads stay whole, but experts still split.
    with pytest.raises(ValueError, match=r"does not divide n_routed_experts=8"):
        sharding.check_config(tiny_cfg(), 3, True)
    sharding.check_config(tiny_cfg(num_attention_heads=6), 2, False)
    sharding.check_config(tiny_cfg(num_attention_heads=6), 8, True)
    with pytest.raises(ValueError, match="must be >= 1"):
        sharding.check_config(tiny_cfg(), 0, False)


def test_mlp_sizes_that_do_not_divide_name_the_parameter():
    cfg = tiny_cfg(intermediate_size=60)
    with pytest.raises(ValueError, match=r"'layers/0/mlp/(down|gate|up)_proj/kernel' of shape "
                                         r"\((32, 60|60, 32)\) over 8 devices.*size 60"):
        specs_by_path(cfg, 8)


def test_cache_spec_splits_pages_only_with_dp_attention():
    mesh = jax.make_mesh((1,), (AXIS,))
    tp = sharding.ShardingPlan(mesh, False)
    assert tp.cache_spec(3) == P()
    # specs do not depend on the device count for replication; with one device nothing is split
    dp1 = sharding.ShardingPlan(mesh, True)
    assert dp1.cache_spec(3) == P()
    with pytest.raises(ValueError, match="pages, page_size, features"):
        tp.cache_spec(2)


def test_path_str_drops_nnx_value_and_handles_sequence_keys():
    kp = (jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(3), jax.tree_util.DictKey("self_attn"),
          jax.tree_util.GetAttrKey("value"))
    assert sharding.path_str(kp) == "layers/3/self_attn"


def test_bytes_per_device_counts_shards():
    am = jax.sharding.AbstractMesh((8,), (AXIS,))
    arrays = [jax.ShapeDtypeStruct((16, 4), jnp.float32), jax.ShapeDtypeStruct((16, 4), jnp.bfloat16),
              jax.ShapeDtypeStruct((16, 8), jnp.int4)]
    shard = [jax.sharding.NamedSharding(am, P(AXIS)), jax.sharding.NamedSharding(am, P()),
             jax.sharding.NamedSharding(am, P(None, AXIS))]
    # int4 is stored two per byte on GPU
    assert sharding.bytes_per_device(arrays, shard) == 2 * 4 * 4 + 16 * 4 * 2 + 16 * 1 // 2


def test_hf_slices_for_transposed_and_packed_tensors():
    # kernel [in=8, out=12] from HF [out, in]: our columns 6:12 are HF rows 6:12
    assert hf._hf_index((slice(0, 8), slice(6, 12)), (8, 12), (12, 8), True) == (slice(6, 12), slice(0, 8))
    # a packed axis, our [in, out=64] from int32 [in, out/8=8]: columns 32:64 are packed columns 4:8
    assert hf._hf_index((slice(None), slice(32, 64)), (16, 64), (16, 8), False) == (slice(0, 16), slice(4, 8))
    # a slice that cuts inside a packed int32 cannot be read alone: read the whole tensor
    assert hf._hf_index((slice(None), slice(4, 64)), (16, 64), (16, 8), False) is None
