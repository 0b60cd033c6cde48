"""Filesystem helpers shared by the checkpoint writers (converter, AWQ packer). Imports the standard library only."""

import os
import shutil


def replace_dir(complete: str, final: str) -> None:
    """Moves the finished directory `complete` to `final`; an existing `final` is removed only after the move."""
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(complete, final)
        shutil.rmtree(old)
    else:
        os.rename(complete, final)
