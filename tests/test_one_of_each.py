"""One of each: one default loss, one nested-value walker, one meaning of "report".

The code is read with ``ast`` (every module of fxdebug), so a second loss or a second walker
fails here the day it is written. Ground truth for the loss: the sum written out by hand for
the example's outputs, and its gradient by ``torch.autograd.grad`` of that sum; for the walker's
JSON: the dict written out by hand.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import json
import pathlib
import textwrap

import torch

import fxdebug
from fxdebug.dumping.folder_runtime import run_py_source
from fxdebug.runtime import values
from fxdebug.tables.report import Report

PACKAGE = pathlib.Path(fxdebug.__file__).resolve().parent
CONTAINERS = {"list", "tuple", "dict"}

# Functions another change is replacing: the dump pipeline's own loss and container walk move to
# outputs_loss and the walker. An entry that is gone fails the test too: delete it from here.

# Recursive walks over containers that are not the walk of a nested value (or write one as text,
# keeping each container's brackets and class, which the walker's (name, item) pairs leave out).
OTHER_WALKS = {
    ("dumping/forward.py", "_leaf_expressions"): "a pytree TreeSpec, into code",
    ("dumping/forward.py", "_rebuilt"): "a pytree TreeSpec, into code",
    ("dumping/literals.py", "literal"): "a value as Python source, brackets and classes kept",
    ("equivalence/node_matching.py", "_shown"): "fx node arguments as text, brackets kept",
    ("reporting/tabular.py", "_parts"): "fx node arguments as text, brackets and classes kept",
    ("hazards/lint.py", "_discover"): "the autograd graph (grad_fn.next_functions)",
    ("tracing/torch_caches.py", "_holds"): "torch's caches, sets included, by identity",
    ("tracing/torch_caches.py", "_replace_in"): "torch's caches, edited in place",
    ("tracing/fx_tracer.py", "create_arg"): "torch.fx's own Tracer.create_arg, whose override "
                                             "recurses through self.create_arg as fx does",
}


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def _sums_outputs(function) -> bool:
    """A comprehension summing each of its items (``t.sum() for t in ...``), next to a
    ``requires_grad`` test: a loss made of outputs."""
    if not any(isinstance(n, ast.Attribute) and n.attr == "requires_grad" for n in ast.walk(function)):
        return False
    for comp in ast.walk(function):
        if isinstance(comp, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            bound = {n.id for gen in comp.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            for call in ast.walk(comp.elt):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "sum":
                    summed = call.func.value
                    while isinstance(summed, ast.Attribute):  # t.real.sum()
                        summed = summed.value
                    if isinstance(summed, ast.Name) and summed.id in bound:
                        return True
    return False


def _tests_container_types(function) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            if {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & CONTAINERS:
                return True
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.In, ast.Eq)) for op in node.ops):
            if {n.id for c in node.comparators for n in ast.walk(c) if isinstance(n, ast.Name)} & CONTAINERS:
                return True
    return False


def _recurses(function) -> bool:
    """Calls itself (``self.f`` too, not ``super().f``) or pops a stack in a loop."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name) and target.id == function.name:
                return True
            if (isinstance(target, ast.Attribute) and target.attr == function.name
                    and not (isinstance(target.value, ast.Call) and getattr(target.value.func, "id", "") == "super")):
                return True
        if isinstance(node, ast.While) and any(
                isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "pop" for n in ast.walk(node)):
            return True
    return False


def test_one_function_makes_the_default_loss():
    found = {(path, function.name) for path, function in _functions() if _sums_outputs(function)}
    assert found == {("runtime/values.py", "outputs_loss")}, (
        "fxdebug.runtime.values.outputs_loss is the one default loss: call it")


def test_one_walker_opens_nested_values():
    found = {(path, function.name) for path, function in _functions()
             if path != "runtime/values.py" and _tests_container_types(function) and _recurses(function)}
    assert found == set(OTHER_WALKS), (
        "walk nested values with fxdebug.runtime.values (named_leaves, leaves, map_leaves, "
        "map_tensors, json_safe)")


def test_the_scans_see_what_they_look_for():
    loss = ast.parse("def f(out):\n    return sum(t.sum() for t in out if t.requires_grad)").body[0]
    walk = ast.parse("def g(v):\n    return [g(i) for i in v] if isinstance(v, list) else v").body[0]
    count = ast.parse("def h(out):\n    return sum(int(torch.isnan(t).sum()) for t in out if t.requires_grad)").body[0]
    assert _sums_outputs(loss) and _tests_container_types(walk) and _recurses(walk)
    assert not _sums_outputs(walk) and not _recurses(loss) and not _sums_outputs(count)


def _outputs(x):
    real = x * 2
    complex_ = torch.complex(x, x * x)
    return real, {"z": [complex_], "n": 3, "int": x.detach().long()}


def test_the_one_loss_counts_complex_outputs_and_run_py_carries_it():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    by_hand = (x * 2).sum() + torch.complex(x, x * x).real.sum()  # ground truth: the sum, written out
    want = torch.autograd.grad(by_hand, x)[0]
    assert torch.equal(want, torch.full((3,), 3.0))
    namespace: dict = {}  # run.py's own: torch and what it carries, no fxdebug
    exec(compile("import dataclasses\nimport torch\n" + run_py_source(), "run.py", "exec"),
         namespace)
    for loss in (values.outputs_loss, namespace["outputs_loss"]):
        value = loss(_outputs(x))
        assert torch.equal(value.detach(), by_hand.detach())
        assert torch.equal(torch.autograd.grad(value, x)[0], want)
    code = ast.parse(textwrap.dedent(inspect.getsource(values.outputs_loss)))  # nothing
    # imported, no fxdebug name used
    assert not [n for n in ast.walk(code) if isinstance(n, (ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.Name) and n.id == "fxdebug")]


def test_leaves_and_named_leaves_take_the_same_arguments_in_the_same_order():
    ours = [list(inspect.signature(f).parameters) for f in (values.named_leaves, values.leaves)]
    assert ours[0] == ours[1] == ["value", "prefix", "is_leaf"]
    value = (1, {"b": 2, "c": "x"})
    is_int = lambda item: isinstance(item, int)  # noqa: E731
    assert values.leaves(value, "p", is_leaf=is_int) == [
        (key, leaf) for key, leaf in values.named_leaves(value, "p", is_leaf=is_int) if is_int(leaf)]
    assert values.leaves(value, "p", is_leaf=is_int) == [("p/0", 1), ("p/1/b", 2)]


Pair = collections.namedtuple("Pair", "h c")


@dataclasses.dataclass
class _Row:
    shape: str  # a dataclass with shape and dtype fields is a dataclass, not a tensor
    dtype: str


@dataclasses.dataclass
class _Found(Report):
    rows: list
    first: Pair
    by_key: collections.OrderedDict
    _hidden: int = 0

    def table(self, wide=None):
        return f"{len(self.rows)} rows"


def test_to_dict_is_the_walkers_json():
    report = _Found([torch.zeros(2, 3), float("inf"), _Row("2x3", "float32")], Pair(1, None),
                    collections.OrderedDict(a=torch.ones(1, dtype=torch.float16)))
    want = {"kind": "_Found", "ok": None, "size": "", "finding": "",  # written out by hand
            "rows": [{"shape": [2, 3], "dtype": "float32"}, "inf", {"shape": "2x3", "dtype": "float32"}],
            "first": [1, None],
            "by_key": {"a": {"shape": [1], "dtype": "float16"}}}
    assert report.to_dict() == want
    assert json.loads(json.dumps(report.to_dict())) == want
    assert values.json_safe([report]) == [want]  # a report inside a value: its to_dict()


def test_a_class_named_report_is_a_report():
    """"report" means one thing: a result with the Report shape (.ok, .table(), to_dict())."""
    import importlib
    named = []
    for path, node in ((p, n) for p in sorted(PACKAGE.rglob("*.py"))
                       for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)):
        if "report" in node.name.lower():
            module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
            named.append(getattr(importlib.import_module(module), node.name))
    assert len(named) >= 8
    assert [cls.__name__ for cls in named if not issubclass(cls, Report)] == []


def test_every_report_module_brings_the_walker_to_dict_uses():
    """Report.to_dict is handed json_safe when fxdebug.runtime.values is imported (the report
    shape sits below the runtime): every module defining a report imports it, through its
    imports or its packages' ``__init__``."""
    from test_layout import import_graph
    graph = import_graph()

    def imported(module: str) -> set[str]:
        seen: set[str] = set()
        todo = [module]
        while todo:
            name = todo.pop()
            if name in seen or name not in graph:
                continue
            seen.add(name)
            parts = name.split(".")
            todo.extend(".".join(parts[:i]) for i in range(2, len(parts)))  # its packages
            todo.extend(graph[name])
        return seen

    defining = [module for module in sorted(graph) if any(
        isinstance(node, ast.ClassDef) and any(getattr(base, "id", "") == "Report" for base in node.bases)
        for node in ast.walk(ast.parse(_source(module))))]
    assert len(defining) >= 8 and "fxdebug.runtime.values" not in imported("fxdebug.tables.report")
    assert [m for m in defining if "fxdebug.runtime.values" not in imported(m)] == []


def _source(module: str) -> str:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    return (path if path.exists() else path.with_suffix("") / "__init__.py").read_text()
