"""scripts/generate.py on the embedded default model (CPU): no-argument run, streaming, exit codes."""
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "checkpoints", "tiny-deepseek-py")

pytestmark = pytest.mark.skipif(not os.path.isdir(DEFAULT_MODEL), reason="embedded model not in this checkout")


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(REPO, "scripts", "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_arguments_runs_the_embedded_model(generate, capsys):
    assert generate.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention backend: xla (auto: platform cpu")
    for i, p in enumerate(generate.DEFAULT_PROMPTS):
        assert f"=== [{i}] prompt: {p!r}" in out
    assert out.count("--- finish_reason=") == len(generate.DEFAULT_PROMPTS)
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(f"summary: {len(generate.DEFAULT_PROMPTS)} prompts (0 failed)")
    assert "tok/s" in summary and "time to first token" in summary
    # same engine settings, greedy: streaming shows the same text as the final outputs, in prompt order
    args = ["--temperature", "0", "--max-tokens", "12"] + sum((["--prompt", p] for p in generate.DEFAULT_PROMPTS), [])
    assert generate.main(args) == 0
    plain = capsys.readouterr().out
    assert generate.main(args + ["--stream", "--prompt-token-ids", ""]) == 1     # the empty prompt fails alone
    streamed = capsys.readouterr().out
    body = lambda s: s[s.index("=== [0]"): s.index("\nsummary:")].replace("\n", "")
    assert body(streamed).startswith(body(plain))
    assert "=== [2] prompt: []error: the prompt is empty" in body(streamed)
    assert "(1 failed)" in streamed


@pytest.mark.parametrize("argv, reason", [
    (["--attention-backend", "mosaic_sm90"], "mosaic_sm90' cannot run: it needs a CUDA GPU"),
    (["--tensor-parallel-size", "2"], "asked for 2 devices but only 1 are visible"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--kv-cache-dtype", "float32", "--attention-backend", "triton", "--interpret"], "cache dtype float32"),
])
def test_impossible_requests_exit_nonzero_with_the_reason(generate, capsys, argv, reason):
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and reason in err
