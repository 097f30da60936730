"""The package's layers import only downwards, and nothing imports in a cycle.

base -> config -> data -> dispatch and layout (backends, sharding) -> ops -> model -> validation,
introspection, the experiment and its step -> run (the run directory, restore, export) -> train ->
eval -> scaling -> the study -> the command lines. Every import counts, those inside functions too.
The one edge allowed upwards is the mixer registry loading its plugins (``model.registry`` ->
``model.mixers``). docs/ARCHITECTURE.md gives each layer's reason.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid_lm"
ALLOWED_BACK_EDGES = {("hybrid_lm.model.registry", "hybrid_lm.model.mixers")}
# modules by layer, lowest first; a module not listed takes its package's layer
LAYERS = [
    {"hybrid_lm", "hybrid_lm.errors", "hybrid_lm.files", "hybrid_lm.optional", "hybrid_lm.progress",
     "hybrid_lm.determinism", "hybrid_lm.lock", "hybrid_lm.signals", "hybrid_lm.compile_cache"},
    {"hybrid_lm.config"},
    {"hybrid_lm.data"},
    {"hybrid_lm.backends", "hybrid_lm.sharding"},
    {"hybrid_lm.ops"},
    {"hybrid_lm.model"},
    {"hybrid_lm.validate", "hybrid_lm.describe", "hybrid_lm.experiment", "hybrid_lm.step"},
    {"hybrid_lm.run"},
    {"hybrid_lm.train"},
    {"hybrid_lm.eval"},
    {"hybrid_lm.scaling"},
    {"hybrid_lm.study"},
    {"hybrid_lm.cli", "hybrid_lm.command", "hybrid_lm.train.cli", "hybrid_lm.data.cli", "hybrid_lm.eval.cli",
     "hybrid_lm.scaling.cli", "hybrid_lm.study.cli"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import hybrid_lm.model.x.y` -> the deepest module that exists
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("hybrid_lm"):
                found.add(t)
    return found


def _layer(name: str) -> int:
    probe = name
    while probe:
        for i, members in enumerate(LAYERS):
            if probe in members:
                return i
        probe = probe.rpartition(".")[0]
    raise AssertionError(f"{name} has no layer: add it to LAYERS in {__file__}")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_imports_go_down_the_layers(graph):
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, deps in graph.items() for d in sorted(deps)
              if _layer(d) > _layer(m) and (m, d) not in ALLOWED_BACK_EDGES]
    assert not upward, "\n".join(upward)


def test_no_import_cycles(graph):
    edges = {m: {d for d in deps if (m, d) not in ALLOWED_BACK_EDGES} for m, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):  # depth-first search; a grey node reached again closes a cycle
        state[m] = "grey"
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == "grey":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "black"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_function_level_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from hybrid_lm.config import Config\n    import hybrid_lm.model.registry\n")
    names = {"hybrid_lm.config": None, "hybrid_lm.model.registry": None, "hybrid_lm.model": None}
    assert _imports("hybrid_lm.x", mod, names) == {"hybrid_lm.config", "hybrid_lm.model.registry"}
