"""Compiled step programs that persist across processes: a second run traces, lowers and compiles nothing.

JAX's persistent compilation cache (compile_cache.py) skips XLA's compile, but every new process still traces and
lowers each step function to find its cache key, and lowering runs the Mosaic GPU kernels' own code generation:
on an H200 the embedded model's second `generate.py` run spent 1.9 s tracing and 3.5 s lowering for 1.2 s of
cache reads (bench/results/startup_h200_a5f4223.json), 1.3 s of it before the first token. This store keeps the
compiled executables themselves (`jax.experimental.serialize_executable`) under a key computed without tracing:

    key = sha256(program name, engine identity (model graph, config, backend, ...), argument shapes / dtypes /
                 shardings, static arguments, jax and jaxlib versions, platform and devices, XLA_FLAGS,
                 the source of mla_jax and pallas_kernels)

so any change to the code, the model, the arguments or the toolchain gives a new key (a compile), never a stale
program. In a process, each (program, call signature) is resolved once: from this process's memory, else from
disk, else lowered, compiled and written. Programs with host callbacks (Pallas interpret mode) or closed-over
constants are compiled but not written: their executables hold pointers into this process.

The directory: `<JAX's compilation cache directory>/mla_jax_executables` when the JAX cache is on (scripts turn it
on through compile_cache.enable_compilation_cache, with its flag and MLA_JAX_COMPILATION_CACHE), else nothing is
written and the store only compiles ahead of time in memory.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

import jax

logger = logging.getLogger(__name__)

SUBDIR = "mla_jax_executables"
FORMAT = 1                                    # bump when the file's content changes
_PACKAGES = ("mla_jax", "pallas_kernels")
_PROCESS_PROGRAMS: dict[str, Any] = {}        # key -> Compiled, shared by every store in the process
_LOCK = threading.Lock()
_BYPASS_LOCK = threading.Lock()          # one compile at a time with JAX's cache off


def default_directory() -> Optional[str]:
    """Where programs persist: inside JAX's compilation cache directory when that cache is enabled, else None."""
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return os.path.join(jax.config.jax_compilation_cache_dir, SUBDIR)


def forget_process_programs() -> None:
    """Drops the process-wide programs (tests: the next resolution goes to disk as a new process would)."""
    with _LOCK:
        _PROCESS_PROGRAMS.clear()


_SOURCE_DIGEST: Optional[str] = None


def source_digest() -> str:
    """sha256 over the .py files of mla_jax and pallas_kernels (paths and contents); computed once per process."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parents[2]
        for pkg in _PACKAGES:
            for path in sorted((root / pkg).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def toolchain_identity() -> str:
    """What the compiled bits depend on besides the program: versions, platform, devices, XLA flags."""
    import jaxlib
    devices = jax.devices()
    return repr((FORMAT, jax.__version__, jaxlib.__version__, jax.default_backend(), devices[0].client.platform_version,
                 tuple((d.id, d.device_kind) for d in devices), jax.process_index(), jax.process_count(),
                 os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64, source_digest()))


def arguments_signature(args: tuple) -> str:
    """The tree structure and each leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for x in leaves:
        aval = jax.typeof(x)
        sharding = getattr(x, "sharding", None)
        parts.append(f"{aval.str_short(short_dtypes=False)}|{aval.weak_type}|{sharding}")
    return "\n".join(parts)


@contextlib.contextmanager
def _jax_cache_bypassed(active: bool):
    """JAX's persistent cache off for one compile. An executable JAX read back from its cache does not serialize
    again completely on XLA:CPU (jax 0.11.2: loading that second copy fails at the first call with "Function
    convert_bitcast_fusion.54 not found"), so the programs this store writes are always compiled fresh; JAX's
    cache keeps serving every other function. JAX decides once per process whether its cache is used:
    reset_cache() makes it look again, before and after."""
    if not active or not jax.config.jax_enable_compilation_cache:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache
    with _BYPASS_LOCK:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", True)
            compilation_cache.reset_cache()


def _has_host_callbacks(lowered) -> bool:
    text = lowered.as_text()
    return "callback" in text


class ExecutableStore:
    """Resolves and runs compiled programs for one engine. identity: a string naming everything the programs
    depend on that is not in their arguments (the model graph and config, backend, page size, ...)."""

    def __init__(self, identity: str, directory: Optional[str] = None):
        self.directory = directory
        self._identity = hashlib.sha256(identity.encode()).hexdigest()
        self._programs: dict[tuple, Any] = {}
        self.stats = dict(memory=0, disk=0, compiled=0, written=0, not_written=0, load_errors=0)

    def __len__(self) -> int:
        return len(self._programs)

    def count(self, name: str) -> int:
        """Call signatures of program `name` resolved by this store."""
        return sum(1 for n, _ in self._programs if n == name)

    def call(self, name: str, fn: Callable, signature: Hashable, *args, identity: str = "", **static) -> Any:
        """fn(*args, **static) through its compiled program. fn is a jax.jit function whose static arguments are
        exactly `static` (keywords); `signature` must tell apart every call whose arguments differ in shape,
        dtype or sharding (e.g. the shapes of the small inputs: the weights and caches of an engine never change),
        and must include the static values. identity: what this program alone depends on besides the store's
        identity and its arguments (e.g. the decode loop's step count). The compiled program checks the arguments'
        types on every call."""
        program = self._programs.get((name, signature))
        if program is None:
            program = self._programs[(name, signature)] = self._resolve(name + identity, name, fn, args, static)
        return program(*args)

    # ---- resolution ------------------------------------------------------------------------------------------
    def _key(self, name: str, args: tuple, static: dict) -> str:
        h = hashlib.sha256()
        for part in (name, self._identity, toolchain_identity(), arguments_signature(args),
                     repr(sorted(static.items()))):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _resolve(self, keyed_name: str, name: str, fn: Callable, args: tuple, static: dict):
        key = self._key(keyed_name, args, static)
        with _LOCK:
            program = _PROCESS_PROGRAMS.get(key)
        if program is not None:
            self.stats["memory"] += 1
            return program
        path = os.path.join(self.directory, f"{name}-{key[:40]}.pkl") if self.directory else None
        if path is not None and os.path.exists(path):
            program = self._load(path)
            if program is not None:
                self.stats["disk"] += 1
                logger.debug("%s: loaded %s", name, path)
        if program is None:
            lowered = fn.lower(*args, **static)
            with _jax_cache_bypassed(path is not None):
                program = lowered.compile()
            self.stats["compiled"] += 1
            if path is not None:
                self._write(name, path, lowered, program)
        with _LOCK:
            _PROCESS_PROGRAMS[key] = program
        return program

    def _load(self, path: str):
        from jax.experimental.serialize_executable import deserialize_and_load
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:     # a truncated or foreign file: compile instead (and overwrite it)
            self.stats["load_errors"] += 1
            logger.warning("could not load the compiled program %s (%s: %s); compiling it again", path,
                           type(e).__name__, e)
            return None

    def _write(self, name: str, path: str, lowered, program) -> None:
        from jax.experimental.serialize_executable import serialize
        if _has_host_callbacks(lowered):
            self.stats["not_written"] += 1
            logger.debug("%s: not written (host callbacks, e.g. interpret mode)", name)
            return
        try:
            blob = pickle.dumps(serialize(program))
        except Exception as e:     # closed-over constants, a backend without serialization
            self.stats["not_written"] += 1
            logger.info("%s: compiled program not written (%s: %s)", name, type(e).__name__, e)
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)       # readers see the whole file or none
            self.stats["written"] += 1
        except OSError as e:
            self.stats["not_written"] += 1
            logger.warning("could not write the compiled program %s (%s); it will be compiled again next run",
                           path, e)
