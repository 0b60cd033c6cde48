"""Filesystem helpers shared by the checkpoint readers and writers (converter, AWQ packer). Imports the standard
library only."""

import json
import os
import shutil


def read_generation_config(path: str) -> dict:
    """The parsed generation_config.json of the checkpoint directory `path`, or {} when it has none.

    The one reader of that file: the engine's eos ids, the tokenizer's extra stop tokens and generate.py's
    sampling defaults all come from here."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or remove the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def replace_dir(complete: str, final: str) -> None:
    """Moves the finished directory `complete` to `final`; an existing `final` is removed only after the move."""
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(complete, final)
        shutil.rmtree(old)
    else:
        os.rename(complete, final)
