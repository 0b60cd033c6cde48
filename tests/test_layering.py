"""The layering is a checked contract (docs/architecture.md §1).

(a) import-linter's contracts in pyproject.toml ([tool.importlinter]) hold: `lint-imports` passes.
(b) Independently of import-linter, the import graph of mla_jax and pallas_kernels, built here with `ast` from
    every import statement (module level and inside functions), has no cycle, and no function imports a project
    module: an import hidden in a function is how a cycle stays invisible.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mla_jax", "pallas_kernels")


def project_modules(root: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file of PACKAGES under root (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def imported_modules(module: str, path: str, modules: dict[str, str]):
    """(imported project module, line, inside a function) for every import statement of the file."""
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)

    def resolve(name: str) -> str | None:
        """The longest prefix of `name` that is a project module (None: not a project import)."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if (target := resolve(alias.name)) is not None:
                        yield target, child.lineno, inside
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in child.names:          # `from pkg import submodule` imports the submodule
                    if (target := resolve(f"{base}.{alias.name}")) is not None:
                        yield target, child.lineno, inside
            yield from visit(child, inside)

    yield from visit(tree, False)


def import_graph(root: str = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the project modules it imports, one line per function-local project import)."""
    modules = project_modules(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    local: list[str] = []
    for module, path in modules.items():
        for target, line, inside in imported_modules(module, path, modules):
            if target != module:
                edges[module].add(target)
            if inside:
                local.append(f"{os.path.relpath(path, root)}:{line} imports {target} inside a function")
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_import_linter_contracts_hold():
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(lint_imports):
        pytest.fail(f"{lint_imports} not found: install the test extra (pip install -e '.[test]'), which brings "
                    "import-linter")
    r = subprocess.run([lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"lint-imports failed:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"


def test_no_import_cycles():
    edges, _ = import_graph()
    found = cycles(edges)
    described = ["  " + " <-> ".join(c) + "\n    " + "\n    ".join(
        f"{a} imports {b}" for a in c for b in sorted(edges[a] & set(c))) for c in found]
    assert not found, "import cycles among project modules:\n" + "\n".join(described)


def test_no_function_local_project_imports():
    _, local = import_graph()
    assert not local, ("project modules imported inside functions (import them at the top of the file; an "
                       "optional third-party dependency may stay local):\n  " + "\n  ".join(local))


def test_the_checks_see_cycles_and_local_imports(tmp_path):
    """The graph builder itself: a two-module cycle through a function-local import is reported."""
    pkg = tmp_path / "mla_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from mla_jax import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    edges, local = import_graph(str(tmp_path))
    assert cycles(edges) == [["mla_jax.a", "mla_jax.b"]]
    assert local == [f"{os.path.join('mla_jax', 'b.py')}:2 imports mla_jax.a inside a function"]
