"""No import cycles between the project's modules, and every module imports on its own.

The graph is read from the source, every `import` / `from ... import` statement, those inside functions
included (a late import that dodges a cycle at import time is still a cycle in the design; imports under
`if TYPE_CHECKING:` are for annotations and are not edges), so a cycle is
found whatever the import order of a particular run. Each module is then imported in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dsv41_jax", "kernels_pallas")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:  # `if TYPE_CHECKING:` imports exist for annotations only
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule when there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` runs a, a.b, a.b.c: the deepest project module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    # a package's __init__ re-exporting its submodules is not a cycle with them: drop submodule -> own
    # package edges (Python imports the package first, then the submodule)
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_imports_alone():
    """Each module in a fresh interpreter (one process for all, each import after clearing the project's
    modules), so none depends on another having been imported first."""
    names = sorted(_modules())
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] in ('dsv41_jax', 'kernels_pallas')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    _fresh_python(code)


def test_the_model_fixes_jaxs_trace_context_before_any_trace():
    """Importing the model registers every jax option its kernels' modules add to the trace context: an
    option registered later (the Pallas modules add one) changes the trace-cache key, and every program
    traced before it compiles a second time (each speculative-decode program did, on the H200)."""
    code = (
        "from jax._src import config\n"
        "import dsv41_jax\n"
        "before = set(config.trace_context_names())\n"
        "import kernels_pallas, jax.experimental.pallas, jax.experimental.pallas.triton, "
        "jax.experimental.pallas.tpu\n"
        "print(sorted(set(config.trace_context_names()) - before))\n"
    )
    out = _fresh_python(code)
    assert out.strip() == "[]", f"registered only when the kernels are imported: {out}"


def _fresh_python(code: str) -> str:
    """stdout of `code` run by a fresh interpreter in the repository (CPU only); fails on a nonzero exit."""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
