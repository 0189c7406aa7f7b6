"""The package's imports run one way, down the layers, and never in a circle: every first-party import
counts, at the top of a module, inside a function or under TYPE_CHECKING, with pyproject's package-dir
mapping applied (engine/ is ``swiftspec.engine``)."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import its own layer and those below it. A module is placed by its own name,
# else by the longest package above it that is named.
LAYERS = [
    ("kernels", ["swiftspec.kernels"]),
    ("engine base", ["swiftspec.engine", "swiftspec.engine.config", "swiftspec.engine.events", "swiftspec.engine.paths",
                     "swiftspec.engine.timing"]),
    ("engine model", ["swiftspec.engine.model"]),
    ("engine speculation", ["swiftspec.engine.spec"]),
    ("engine host", ["swiftspec.engine.host"]),
    ("engine workers", ["swiftspec.engine.worker"]),
    ("app", ["swiftspec", "swiftspec.settings", "swiftspec.window", "swiftspec.history", "swiftspec.conversation",
             "swiftspec.cache", "swiftspec.scripted", "swiftspec.train_prompts", "swiftspec.train_draft"]),
    ("entry points", ["swiftspec.tui", "swiftspec.server", "swiftspec.bench"]),
    ("command line", ["swiftspec.cli", "swiftspec.__main__"]),
]


def modules() -> dict[str, Path]:
    """Every first-party module by its dotted name, found through pyproject's packages and package-dir."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    found = {}
    for package in cfg["packages"]:
        base = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / dirs[base] / package[len(base):].lstrip(".").replace(".", "/")
        for f in folder.glob("*.py"):
            found[package if f.name == "__init__.py" else f"{package}.{f.stem}"] = f
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def layer(name: str) -> int:
    named = {p: i for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes}
    part = name
    while part:
        if part in named:
            return named[part]
        part = part.rpartition(".")[0]
    raise LookupError(f"{name} belongs to no layer: add it to LAYERS")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
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

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer_and_the_map_is_complete():
    names = modules()
    assert len(names) > 80 and "swiftspec.engine.spec.loop" in names and "swiftspec.tui.app" in names
    for name in names:
        layer(name)


def test_no_import_runs_up_a_layer():
    upward = [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
              for a, targets in graph().items() for b in targets if layer(b) > layer(a)]
    assert upward == []


def test_no_circle_of_imports():
    assert circles(graph()) == []


@pytest.mark.parametrize("edges, want", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(edges, want):
    assert circles(edges) == want


def test_a_lazy_import_counts(tmp_path):
    """An import inside a function is an edge like any other: hiding one there does not hide a circle."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from swiftspec.engine.host import client\n")
    assert imports("swiftspec.engine.model.m", f, modules()) == {"swiftspec.engine.host.client"}


# The words of the typed vocabularies: device kinds (Device), draft kinds (DraftKind), dtypes (Dtype)
VOCABULARY = {"cpu", "cuda", "suffix", "int8", "float32", "bfloat16", "float16", "gguf", "int4"}


def vocabulary_comparisons(path: Path) -> list[str]:
    """Each comparison of a value with one of the vocabularies' words as a string literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            words = [c for side in sides for c in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
                     if isinstance(c, ast.Constant) and c.value in VOCABULARY]
            if words:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_and_the_app_compare_no_device_draft_or_dtype_word_as_a_string():
    """Device.of, DraftKind and Dtype read those words in engine/config.py alone; the kernels below the
    engine speak torch's own device types."""
    found = [hit for name, path in modules().items() if layer(name) > 0 for hit in vocabulary_comparisons(path)]
    assert found == []


def test_the_vocabulary_scan_finds_a_word_compared(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if x.type == "cuda" or kind in ("suffix", other):\n    pass\n')
    assert len(vocabulary_comparisons(f)) == 2
