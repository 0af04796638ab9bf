"""dart_core's modules import each other in one direction: no import circle among the library
modules (TYPE_CHECKING-only imports aside), no module imports one of the project's own modules
inside a function to dodge a circle (the package's lazy top-level exports aside), and the layers
import downwards only: ngram_service ← dart_core.model ← spec ← step ← serve ← the API, training and
benchmarks on top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dart_core", "ngram_service")
ENTRY_POINTS = ("bench", "train")  # command-line entry points (folders, and bench.py / *_bench.py files):
# their lazy imports keep `--help` fast
# lazy on purpose, with the reason in the module: `import dart_core.<light module>` must not load torch
LAZY = {"dart_core/__init__.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT)
            if any(part in ENTRY_POINTS for part in rel.parts) or "_proto" in rel.parts \
                    or rel.stem == "bench" or rel.stem.endswith("_bench"):
                continue
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, modules) -> tuple[set[str], set[str]]:
    """(module-level, function-level) imports of the project's modules by ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    top, inner = set(), set()
    for node in ast.walk(tree):
        names = []
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            if not names and node.module in modules and node.module not in PACKAGES:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name in modules]
        (top if node.col_offset == 0 else inner).update(names)
    return top, inner


def test_no_import_circle_and_no_hidden_import():
    modules = _modules()
    assert len(modules) > 30
    graph, hidden = {}, {}
    for name, path in modules.items():
        top, inner = _imports(path, modules)
        graph[name] = top | inner
        rel = str(path.relative_to(ROOT))
        if inner and rel not in LAZY:
            hidden[rel] = sorted(inner)
    assert hidden == {}, f"imports inside functions: {hidden}"
    # depth-first search for a back edge
    state, circles = {}, []

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], f"import circles: {circles}"


def test_the_check_sees_a_circle_and_a_hidden_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("import os\n\ndef f():\n    from dart_core.step.engine import DartEngine\n")
    top, inner = _imports(a, {"dart_core.step.engine": None})
    assert top == set() and inner == {"dart_core.step.engine"}


#: dart_core's layers, bottom first; a module may import its own layer and the ones below it
LAYERS = ("ngram_service", "dart_core.model", "dart_core.spec", "dart_core.step", "dart_core.serve")


def _layer(module: str) -> int:
    """The layer index of a module (the top, everything else in dart_core: len(LAYERS))."""
    for i, prefix in reversed(list(enumerate(LAYERS))):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return len(LAYERS)


def _all_modules() -> dict[str, Path]:
    """Every module of both packages, the entry points (bench, train) included."""
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if "_proto" in p.parts:
                continue
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def test_the_layers_import_downwards_only():
    modules = _all_modules()
    assert {"dart_core.model.target", "dart_core.spec.drafters", "dart_core.step.engine",
            "dart_core.serve.batcher", "dart_core.api"} <= set(modules)
    upward = {}
    for name, path in modules.items():
        top, inner = _imports(path, modules)
        up = sorted(m for m in top | inner if _layer(m) > _layer(name))
        if up:
            upward[name] = up
    assert upward == {}, f"imports from a higher layer: {upward}"
    # every module of dart_core but the package root, the API and the entry points sits in a layer
    loose = [n for n in modules if n.startswith("dart_core.") and _layer(n) == len(LAYERS)
             and n != "dart_core.api" and not n.startswith(("dart_core.bench", "dart_core.train"))]
    assert loose == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from dart_core.step.engine import DartEngine\n")
    top, _ = _imports(a, {"dart_core.step.engine": None})
    assert [m for m in top if _layer(m) > _layer("dart_core.spec.drafters")] == ["dart_core.step.engine"]
