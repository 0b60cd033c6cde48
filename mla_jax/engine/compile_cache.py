"""JAX's persistent compilation cache for the engine's entry points: a second run with the same shapes compiles
nothing (it reads the compiled programs back from disk).

    from mla_jax.engine.compile_cache import enable_compilation_cache
    enable_compilation_cache()          # before anything is compiled; returns the directory, or None if disabled

Where: the `path` argument (a CLI flag), else the environment variable MLA_JAX_COMPILATION_CACHE, else
$XDG_CACHE_HOME/mla_jax/jax_compilation_cache (~/.cache/... without XDG_CACHE_HOME). A value of "off" (or "0",
"none", "false", "no", "") disables the cache. JAX's cache is one per process (jax.config), so the library never
turns it on by itself: scripts/generate.py and scripts/bench_generate.py call this; programs that embed the LLM
call it themselves.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import jax

logger = logging.getLogger(__name__)

ENV_VAR = "MLA_JAX_COMPILATION_CACHE"
OFF_VALUES = frozenset({"", "0", "off", "none", "false", "no"})


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mla_jax", "jax_compilation_cache")


def resolve_cache_dir(path: Optional[str] = None) -> Optional[str]:
    """The directory the cache would use (path > $MLA_JAX_COMPILATION_CACHE > default), None when disabled."""
    value = path if path is not None else os.environ.get(ENV_VAR)
    if value is None:
        return default_cache_dir()
    if value.strip().lower() in OFF_VALUES:
        return None
    return os.path.abspath(os.path.expanduser(value))


def enable_compilation_cache(path: Optional[str] = None) -> Optional[str]:
    """Points JAX's persistent compilation cache at resolve_cache_dir(path) and caches every program (no minimum
    compile time or size), or disables it. Call before the first compilation. Returns the directory or None."""
    directory = resolve_cache_dir(path)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        logger.info("compilation cache disabled")
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the compilation cache directory {directory!r} ({e}); pass another "
                         f"directory or 'off' (flag or ${ENV_VAR})") from e
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("compilation cache: %s", directory)
    return directory
