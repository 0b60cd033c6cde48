"""Lazily imported public names for a package's __init__ (name -> module, imported on first use), so that
importing a light module of the package does not pull in jax, flax or the kernels."""
import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """(__getattr__, __dir__) for the package `package` whose globals are `namespace`."""

    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
