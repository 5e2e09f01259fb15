"""Layering: every import points downward.

scheduler never imports jax; pallas_kernels imports no other package of ours; models import
neither the runtime nor the engine; the host-loop, CLI, workload and multi-process launch
packages load without jax; and no import cycle exists among our modules (module-level imports,
`TYPE_CHECKING` blocks aside)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "pallas_kernels", "tokenspeed_jax")
JAX = {"jax", "jaxlib", "flax", "chex", "pallas_kernels"}


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def _top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_scheduler_does_not_import_jax():
    loaded = _top(_loaded_after_import("scheduler"))
    assert not loaded & {"jax", "jaxlib", "flax", "chex", "tokenspeed_jax", "pallas_kernels"}


def test_pallas_kernels_imports_only_jax():
    loaded = _top(_loaded_after_import("pallas_kernels"))
    assert "jax" in loaded
    assert not loaded & {"scheduler", "tokenspeed_jax", "flax"}


def test_cli_and_load_generator_do_not_import_jax():
    """The CLI's parsing, the workload definition and `bench serve`'s HTTP load generator load
    without jax (`tokenspeed_jax/__init__` imports LLM on first use only)."""
    loaded = _loaded_after_import(
        "tokenspeed_jax.cli, tokenspeed_jax.cli.bench_serve, "
        "tokenspeed_jax.workloads.loadgen, tokenspeed_jax.workloads.agentic"
    )
    assert not _top(loaded) & JAX


def test_host_packages_do_not_import_jax():
    """The host loop and the package files of cli/workloads/engine/distributed/structured stay
    jax-free."""
    for module in (
        "tokenspeed_jax.engine",
        "tokenspeed_jax.engine.engine",
        "tokenspeed_jax.engine.replicas",
        "tokenspeed_jax.cli",
        "tokenspeed_jax.workloads",
        "tokenspeed_jax.distributed",
        "tokenspeed_jax.structured",
        "tokenspeed_jax.engine_args",
    ):
        assert not _top(_loaded_after_import(module)) & JAX, module


def test_models_import_neither_runtime_nor_engine():
    loaded = _loaded_after_import("tokenspeed_jax.models, tokenspeed_jax.models.registry")
    above = (
        "tokenspeed_jax.runtime",
        "tokenspeed_jax.engine",
        "tokenspeed_jax.distributed",
        "tokenspeed_jax.server",
        "tokenspeed_jax.cli",
        "tokenspeed_jax.llm",
    )
    # the option record (engine_args, jax-free) is below the models: they read its choice lists
    bad = {m for m in loaded if any(m == a or m.startswith(a + ".") for a in above)}
    assert not bad, sorted(bad)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
    """Our modules that `path` imports at run time (anywhere, deferred imports included, but not
    under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def test_no_import_cycles():
    paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, _module_name(p), modules) for p in paths}
    # a package's __init__ importing its own submodules is a re-export, not a cycle
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_flat_top_level_is_small():
    flat = sorted(p.name for p in (ROOT / "tokenspeed_jax").glob("*.py"))
    assert len(flat) <= 8, flat
