"""One pass runner and one table renderer, used by every caller.

The pass runner is :func:`fxdebug.passes.base.run_passes`: it runs the pass
protocol (``apply`` -> ``requires`` / ``call`` / ``ensures``) and adds the one
error note. The table renderer is :mod:`fxdebug.base.fit_to_width`: the only
module that imports tabulate or draws the line of dashes under a header.

The static checks read every module of ``fxdebug/`` with ``ast`` (functions
inside functions too); the run checks watch who calls a pass's ``apply`` from
every way in (a direct call, ``instrument()`` and its train/eval graphs,
``PassManager``, ``fxdebug check``). Ground truth for the renderer's bytes is
tabulate itself.
"""

from __future__ import annotations

import ast
import pathlib
import random
import re
import sys

import pytest
import torch
import torchvision
from tabulate import tabulate

import fxdebug
from fxdebug.cli import main as cli_main
from fxdebug.passes import Pass
from fxdebug.base.fit_to_width import fit_table

PACKAGE = pathlib.Path(fxdebug.__file__).resolve().parent
RUNNER = ("passes/base.py", "run_passes")
RENDERER = "base/fit_to_width.py"
PASS_PROTOCOL = {"apply", "call", "requires", "ensures"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def _functions(tree):
    """``(qualified name, function node)`` of every function, methods and nested ones too."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def _own_calls(function):
    """The calls in ``function``'s own body (not in functions defined inside it)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported_names(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def pass_protocol_callers() -> list[str]:
    """Every function that calls a pass's ``apply`` / ``call`` / ``requires`` / ``ensures``
    on something other than ``self`` (a pass running its own protocol) or a module."""
    found = []
    for path, tree in _modules():
        modules = _imported_names(tree)
        for name, function in _functions(tree):
            for call in _own_calls(function):
                callee = call.func
                if not (isinstance(callee, ast.Attribute) and callee.attr in PASS_PROTOCOL):
                    continue
                receiver = callee.value
                if isinstance(receiver, ast.Name) and (receiver.id == "self"
                                                       or receiver.id in modules):
                    continue
                found.append(f"{path}:{name}")
                break
    return sorted(dict.fromkeys(found))


def _text(node) -> str:
    """The literal text of a string or f-string argument (its constant parts)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part) for part in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left) + _text(node.right)
    return ""


def _note_text(argument, helpers: dict) -> str:
    """The words of a note: the literal, or what the module's own helper it calls returns."""
    if isinstance(argument, ast.Call) and isinstance(argument.func, ast.Name) \
            and argument.func.id in helpers:
        return " ".join(_text(node.value) for node in ast.walk(helpers[argument.func.id])
                        if isinstance(node, ast.Return) and node.value is not None)
    return _text(argument)


def pass_notes() -> list[str]:
    """Every function adding a note (``add_note``) whose words speak of a pass."""
    found = []
    for path, tree in _modules():
        helpers = {name: function for name, function in _functions(tree)}
        for name, function in _functions(tree):
            for call in _own_calls(function):
                if isinstance(call.func, ast.Attribute) and call.func.attr == "add_note" \
                        and re.search(r"\bpass(es)?\b",
                                      " ".join(_note_text(a, helpers) for a in call.args)):
                    found.append(f"{path}:{name}")
    return sorted(dict.fromkeys(found))


def tabulate_users() -> list[str]:
    """Every module that imports tabulate (an import statement, import_module or __import__)."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(
                    alias.name.split(".")[0] == "tabulate" for alias in node.names) \
                    or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] \
                    == "tabulate" \
                    or isinstance(node, ast.Call) and any(
                        isinstance(a, ast.Constant) and a.value == "tabulate" for a in node.args):
                found.append(path)
    return sorted(dict.fromkeys(found))


def dash_rules() -> list[str]:
    """Every module that draws a line of dashes to a width (``"-" * width``): a table's rule."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and any(
                    isinstance(side, ast.Constant) and isinstance(side.value, str)
                    and side.value and set(side.value) <= {"-", "─", "="}
                    for side in (node.left, node.right)):
                found.append(path)
    return sorted(dict.fromkeys(found))


def test_only_the_runner_runs_the_pass_protocol():
    assert pass_protocol_callers() == [":".join(RUNNER)], (
        "a second pass runner: run passes with fxdebug.passes.base.run_passes (after_each= "
        "for a step of your own), so every failure gets the one note")


def test_only_the_runner_writes_a_note_about_a_pass():
    assert pass_notes() == [":".join(RUNNER)], (
        "a second note about a failing pass: fxdebug.passes.base.pass_failure_note is the one")


def test_only_the_renderer_draws_tables():
    assert tabulate_users() == [RENDERER], "draw tables with fxdebug.base.fit_to_width.fit_table"
    assert dash_rules() == [RENDERER], "draw tables with fxdebug.base.fit_to_width.fit_table"


def test_the_checks_see_a_second_runner_and_a_second_renderer(tmp_path, monkeypatch):
    """The scans find what they look for: a copy of today's runner loop and a hand-made table."""
    extra = PACKAGE / "zz_second_runner_probe.py"
    source = ("from tabulate import tabulate as draw\n"
              "def run_all(gm, steps):\n"
              "    for step in steps:\n"
              "        try:\n"
              "            gm = step.apply(gm).graph_module\n"
              "        except Exception as exc:\n"
              "            exc.add_note(f'raised by pass {step.name!r}')\n"
              "            raise\n"
              "    return gm\n"
              "def rule(widths):\n"
              "    return '  '.join('-' * w for w in widths)\n")
    real_modules = _modules

    def with_extra():
        yield from real_modules()
        yield "zz_second_runner_probe.py", ast.parse(source, str(extra))

    monkeypatch.setattr(sys.modules[__name__], "_modules", with_extra)
    assert "zz_second_runner_probe.py:run_all" in pass_protocol_callers()
    assert "zz_second_runner_probe.py:run_all" in pass_notes()
    assert "zz_second_runner_probe.py" in tabulate_users()
    assert "zz_second_runner_probe.py" in dash_rules()


class Probe(Pass):
    """Records which function called its ``apply``; raises when asked to."""

    name = "probe"
    callers: list[str] = []

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def run(self, gm):
        frame = sys._getframe()
        while not (frame.f_code.co_name == "apply" and frame.f_locals.get("self") is self):
            frame = frame.f_back
        caller = frame.f_back.f_code
        where = pathlib.Path(caller.co_filename).resolve()
        name = f"{where.relative_to(PACKAGE).as_posix() if PACKAGE in where.parents else where}" \
               f":{caller.co_name}"
        if self.fail:
            raise ValueError(f"probe called by {name}, cannot handle node 'relu'")
        Probe.callers.append(name)
        return False


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(torch.relu(self.linear(x)))


def test_every_way_in_runs_passes_through_the_one_runner():
    Probe.callers.clear()
    model, x = Net(), torch.randn(2, 3)
    Probe()(fxdebug.trace(model))
    gm = fxdebug.instrument(model, passes=[Probe()])
    model.eval()
    gm(x)  # the eval graph: instrumented by the same pipeline, when first run
    with pytest.warns(fxdebug.FxdebugWarning, match="'probe' changed nothing"):
        fxdebug.PassManager([Probe()], check_inputs=(x,)).run(model)
    runner = ":".join(RUNNER)
    assert Probe.callers == [runner] * 4


def _note_of(exc: BaseException) -> list[str]:
    return [note for note in getattr(exc, "__notes__", ()) if "pass 'probe'" in note]


@pytest.mark.parametrize("how", ["call", "instrument", "pass_manager"])
def test_a_failing_pass_gets_the_one_note_wherever_it_runs(how):
    model = Net()
    line = Net.forward.__code__.co_firstlineno + 1  # where torch.relu is called
    with pytest.raises(ValueError, match="called by fxdebug|called by passes") as info:
        if how == "call":
            Probe(fail=True)(fxdebug.trace(model))
        elif how == "instrument":
            fxdebug.instrument(model, passes=[Probe(fail=True)])
        else:
            fxdebug.PassManager([fxdebug.passes.Capture(), Probe(fail=True)]).run(model)
    assert f"called by {':'.join(RUNNER)}" in str(info.value)
    before = {"call": "as the first pass", "instrument": "after 'capture', 'eager_regions'",
              "pass_manager": "after 'capture'"}[how]
    assert _note_of(info.value) == [
        f"fxdebug: pass 'probe' failed at node 'relu' ({before}); the node comes from "
        f"tests/test_one_runner.py:{line}."]


def test_fxdebug_check_names_a_failing_pass_with_the_one_note(tmp_path, capsys, monkeypatch):
    (tmp_path / "probe_pass.py").write_text(
        "import torch\n"
        "def explode(gm):\n"
        "    raise RuntimeError('cannot rewrite conv1')\n")
    monkeypatch.chdir(tmp_path)
    status = cli_main(["check", "--input", "1,3,32,32", "--pass", "capture", "--pass",
                       "probe_pass.py:explode"])
    error = capsys.readouterr().err
    assert status == 2
    assert error.count("failed") == 1, error
    assert "fxdebug: pass 'explode' failed at node 'conv1' (after 'capture'); the node comes " \
           "from torchvision/models/resnet.py:" in error


def test_the_renderer_draws_tabulates_bytes():
    rng = random.Random(0)
    alphabet = "ab -.1e+x_/:()\t"
    for _ in range(2000):
        columns = rng.randint(1, 5)
        headers = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                   for _ in range(columns)]
        rows = [["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
                 if rng.random() < 0.8 else rng.choice([1, 2.5, -3, None, 1e-9, "é", "a\nb"])
                 for _ in range(columns)] for _ in range(rng.randint(0, 4))]
        align = ([rng.choice(["left", "right"]) for _ in range(columns)]
                 if rng.random() < 0.5 else None)
        expected = tabulate([[str(cell) for cell in row] for row in rows], headers=headers,
                            disable_numparse=True, tablefmt="simple",
                            **({"colalign": tuple(align)} if align else {}))
        assert fit_table(rows, headers, colalign=align) == expected, (headers, rows, align)


def test_print_tabular_diff_and_pass_report_are_the_renderers_tables(capsys):
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    result = fxdebug.PassManager([fxdebug.passes.Capture()]).run(model)
    gm, report = result.graph_module, result.report
    views = fxdebug.reporting.node_views(gm, x)
    columns = ["key", "opcode", "name", "target", "args", "kwargs", "shape", "dtype", "module",
               "source", "pass"]
    fxdebug.print_tabular(gm, x, wide=True)
    assert capsys.readouterr().out == tabulate(
        [view.row() for view in views], headers=columns, disable_numparse=True,
        tablefmt="simple") + "\n"
    assert report.stages[-1].snapshot.table() == tabulate(
        [view.row() for view in report.stages[-1].snapshot.views], headers=columns,
        disable_numparse=True, tablefmt="simple")
    stage = report.stages[-1]
    assert report.table(wide=True) == tabulate(
        [["capture", "yes", stage.diff.summary(), "-"]], disable_numparse=True,
        headers=["pass", "modified", "nodes +/-/~", "equivalent"], tablefmt="simple")
