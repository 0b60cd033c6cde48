"""The persistent compilation cache: where it goes (flag > env var > user cache dir, 'off'), and a second
scripts/generate.py process with the same shapes compiles nothing (it writes no new cache entry)."""
import os
import subprocess
import sys

import pytest

from mla_jax.engine.compile_cache import ENV_VAR, default_cache_dir, resolve_cache_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "checkpoints", "tiny-deepseek-py")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir() == default_cache_dir() == str(tmp_path / "xdg" / "mla_jax" / "jax_compilation_cache")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_cache_dir() == str(tmp_path / "env")
    assert resolve_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")      # the flag wins
    for off in ("off", "0", "None", "false", ""):
        assert resolve_cache_dir(off) is None
        monkeypatch.setenv(ENV_VAR, off)
        assert resolve_cache_dir() is None


def cache_entries(d):
    return sorted(os.path.relpath(os.path.join(root, f), d) for root, _, files in os.walk(d) for f in files)


@pytest.mark.skipif(not os.path.isdir(DEFAULT_MODEL), reason="embedded model not in this checkout")
def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    argv = [sys.executable, os.path.join(REPO, "scripts", "generate.py"), "--prompt-token-ids", "5,6,7,8",
            "--max-tokens", "4", "--max-model-len", "128", "--max-num-seqs", "1", "--compilation-cache", str(cache)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(ENV_VAR, None)
    runs = []
    for _ in range(2):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((cache_entries(cache), proc.stdout))
    (first, out1), (second, out2) = runs
    assert len(first) >= 2, first                 # the prefill and decode programs at least
    assert second == first                        # nothing new was compiled (every compile writes an entry)
    text = lambda out: out[out.index("=== [0]"): out.index("\nsummary:")]
    assert text(out1) == text(out2) and "finish_reason=length tokens=4" in text(out1)
    # the engine's step programs: compiled by the first run, loaded (no trace, no lowering) by the second
    assert any(p.startswith("mla_jax_executables" + os.sep) for p in first), first
    assert "step programs: 0 compiled" in out2 and "step programs: 0 compiled" not in out1, out2[-400:]
