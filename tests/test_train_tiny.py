"""Training pieces of the embedded model (the mla_train package): corpus split, windows, the loss-and-load
forward, a few optimizer steps on a toy model, the routing-bias update, the HF export round trip and the held-out
scorers of mla_train.evaluate (scripts/eval_ppl.py)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax
from mla_jax.config import ModelConfig
from mla_jax.engine.text import Tokenizer
from mla_train import evaluate
from mla_train import (SourceFile, TrainHParams, Trainer, count_params, eval_windows, forward_with_loads,
                       is_heldout, lr_at, save_hf_checkpoint, split_files, tiny_hf_config, token_nll,
                       token_stream, train_tokenizer)

TOY_SOURCES = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\n\ndef main():\n    for name in os.listdir('.'):\n        print(name)\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
] * 6

TOY_DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                topk_group=1, max_position_embeddings=128, rope_original_max=32)


@pytest.fixture(scope="module")
def toy():
    files = [SourceFile(f"f{i}.py", t) for i, t in enumerate(TOY_SOURCES)]
    tok = train_tokenizer((f.text for f in files), 300)
    stream = token_stream(tok, files)
    hf = tiny_hf_config(300, **TOY_DIMS)
    cfg = ModelConfig.from_hf_dict(hf)
    hp = TrainHParams(seed=0, batch_size=4, seq_len=32, peak_lr=3e-3, warmup_steps=2, bias_update_rate=1e-2)
    return dict(tok=tok, stream=stream, hf=hf, cfg=cfg, trainer=Trainer(cfg, hp), hp=hp)


def test_split_is_per_file_and_stable():
    files = [SourceFile(f"pkg/m{i}.py", "x = 1\n") for i in range(400)]
    train, valid, test = split_files(files, seed=3, test_fraction=0.1, valid_fraction=0.05)
    names = [{f.relpath for f in part} for part in (train, valid, test)]
    assert sum(map(len, names)) == 400 and not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert 15 <= len(test) <= 70 and 5 <= len(valid) <= 40
    assert all(is_heldout(f.relpath, 3, 0.1) for f in test) and not any(is_heldout(f.relpath, 3, 0.1) for f in valid)
    # A file's side depends only on its own path: dropping other files moves nothing.
    _, valid2, test2 = split_files(files[::2], seed=3, test_fraction=0.1, valid_fraction=0.05)
    assert {f.relpath for f in test2} == names[2] & {f.relpath for f in files[::2]}
    assert {f.relpath for f in valid2} == names[1] & {f.relpath for f in files[::2]}
    assert {f.relpath for f in split_files(files, seed=4, test_fraction=0.1)[2]} != names[2]
    with pytest.raises(ValueError):
        split_files(files, seed=0, test_fraction=0.0)
    with pytest.raises(ValueError):
        split_files(files, seed=0, test_fraction=0.5, valid_fraction=0.5)


def test_stream_and_eval_windows(toy):
    tok, stream = toy["tok"], toy["stream"]
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    assert stream[0] == bos and stream[-1] == eos and (stream == bos).sum() == len(TOY_SOURCES)
    w = eval_windows(stream, 16)
    assert w.shape == ((len(stream) - 1) // 16, 17)
    assert (w[1:, 0] == w[:-1, -1]).all()  # windows share one boundary token: every target counted once
    np.testing.assert_array_equal(w.reshape(-1)[:17], stream[:17])
    with pytest.raises(ValueError, match="shorter than one window"):
        eval_windows(stream[:5], 16)


def test_lr_schedule():
    assert float(lr_at(0, 100, 1.0, 10)) == pytest.approx(0.1)
    assert float(lr_at(9, 100, 1.0, 10)) == pytest.approx(1.0)
    assert float(lr_at(10, 100, 1.0, 10)) == pytest.approx(1.0)
    assert float(lr_at(100, 100, 1.0, 10)) == pytest.approx(0.1)
    assert float(lr_at(1000, 100, 1.0, 10)) == pytest.approx(0.1)


def test_forward_with_loads_matches_model(toy):
    model = toy["trainer"].model(jnp.float32)
    ids = jax.random.randint(jax.random.key(1), (2, 11), 0, toy["cfg"].vocab_size)
    logits, loads = forward_with_loads(model, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    assert loads.shape == (1, 4)  # one MoE layer (first_k_dense_replace=1), 4 experts
    np.testing.assert_allclose(np.asarray(loads).sum(-1), 1.0, rtol=1e-6)
    # Loads equal a direct count of the router's choices on that layer's input.
    layer = model.layers[1]
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    h = model.embed(ids)
    h = h + model.layers[0].self_attn(model.layers[0].input_layernorm(h), positions)
    h = h + model.layers[0].mlp(model.layers[0].post_attention_layernorm(h))
    h = h + layer.self_attn(layer.input_layernorm(h), positions)
    idx, _ = layer.mlp.route(layer.post_attention_layernorm(h).reshape(-1, 64))
    expected = np.bincount(np.asarray(idx).ravel(), minlength=4) / idx.size
    np.testing.assert_allclose(np.asarray(loads)[0], expected, rtol=1e-6)


def test_token_nll():
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.25]]))
    np.testing.assert_allclose(np.asarray(token_nll(logits, jnp.asarray([1]))), [np.log(4.0)], rtol=1e-6)


def test_steps_reduce_loss_and_balance_bias(toy):
    trainer, hp = toy["trainer"], toy["hp"]
    stream = jnp.asarray(toy["stream"])
    windows = eval_windows(toy["stream"], hp.seq_len, 8)
    before = trainer.eval_loss(windows, 4)
    assert before == pytest.approx(np.log(300), abs=0.3)  # random init: about uniform over the vocabulary
    bias0 = np.asarray(jax.tree.leaves(trainer.bias)[0])
    assert np.all(bias0 == 0)
    # A copy of the state (run_training keeps the best step this way) survives the donating steps below.
    snapshot = jax.tree.map(jnp.copy, (trainer.router, trainer.params, trainer.bias))
    losses = []
    for step in range(25):
        m = trainer.step(stream, jax.random.key(7), step, 25)
        losses.append(float(m["loss"]))
        if step == 0:
            bias1 = np.asarray(jax.tree.leaves(trainer.bias)[0])
            # One update moves every expert's bias by exactly ±rate (or 0 at exactly mean load).
            assert set(np.round(np.abs(bias1) / hp.bias_update_rate, 6)) <= {0.0, 1.0}
            assert np.any(bias1 != 0)
    after = trainer.eval_loss(windows, 4)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert after < before - 1.0, (before, after)
    # The bias is never touched by the optimizer: its moves are multiples of the update rate.
    bias = np.asarray(jax.tree.leaves(trainer.bias)[0])
    np.testing.assert_allclose(bias / hp.bias_update_rate, np.round(bias / hp.bias_update_rate), atol=1e-3)
    trained = (trainer.router, trainer.params, trainer.bias)
    trainer.router, trainer.params, trainer.bias = snapshot
    assert trainer.eval_loss(windows, 4) == pytest.approx(before, rel=1e-6)
    trainer.router, trainer.params, trainer.bias = trained


def test_export_round_trip(toy, tmp_path):
    trainer, tok, hf = toy["trainer"], toy["tok"], toy["hf"]
    model = trainer.model(jnp.float32)
    save_hf_checkpoint(model, hf, tok, str(tmp_path), training_info={"note": "test"}, dtype="float32")
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json", "generation_config.json",
                                                   "training.json"])
    loaded, cfg = mla_jax.load_model(str(tmp_path), dtype="float32")
    assert cfg == toy["cfg"].__class__.from_hf_dict(json.load(open(tmp_path / "config.json")))
    ids = jnp.asarray(toy["stream"][None, :40])
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    # The trained routing bias survives the round trip.
    np.testing.assert_array_equal(np.asarray(loaded.layers[1].mlp.gate.e_score_correction_bias[...]),
                                  np.asarray(model.layers[1].mlp.gate.e_score_correction_bias[...]))
    t = Tokenizer.from_dir(tmp_path)
    assert t.encode("def f():")[0] == t.bos_token_id == hf["bos_token_id"]
    assert t.eos_token_ids == (hf["eos_token_id"],)
    chat = t.apply_chat_template([{"role": "user", "content": "add two numbers\nquickly"}])
    assert chat == "<|bos|># add two numbers\n# quickly\n"


def test_param_count_matches_model(toy):
    counts = count_params(toy["hf"])
    n = sum(x.size for x in jax.tree.leaves((toy["trainer"].params, toy["trainer"].router, toy["trainer"].bias)))
    assert counts["total"] == n


def test_eval_ppl_paths_agree(toy):
    # mla_train.evaluate's three teacher-forced paths (scripts/eval_ppl.py) score the same tokens: with fp32
    # weights and an fp32 cache they agree to rounding; a bf16 / fp8 cache moves the decode NLL only a little.
    ev = evaluate
    model = toy["trainer"].model(jnp.float32)
    windows = eval_windows(toy["stream"], 24, 3)
    fwd = ev.score_forward(model, windows, batch=3)
    assert fwd.shape == (3, 24)
    np.testing.assert_allclose(fwd, np.asarray(token_nll(model(jnp.asarray(windows[:, :-1])),
                                                         jnp.asarray(windows[:, 1:]))), rtol=1e-6)
    dec = ev.score_decode(model, windows, "float32", "xla", interpret=False)
    pre = ev.score_prefill(model, windows, "float32", chunk=8)
    np.testing.assert_allclose(dec, fwd, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(pre, fwd, rtol=2e-4, atol=2e-4)
    fp8 = ev.score_decode(model, windows, "fp8_e4m3", "xla", interpret=False)
    assert not np.allclose(fp8, fwd, rtol=1e-6, atol=1e-6)  # the fp8 cache is really in the path
    assert abs(fp8.mean() - fwd.mean()) < 0.02 * fwd.mean()
