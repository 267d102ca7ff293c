"""The package reads as its data flow: no import cycle, imports only down the stages, short modules.

Every ``import`` in ``fxdebug/**/*.py`` is read with ``ast``, those inside
functions too, so a cycle cannot hide behind a local import.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxdebug"

# Stages from the bottom up: a module imports only from its own stage's package or a lower one.
STAGES = {
    "fxdebug.errors": 0,
    "fxdebug.base": 1,
    "fxdebug.stats": 2,
    "fxdebug.runtime": 3,
    "fxdebug.tracing": 4,
    "fxdebug.partial": 5,
    "fxdebug.frontend": 6,
    "fxdebug.passes": 7,
    "fxdebug.reporting": 8,
    "fxdebug.dumping": 9,
    "fxdebug.equivalence": 10,
    "fxdebug.hazards": 10,
    "fxdebug.distributed": 11,
    "fxdebug.runs": 12,
    "fxdebug.nonfinite": 13,
    "fxdebug.compiled": 14,
    "fxdebug.instrumenting": 15,
    "fxdebug.pass_manager": 15,
    "fxdebug.testing": 15,
    "fxdebug.precision": 15,
    "fxdebug.monitoring": 16,
    "fxdebug.cli": 17,
    "fxdebug.__main__": 18,
    "fxdebug": 18,
}
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, list[str]]:
    """``{module: [fxdebug modules it imports]}``, imports inside functions included."""
    modules = _modules()
    graph: dict[str, list[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, None] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:  # `from . import runtime` imports a module
                    full = f"{source}.{alias.name}"
                    targets[full if full in modules else source] = None
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    targets[alias.name] = None
        graph[name] = [t for t in targets if t in modules and t != name]
    return graph


def _stage(module: str) -> tuple[str, int]:
    for prefix in sorted(STAGES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, STAGES[prefix]
    raise AssertionError(f"{module} belongs to no stage; add its package to STAGES in {__file__}")


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: dict[str, bool] = {}
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack[node] = True
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif on_stack.get(target):
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack[member] = False
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read_from_every_module():
    graph = import_graph()
    assert "fxdebug.partial.trace_parts" in graph and "fxdebug.runtime" in graph["fxdebug.partial.trace_parts"]
    assert len(graph) >= 50


def test_no_import_cycle():
    assert _cycles(import_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_imports_only_go_down_the_stages():
    upward = []
    for module, targets in import_graph().items():
        package, rank = _stage(module)
        for target in targets:
            target_package, target_rank = _stage(target)
            if target_package != package and target_rank >= rank:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_runtime_imports_no_pass_and_no_front_end():
    for module, targets in import_graph().items():
        if module.startswith("fxdebug.runtime"):
            assert all(t.startswith(("fxdebug.runtime", "fxdebug.stats", "fxdebug.base",
                                     "fxdebug.errors"))
                       for t in targets), module


def test_no_module_over_600_lines():
    long = {str(path.relative_to(PACKAGE)): count for path in sorted(PACKAGE.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, "split these by job"


def _names_bound_by_imports(init: pathlib.Path) -> dict[str, str]:
    """``{name: module}`` for every ``from .module import name`` in a package's __init__."""
    bound = {}
    for node in ast.walk(ast.parse(init.read_text(), str(init))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = node.module
    return bound


def test_no_package_exports_a_name_of_its_own_submodule():
    """``import fxdebug.x.name`` would replace the function ``fxdebug.x.name`` by the module."""
    clashes = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        for name, source in _names_bound_by_imports(init).items():
            module = folder / f"{name}.py"
            if module.is_file() and "sys.modules[__name__] = " in module.read_text():
                continue  # an old path for pickles that stands the function in its own place
            if module.is_file() or (folder / name / "__init__.py").is_file():
                clashes.append(f"{folder.relative_to(PACKAGE.parent)}: {name} (from .{source})")
    assert clashes == []


def test_clash_detection_finds_a_clash(tmp_path):
    (tmp_path / "__init__.py").write_text("from .pipeline import dump\n")
    assert _names_bound_by_imports(tmp_path / "__init__.py") == {"dump": "pipeline"}


def test_every_entry_of_the_core_test_list_exists():
    """CI runs tests/core_tests.txt on the oldest torch: a file moved without it runs nothing."""
    root = PACKAGE.parent
    entries = [line.split("#")[0].strip() for line in
               (root / "tests" / "core_tests.txt").read_text().splitlines()]
    paths = [entry.split("::")[0] for entry in entries if entry and not entry.startswith("-")]
    missing = [path for path in paths if not (root / path).exists()]
    assert paths and not missing, f"tests/core_tests.txt names paths that do not exist: {missing}"
