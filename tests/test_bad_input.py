"""Bad input gives one clear line naming the file, the problem and the fix (issue 19): every checkpoint or config
fault through the library (CheckpointError / FileNotFoundError) and through scripts/generate.py and
scripts/convert.py (exit 2, one line on stderr, the traceback only with --verbose); flags checked before any model
is loaded; quiet library logging; the embedded model by name from any working directory."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

import mla_jax
from conftest import fixture_path
from mla_jax.checkpoint import converted
from mla_jax.checkpoint.errors import CheckpointError
from mla_jax.checkpoint.files import EMBEDDED_MODELS, SOURCE_CHECKPOINTS, read_generation_config, resolve_model_dir
from mla_jax.engine.text import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(REPO, "checkpoints", "tiny-deepseek-py")
FIX_WORDS = ("download", "fix", "re-run", "give", "pass", "remove")


def _script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generate():
    return _script("generate")


@pytest.fixture(scope="module")
def convert():
    return _script("convert")


def _assert_one_clear_line(message: str, file: str):
    assert "\n" not in message.strip(), message
    assert file in message, f"{file} not named in: {message}"
    assert any(w in message for w in FIX_WORDS), f"no fix in: {message}"


def _truncate(path, keep):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:keep])


# ---- HF directories ----------------------------------------------------------------------------------------------
def _hf_fault(kind: str, d: str) -> str:
    """Breaks the copy `d` of a fixture as `kind` says; returns the file that is at fault."""
    st = os.path.join(d, "model.safetensors")
    if kind == "truncated safetensors":
        _truncate(st, -1000)
        return st
    if kind == "header-only safetensors":
        _truncate(st, 40)
        return st
    if kind == "empty safetensors":
        open(st, "wb").close()
        return st
    if kind == "not safetensors":
        with open(st, "wb") as f:
            f.write(b"PK\x03\x04 this is a zip archive, not safetensors" * 20)
        return st
    cfg = os.path.join(d, "config.json")
    if kind == "invalid config.json":
        with open(cfg, "a") as f:
            f.write("\n,}")
        return cfg
    if kind == "config.json not an object":
        with open(cfg, "w") as f:
            f.write("[1, 2]")
        return cfg
    if kind == "config.json not utf-8":
        with open(cfg, "wb") as f:
            f.write(b'{"model_type": "\xff\xfe"}')
        return cfg
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated safetensors", "header-only safetensors", "empty safetensors",
                                  "not safetensors", "invalid config.json", "config.json not an object",
                                  "config.json not utf-8"])
def test_hf_faults_name_the_file(tmp_path, kind):
    d = str(tmp_path / "ckpt")
    shutil.copytree(fixture_path("v3_plain"), d)
    bad = _hf_fault(kind, d)
    with pytest.raises(CheckpointError) as e:
        mla_jax.load_model(d)
    _assert_one_clear_line(str(e.value), bad)
    assert e.value.file == bad


def test_shard_index_faults(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(fixture_path("v2_lite"), d)
    index = d / "model.safetensors.index.json"
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[1]
    os.remove(d / shard)
    with pytest.raises(FileNotFoundError) as e:
        mla_jax.load_model(d)
    _assert_one_clear_line(str(e.value), shard)
    assert str(index) in str(e.value)
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        mla_jax.load_model(d)
    _assert_one_clear_line(str(e.value), str(index))
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map") as e:
        mla_jax.load_model(d)
    _assert_one_clear_line(str(e.value), str(index))


# ---- side files: generation config, tokenizer ----------------------------------------------------------------------
@pytest.fixture
def tokenizer_dir(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(EMBEDDED, name), d / name)
    assert Tokenizer.from_dir(d) is not None
    return d


@pytest.mark.parametrize("name, content", [("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}'),
                                           ("tokenizer.json", '{"version": '),
                                           ("tokenizer_config.json", '{"bos_token": '),
                                           ("generation_config.json", "temperature = 0.6")])
def test_tokenizer_and_generation_config_faults(tokenizer_dir, name, content):
    (tokenizer_dir / name).write_text(content)
    with pytest.raises(CheckpointError) as e:
        Tokenizer.from_dir(tokenizer_dir)
    _assert_one_clear_line(str(e.value), str(tokenizer_dir / name))
    if name == "generation_config.json":
        with pytest.raises(CheckpointError):
            read_generation_config(str(tokenizer_dir))


# ---- converted directories ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conv") / "v3_plain")
    converted.convert_checkpoint(fixture_path("v3_plain"), out, progress=False)
    return out


def _largest_data_file(group_dir):
    files = [os.path.join(root, f) for root, _, fs in os.walk(group_dir) for f in fs if os.sep + "d" in root]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("kind", ["truncated item", "missing item", "empty orbax metadata", "flipped byte"])
def test_converted_faults_name_the_group(conv, tmp_path, kind):
    d = str(tmp_path / "conv")
    shutil.copytree(conv, d)
    group = os.path.join(d, "weights", "layers.1")
    data = _largest_data_file(group)
    if kind == "truncated item":
        _truncate(data, 100)
    elif kind == "missing item":
        os.remove(data)
    elif kind == "empty orbax metadata":
        open(os.path.join(group, "_METADATA"), "w").close()
    else:
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(CheckpointError) as e:
        mla_jax.load_model(d)
    _assert_one_clear_line(str(e.value), group)
    assert "scripts/convert.py" in str(e.value)
    if kind == "flipped byte":       # the manifest's crc32 names the tensor (or orbax cannot decode the item)
        assert "checksum" in str(e.value) or "cannot be read" in str(e.value)


def test_converted_manifest_faults_and_relative_paths(conv, tmp_path, monkeypatch):
    d = tmp_path / "conv"
    shutil.copytree(conv, d)
    monkeypatch.chdir(tmp_path)
    model, cfg = mla_jax.load_model("conv")             # orbax wants absolute paths; we give it one
    assert cfg.num_hidden_layers == model.cfg.num_hidden_layers
    (d / "manifest.json").write_text('{"format": "mla_jax.converted", ')
    with pytest.raises(CheckpointError) as e:
        mla_jax.load_model("conv")
    _assert_one_clear_line(str(e.value), "manifest.json")


# ---- the scripts -------------------------------------------------------------------------------------------------
def test_generate_reports_one_line_and_traceback_only_when_verbose(generate, tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    shutil.copytree(fixture_path("v3_plain"), d)
    bad = _hf_fault("truncated safetensors", d)
    argv = ["--model", d, "--prompt-token-ids", "1,2,3"]
    assert generate.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and bad in lines[0]
    assert generate.main(argv + ["--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "SafetensorError" in err
    assert err.strip().splitlines()[-1] == lines[0]


def test_convert_reports_one_line(convert, tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    shutil.copytree(fixture_path("v3_plain"), d)
    bad = _hf_fault("invalid config.json", d)
    for extra in ([], ["--awq-group-size", "8"]):
        assert convert.main([d, str(tmp_path / "out"), "--quiet", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and bad in err[0] and "not valid JSON" in err[0]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("argv, reason", [
    (["--max-tokens", "-5"], "--max-tokens -5: must be >= 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be >= 1"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be >= 1"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt-token-ids", "1,x"], "--prompt-token-ids '1,x': give comma-separated integers"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--model", "tiny-deepseek-py-typo"], "tiny-deepseek-py-typo"),
])
def test_generate_checks_flags_before_loading(generate, capsys, monkeypatch, argv, reason):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(mla_jax, "LLM", no_load)
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and reason in err[0], err


def test_generate_text_prompts_need_a_tokenizer_before_loading(generate, capsys, monkeypatch):
    monkeypatch.setattr(mla_jax, "LLM", lambda *a, **k: pytest.fail("loaded"))
    for argv in ([], ["--chat", "--prompt", "hi"]):
        assert generate.main(["--model", fixture_path("v3_plain"), *argv]) == 2
        err = capsys.readouterr().err
        assert "has no tokenizer.json" in err and "--prompt-token-ids" in err


def test_generate_backend_error_names_the_cli_flag(generate, capsys):
    assert generate.main(["--attention-backend", "triton", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass --interpret" in err and "interpret=True" not in err and "--attention-backend auto" in err


def test_chat_header_shows_the_rendered_prompt(generate, capsys):
    assert generate.main(["--chat", "--prompt", "print the numbers", "--max-tokens", "1"]) == 0
    rendered = Tokenizer.from_dir(EMBEDDED).apply_chat_template([{"role": "user", "content": "print the numbers"}])
    assert isinstance(rendered, str) and "print the numbers" in rendered
    assert f"=== [0] prompt: {rendered!r}" in capsys.readouterr().out


def _run_script(args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_scripts_quiet_and_no_stray_tracebacks(conv, tmp_path):
    """Fresh processes (logging set up as a user gets it): convert.py prints no INFO or error lines from orbax/absl,
    and a truncated converted item gives exactly one line (no "Event loop is closed" tracebacks after it)."""
    out = _run_script([os.path.join(REPO, "scripts", "convert.py"), fixture_path("v3_plain"), "out", "--quiet"],
                      cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    assert out.stdout.startswith("wrote out: ")
    d = tmp_path / "conv"
    shutil.copytree(conv, d)
    _truncate(_largest_data_file(str(d / "weights" / "layers.1")), 100)
    bad = _run_script([os.path.join(REPO, "scripts", "generate.py"), "--model", "conv", "--prompt-token-ids", "1,2"],
                      cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "weights/layers.1" in lines[0], bad.stderr


# ---- the embedded model by name ------------------------------------------------------------------------------------
def test_embedded_model_resolves_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert EMBEDDED_MODELS == ("tiny-deepseek-py",)
    assert resolve_model_dir("tiny-deepseek-py") == os.path.join(SOURCE_CHECKPOINTS, "tiny-deepseek-py")
    assert os.path.samefile(resolve_model_dir("tiny-deepseek-py"), EMBEDDED)
    assert resolve_model_dir("some/other/dir") == "some/other/dir"          # left for the loader to report
    (tmp_path / "tiny-deepseek-py").mkdir()                                  # a directory of that name wins
    assert resolve_model_dir("tiny-deepseek-py") == "tiny-deepseek-py"
    os.rmdir(tmp_path / "tiny-deepseek-py")
    model, cfg = mla_jax.load_model("tiny-deepseek-py")
    assert cfg.quantization is not None and cfg.num_hidden_layers == 6


def test_embedded_model_missing_from_the_installation(monkeypatch, tmp_path):
    import mla_jax.checkpoint.files as files

    monkeypatch.setattr(files, "SOURCE_CHECKPOINTS", str(tmp_path / "site-packages-without-checkpoints"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"embedded model 'tiny-deepseek-py' is not at .*pip install -e"):
        files.resolve_model_dir("tiny-deepseek-py")


def test_failed_restore_drops_only_its_own_stray_read_reports(tmp_path, caplog):
    """After one read of a restore fails, the other reads' never-awaited exceptions are logged by asyncio when
    collected (a race: CI saw 17 traceback lines after the one-line error). restoring() drops exactly the reports
    that name the failed directory; reports about anything else still reach the log."""
    from mla_jax.checkpoint.errors import CheckpointError, restoring

    failed, other = tmp_path / "conv" / "weights" / "layers.1", tmp_path / "elsewhere"
    with pytest.raises(CheckpointError, match=r"layers\.1: cannot be read \(ValueError: OUT_OF_RANGE"):
        with restoring(failed):
            raise ValueError("OUT_OF_RANGE: Error reading x in OCDBT database")
    report = ("Task exception was never retrieved\nfuture: <Task finished exception=ValueError('OUT_OF_RANGE: Error "
              "reading \"y\" in OCDBT database at local file \"{}/\": Requested byte range [0, 8) is not valid')>")
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error(report.format(failed))
        log.error(report.format(other))
        log.error("Task exception was never retrieved: something unrelated")
    kept = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(kept) == 2 and str(other) in kept[0] and "unrelated" in kept[1], kept
    # a restore that completes forgets its directory: later reports naming it are not dropped
    ok = tmp_path / "ok"
    with restoring(ok):
        pass
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error(report.format(ok))
    assert any(str(ok) in r.getMessage() for r in caplog.records if r.name == "asyncio")
