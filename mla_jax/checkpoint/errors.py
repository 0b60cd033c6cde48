"""Faults in checkpoint and config files, reported as one `CheckpointError` that names the file, what is wrong
with it and what to do. Standard library plus `safetensors` only, so every reader (config.py at the bottom of
the layering, the checkpoint loaders, the tokenizer) can use it.

    read_json(file, what)        a JSON object from `file`, or CheckpointError (unreadable, invalid JSON, not an
                                 object)
    open_safetensors(file)       safetensors.safe_open, or CheckpointError (empty, truncated, not safetensors)
    restoring(directory)         context of one orbax restore: its failure as one CheckpointError, without the
                                 stray reports of its other reads (see the function)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, Iterator

from safetensors import SafetensorError, safe_open

REDOWNLOAD = "download or copy the file again (a partial download or an interrupted copy leaves it short)"
RECONVERT = "re-run scripts/convert.py SRC DST --force to write the converted directory again"


class CheckpointError(ValueError):
    """A checkpoint or config file that cannot be used. str(): "FILE: PROBLEM; FIX" (one line)."""

    def __init__(self, file: str | os.PathLike, problem: str, fix: str):
        self.file, self.problem, self.fix = os.fspath(file), problem, fix
        super().__init__(f"{self.file}: {problem}; {fix}")


def read_json(file: str | os.PathLike, what: str = "file") -> dict[str, Any]:
    """The JSON object in `file`. `what` says what the file is for, in the fix ("the model's config.json")."""
    file = os.fspath(file)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                              f"fix {what} or download it again") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(file, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                              f"{what} must be a JSON text file; download it again") from e
    if not isinstance(data, dict):
        raise CheckpointError(file, f"holds a JSON {type(data).__name__}, not an object",
                              f"{what} must be a JSON object {{...}}; fix it or download it again")
    return data


@contextlib.contextmanager
def open_safetensors(file: str | os.PathLike) -> Iterator[Any]:
    """safe_open(file, framework="numpy"). safetensors checks the header and that the data covers every tensor it
    lists, so an empty, truncated or foreign file fails here, before any tensor is read."""
    file = os.fspath(file)
    try:
        handle = safe_open(file, framework="numpy")
    except SafetensorError as e:
        size = os.path.getsize(file) if os.path.isfile(file) else None
        what = ("is empty (0 bytes)" if size == 0 else
                f"is not a complete safetensors file ({size} bytes; {_safetensors_reason(e)})")
        raise CheckpointError(file, what, REDOWNLOAD) from e
    with handle as f:
        yield f


def _safetensors_reason(e: Exception) -> str:
    msg = str(e).removeprefix("Error while deserializing header: ")
    hints = {"incomplete metadata, file not fully covered": "the data ends before the last tensor: truncated",
             "header too small": "too short for a header: truncated",
             "header too large": "no safetensors header at the start: another format or a corrupt file",
             "invalid header length": "the header runs past the end of the file: truncated"}
    for key, hint in hints.items():
        if msg.startswith(key):
            return hint
    return msg


_restore_dirs: set[str] = set()     # absolute directories whose restore is running or has failed


@contextlib.contextmanager
def restoring(directory: str | os.PathLike) -> Iterator[None]:
    """Wraps one orbax restore of `directory` (one weights group of a converted checkpoint): an exception becomes
    restore_error(directory, exc), and the stray reports its other reads make after one read failed are dropped.

    When one read fails, orbax raises at once while tensorstore's other reads of the same directory still finish:
    (1) each then reports RuntimeError('Event loop is closed') through sys.unraisablehook, and (2) their futures'
    exceptions, never awaited, are logged by asyncio ("Task exception was never retrieved", with the tensorstore
    error naming the file) when the futures are collected. Both come after (or while) the real error is raised,
    as tracebacks after the one-line error. The hook and the log filter are installed once, before the first
    restore (installed only after a failure they raced the reports, seen in CI), and drop exactly those reports:
    (1) always, (2) only when the logged exception names a directory whose restore is running or failed here.
    Everything else reaches the hook and the logger as before."""
    _install_report_filters()
    paths = {os.path.abspath(os.fspath(directory)), os.path.realpath(os.fspath(directory))}
    _restore_dirs.update(paths)
    try:
        yield
    except Exception as e:
        raise restore_error(directory, e) from e
    _restore_dirs.difference_update(paths)     # read whole: later reports, if any, are not this failure's


_installed = False
_NEVER_RETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")


def _install_report_filters() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook

    def sibling_read_failure(record) -> bool:
        msg = record.getMessage()
        return not (msg.startswith(_NEVER_RETRIEVED) and any(d in msg for d in _restore_dirs))

    logging.getLogger("asyncio").addFilter(sibling_read_failure)


def restore_error(directory: str | os.PathLike, exc: BaseException) -> CheckpointError:
    """The CheckpointError for an orbax restore of `directory` (one weights group of a converted checkpoint) that
    raised `exc`: a missing, truncated or corrupt file in it. The first line of orbax's/tensorstore's message
    names the tensor."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return CheckpointError(directory, f"cannot be read ({type(exc).__name__}: {first}): a file in it is missing, "
                           "truncated or corrupt", RECONVERT)


def load_safetensors(file: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of `file` as numpy arrays (safetensors.numpy.load_file, with open_safetensors' errors)."""
    with open_safetensors(file) as f:
        return {name: f.get_tensor(name) for name in f.keys()}
