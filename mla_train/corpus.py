"""The training corpus: every UTF-8 .py file under a root (by default this interpreter's standard library), and its
split into train / validation / test by file.

  corpus  every .py file under sysconfig.get_paths()["stdlib"] (site-/dist-packages and caches skipped), walked in
          sorted order; files that are not UTF-8 are skipped and counted (the stdlib ships a few deliberately
          mis-encoded test files).
  split   by FILE: sha256(f"{seed}:{relpath}") as a fraction of its range puts a file in test (the lowest
          `heldout_fraction`), validation (the next `valid_fraction`) or train: stable per file, so another Python
          patch release moves no other file's side. Validation picks the checkpoint (the step with the best
          validation loss is kept); test is only scored, and is what scripts/eval_ppl.py reads back through
          `load_heldout_files` (the held-out files are listed with their sha256 in training.json).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the corpus root ("/"-separated) and its text."""

    relpath: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> str:
    """The default corpus root: this interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def read_python_files(root: str, max_files: int | None = None) -> tuple[list[SourceFile], list[str]]:
    """All .py files under root in sorted (relative path) order -> (files, relpaths skipped as non-UTF-8)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    rel = sorted(os.path.relpath(p, root) for p in paths)
    files, skipped = [], []
    for r in rel:
        with open(os.path.join(root, r), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(r)
            continue
        if text.strip():
            files.append(SourceFile(r.replace(os.sep, "/"), text))
        if max_files is not None and len(files) >= max_files:
            break
    if not files:
        raise ValueError(f"no UTF-8 .py files found under {root}")
    return files, skipped


def file_hash_fraction(relpath: str, seed: int) -> float:
    """Where the file's hash falls in [0, 1): a stable per-file draw (its position in the list plays no part)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{relpath}".encode()).digest()[:8], "big") / 2**64


def is_heldout(relpath: str, seed: int, fraction: float) -> bool:
    """Test split: the lowest `fraction` of the hash range."""
    return file_hash_fraction(relpath, seed) < fraction


def split_files(files: list[SourceFile], seed: int, test_fraction: float, valid_fraction: float = 0.0):
    """(train, valid, test) by file: test = hash in [0, test_fraction), valid = the next valid_fraction.
    valid picks the checkpoint (best validation loss); test is only ever scored."""
    if not 0.0 < test_fraction < 1.0 or not 0.0 <= valid_fraction < 1.0 - test_fraction:
        raise ValueError(f"need 0 < test_fraction < 1 and 0 <= valid_fraction < 1 - test_fraction, got "
                         f"{test_fraction}, {valid_fraction}")
    train, valid, test = [], [], []
    for f in files:
        u = file_hash_fraction(f.relpath, seed)
        (test if u < test_fraction else valid if u < test_fraction + valid_fraction else train).append(f)
    if not train or not test or (valid_fraction and not valid):
        raise ValueError(f"split of {len(files)} files left {len(train)} train / {len(valid)} validation / "
                         f"{len(test)} test files; use more files or other fractions")
    return train, valid, test


def load_heldout_files(model_dir: str, corpus_root: str | None = None) -> tuple[list[SourceFile], dict]:
    """The held-out files named in model_dir/training.json, read from this interpreter's stdlib (or corpus_root).

    A file whose sha256 differs from the recorded one (another Python patch release) is left out and counted,
    never silently substituted. Returns (files, {"listed", "matched", "changed", "missing"})."""
    info_path = os.path.join(model_dir, "training.json")
    if not os.path.isfile(info_path):
        raise FileNotFoundError(f"{info_path} not found: the held-out split is recorded there by "
                                f"scripts/train_tiny.py; evaluate a checkpoint it wrote")
    with open(info_path) as f:
        info = json.load(f)
    root = corpus_root or stdlib_root()
    files, changed, missing = [], [], []
    for entry in info["heldout"]:
        path = os.path.join(root, entry["path"])
        if not os.path.isfile(path):
            missing.append(entry["path"])
            continue
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
        f_ = SourceFile(entry["path"], text)
        if f_.sha256 != entry["sha256"]:
            changed.append(entry["path"])
            continue
        files.append(f_)
    stats = {"listed": len(info["heldout"]), "matched": len(files), "changed": changed, "missing": missing,
             "root": root}
    if not files:
        raise ValueError(f"none of the {len(info['heldout'])} held-out files of {info_path} were found unchanged "
                         f"under {root} (changed {len(changed)}, missing {len(missing)}); pass the corpus root "
                         f"of the Python that trained the model")
    return files, stats
