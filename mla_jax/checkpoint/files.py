"""Filesystem helpers shared by the checkpoint readers and writers (converter, AWQ packer): generation_config.json,
the embedded models by name, a load progress bar. Imports no jax."""

import os
import shutil

from tqdm import tqdm

from mla_jax.checkpoint.errors import read_json

# Models shipped with mla_jax, loadable by name from any working directory: LLM("tiny-deepseek-py").
EMBEDDED_MODELS = ("tiny-deepseek-py",)
# They live in the source tree's checkpoints/ (next to the package; an editable install imports from there).
SOURCE_CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "checkpoints")


def resolve_model_dir(model: str | os.PathLike) -> str:
    """The checkpoint directory `model` names: a path (an existing directory always wins), or the name of an
    embedded model (EMBEDDED_MODELS), which resolves to its directory under SOURCE_CHECKPOINTS. Any other string
    is returned unchanged, for the loader to report."""
    path = os.fspath(model)
    if os.path.isdir(path) or path not in EMBEDDED_MODELS:
        return path
    embedded = os.path.join(SOURCE_CHECKPOINTS, path)
    if not os.path.isdir(embedded):
        raise FileNotFoundError(
            f"the embedded model {path!r} is not at {embedded}: it ships in the source tree (checkpoints/{path}), "
            f"which this installation of mla_jax does not have; install from a clone (`pip install -e .`) or pass "
            f"the path of a model directory")
    return embedded


def read_generation_config(path: str) -> dict:
    """The parsed generation_config.json of the checkpoint directory `path`, or {} when it has none.

    The one reader of that file: the engine's eos ids, the tokenizer's extra stop tokens and generate.py's
    sampling defaults all come from here."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.isfile(file):
        return {}
    return read_json(file, "generation_config.json")


def replace_dir(complete: str, final: str) -> None:
    """Moves the finished directory `complete` to `final`; an existing `final` is removed only after the move."""
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(complete, final)
        shutil.rmtree(old)
    else:
        os.rename(complete, final)


def load_progress(path: str, total: int) -> tqdm:
    """The progress bar of loading `total` parameters from the checkpoint `path`: shown on a terminal only
    (tqdm's disable=None), so logs and captured output stay clean; gone once the load finished."""
    return tqdm(total=total, desc=f"loading {os.path.basename(os.path.normpath(path))}", unit="tensor",
                disable=None, leave=False)
