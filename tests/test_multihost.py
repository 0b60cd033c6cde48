"""Two processes on localhost through jax.distributed.initialize (CPU, gloo collectives), one mesh over the 4
devices of both: sharded loading and a jitted sharded forward give every process the single-device result."""
import json
import os
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two(worker, extra_args, tmp_path, timeout=600):
    coordinator = f"localhost:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    procs = [subprocess.Popen([sys.executable, worker, coordinator, str(pid), *extra_args],
                              cwd=os.path.dirname(HERE), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for pid in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"process failed (rc {p.returncode}):\n{out[-6000:]}"
    return outs


def test_two_processes_load_sharded_and_match_one_device(tmp_path):
    import mla_jax
    _run_two(os.path.join(HERE, "multihost_worker.py"), [str(tmp_path)], tmp_path)
    fixture = os.path.join(HERE, "fixtures", "sharding_dims")
    golden = np.load(os.path.join(fixture, "golden.npz"))
    model, cfg = mla_jax.load_model(fixture, dtype="float32")
    want = np.asarray(model(golden["input_ids"]))
    for pid in range(2):
        info = json.loads((tmp_path / f"info_{pid}.json").read_text())
        assert info["process_count"] == 2 and info["device_count"] == 4 and info["local_devices"] == 2
        # q_b_proj [32, 8 heads * 80] split by head over 4 devices: each process holds 2 shards of 2 heads
        assert info["q_b_local_shards"] == [[32, 160], [32, 160]]
        got = np.load(tmp_path / f"logits_{pid}.npy")
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got, golden["logits_fp32"], rtol=1e-4, atol=1e-4)


def test_generate_script_across_two_processes_with_dp_attention(tmp_path):
    """scripts/generate.py, the same command in both processes (jax.distributed, 2 CPU devices each), data-parallel
    attention over the 4 devices: each process prints the tokens one device generates."""
    import mla_jax
    fixture = os.path.join(HERE, "fixtures", "sharding_dims")
    prompts = [[3, 17, 5, 9], [7, 1, 2], [40, 41, 42, 43, 44, 45]]
    worker = os.path.join(HERE, "..", "scripts", "generate.py")
    args = ["--model", fixture, "--max-tokens", "4", "--dtype", "float32", "--attention-backend", "xla",
            "--tensor-parallel-size", "4", "--data-parallel-attention", "--max-num-seqs", "4", "--max-model-len", "64",
            "--num-processes", "2"]
    for p in prompts:
        args += ["--prompt-token-ids", ",".join(map(str, p))]
    coordinator = f"localhost:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, worker, *args, "--coordinator-address", coordinator,
                               "--process-id", str(pid)], cwd=os.path.dirname(HERE), env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    llm = mla_jax.LLM(fixture, dtype="float32", attention_backend="xla", max_model_len=64, max_num_seqs=4)
    want = [o.token_ids for o in llm.generate(prompts, mla_jax.SamplingParams(max_tokens=4))]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
        printed = [json.loads(line) for line in out.splitlines() if line.startswith("[") and line.endswith("]")]
        assert printed == want, out[-3000:]


def test_check_multi_gpu_script_two_processes_all_to_all_matches_one_device(tmp_path):
    """scripts/check_multi_gpu.py --cpu: its reference child (1 device) and two jax.distributed children of one
    CPU device each, data-parallel attention with the all-to-all expert dispatch: greedy tokens equal, logprobs
    within 1e-4; the script exits 0 and its JSON says so."""
    script = os.path.join(HERE, "..", "scripts", "check_multi_gpu.py")
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    r = subprocess.run([sys.executable, script, "--cpu", "--phases", "multi_process", "--configs",
                        "dp_attention:all_to_all", "--num-prompts", "3", "--max-tokens", "4", "--out", str(out)],
                       cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["ok"] and row["passed"] and row["tokens_equal"]
    assert row["config"] == "dp_attention2 all_to_all [2 processes x 1 device (jax.distributed)]"
    assert 0 <= row["max_abs_logprob_diff"] <= 1e-4
    assert len(report["reference_tokens"]) == 3 and all(len(t) == 4 for t in report["reference_tokens"])


def test_check_multi_gpu_compare_fails_on_other_tokens_or_logprobs_past_tolerance():
    import argparse
    import importlib.util
    spec = importlib.util.spec_from_file_location("check_multi_gpu", os.path.join(HERE, "..", "scripts",
                                                                                  "check_multi_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = {"token_ids": [[5, 6], [7, 8]], "logprobs": [[-1.0, -2.0], [-0.5, -0.25]], "model": "m", "env": {}}
    args = argparse.Namespace(atol=1e-4, num_devices=2)
    same = {"token_ids": [[5, 6], [7, 8]], "logprobs": [[-1.0, -2.00005], [-0.5, -0.25]]}
    other_token = {"token_ids": [[5, 6], [7, 9]], "logprobs": ref["logprobs"]}
    far = {"token_ids": [[5, 6], [7, 8]], "logprobs": [[-1.0, -2.0], [-0.5, -0.2498]]}
    report = mod.compare({"reference": ref, "a": same, "b": other_token, "c": far}, args)
    assert [r["passed"] for r in report["rows"]] == [True, False, False] and not report["ok"]
    assert not report["rows"][1]["tokens_equal"] and abs(report["rows"][2]["max_abs_logprob_diff"] - 2e-4) < 1e-9
    assert mod.compare({"reference": ref, "a": same}, args)["ok"]
