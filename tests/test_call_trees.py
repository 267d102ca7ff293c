"""The call trees the docstrings draw, and docs/how-it-works.md's, name functions that exist.

A call tree is a literal block (after ``::``) of a docstring in fxdebug/ drawn with
``├─``/``└─``, and the fenced blocks of docs/how-it-works.md. Every name called in one
(``name(``, ``pkg.name(``, ``Class.method(``), every dotted name that starts with one of
fxdebug's modules (``passes.run_passes``) and every file named (``writer.py``) must be
found in the package: a name is looked up in every module of fxdebug whose dotted path
ends with the name's module part, so that moving a module to another subpackage keeps its
names found, and renaming or moving a function does not.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import pathlib
import pkgutil
import re

import pytest

import fxdebug

PACKAGE = pathlib.Path(fxdebug.__file__).parent
DOCS = PACKAGE.parent / "docs"
TREE = ("├─", "└─")
CALLED = re.compile(r"(?<![\w.\-/])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(")
DOTTED = re.compile(r"(?<![\w.\-/`])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w(])")
FILE = re.compile(r"(?<![\w.])((?:[\w]+/)*[\w]+\.(?:py|tmpl))(?![\w.])")
SUFFIXES = ("py", "tmpl", "pt", "json", "jsonl", "md", "bin", "html", "png", "lock", "tmp", "old")
QUOTED = re.compile(r"``[^`]*``|\"[^\"]*\"|(?<!\w)'[^']*'")  # keys and code in quotes: not names


def _torch_classes() -> dict[str, type]:
    """The torch classes call trees name by their own name (``Tensor.register_hook``)."""
    import torch
    return {"Tensor": torch.Tensor, "Module": torch.nn.Module, "GraphModule": torch.fx.GraphModule,
            "Graph": torch.fx.Graph, "Node": torch.fx.Node, "Tracer": torch.fx.Tracer,
            "Interpreter": torch.fx.Interpreter, "Function": torch.autograd.Function,
            "Optimizer": torch.optim.Optimizer, "ExportedProgram": torch.export.ExportedProgram}
# the files of a dumped folder and of a user's model, which call trees name too
FOLDER_FILES = {"module.py", "run.py", "file.py"}

# names a call tree uses for the reader's values (a module, a report): ``gm(x)`` and
# ``report.table()`` name no function of a module, so only what follows the value is
# looked up, as an attribute of some class of fxdebug or torch
VALUES = {"gm", "model", "m", "module", "fn", "mon", "piece", "compiled", "backend", "pass_",
          "callback", "hook", "rec", "records", "f", "compile_piece", "worker", "original",
          "wrapped", "candidate", "reference", "self", "cls", "factory", "writer", "loss",
          "report", "copy", "bank", "optimizer", "layout", "out", "grad", "pass", "graph", "ep",
          "t", "follower", "regions", "MyFunction", "x", "series", "rank", "group", "ranks",
          "folder", "inner", "part", "block", "region", "tensor", "value", "node", "step",
          "after_each", "on_apply", "model_copy", "rebuild", "path", "sink", "recorder", "edit",
          "backbone", "package", "watch"}
NOT_FXDEBUG = ("torch", "functools", "inspect", "threading", "os", "json", "pickle", "pdb",
               "sys", "copy", "dataclasses", "weakref", "contextlib", "transformers", "timm",
               "torchvision", "numpy", "matplotlib", "lightning", "pytorch_lightning")


@functools.cache
def modules() -> dict[str, object]:
    """Every module of fxdebug, by dotted name."""
    found = {"fxdebug": fxdebug}
    for info in pkgutil.walk_packages([str(PACKAGE)], "fxdebug."):
        if info.name.endswith("__main__"):  # runs the command line when imported
            continue
        found[info.name] = importlib.import_module(info.name)
    return found


@functools.cache
def files() -> tuple[str, ...]:
    return tuple(sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
                        if p.suffix in (".py", ".tmpl")))


def _chain(obj, parts) -> bool:
    for part in parts:
        if isinstance(obj, type):  # a method, a dataclass field, a class attribute
            fields = getattr(obj, "__dataclass_fields__", {})
            annotations = getattr(obj, "__annotations__", {})
            if not hasattr(obj, part) and part not in fields and part not in annotations:
                return False
            obj = getattr(obj, part, None)
            continue
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def _module_part_names() -> set[str]:
    return {part for name in modules() for part in name.split(".")} | {"fxdebug"}


def resolves(name: str) -> bool:
    """Whether ``name`` is found in fxdebug (a module whose path ends with its module part,
    then attributes), in torch, or is a builtin."""
    parts = name.split(".")
    if parts[0] in NOT_FXDEBUG and parts[0] not in VALUES:
        try:
            obj = importlib.import_module(parts[0])
        except ImportError:
            return False
        for index, part in enumerate(parts[1:], 1):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(".".join(parts[:index + 1]))
            except ImportError:
                return False
        return True
    if len(parts) == 1 and hasattr(builtins, name):
        return True
    if parts[0] in _torch_classes():
        return _chain(_torch_classes()[parts[0]], parts[1:])
    for cut in range(len(parts)):
        suffix = ".".join(parts[:cut])
        for module_name, module in modules().items():
            if cut and not (module_name == suffix or module_name.endswith("." + suffix)):
                continue
            if _chain(module, parts[cut:]):
                return True
    return False


@functools.cache
def attribute_names() -> frozenset[str]:
    """Every attribute of every class defined in fxdebug, and of the torch classes whose
    methods call trees name (a GraphModule's recompile, a Tensor's register_hook)."""
    classes = {cls for module in modules().values() for cls in list(vars(module).values())
               if isinstance(cls, type) and cls.__module__.startswith("fxdebug")}
    classes |= set(_torch_classes().values())
    names = {name for cls in classes for name in dir(cls)}
    names |= {name for cls in classes for name in getattr(cls, "__dataclass_fields__", {})}
    for path in sorted(PACKAGE.rglob("*.py")):  # instance attributes: self.name = ...
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return frozenset(names)


def value_resolves(name: str) -> bool:
    """``value.attr...``: the attributes after the value are some class's."""
    return all(part in attribute_names() for part in name.split(".")[1:])


def file_found(name: str) -> bool:
    if name in FOLDER_FILES:
        return True
    return any(path == name or path.endswith("/" + name) for path in files())


def _blocks_of_docstring(doc: str) -> list[tuple[int, list[str]]]:
    """(line offset in the docstring, lines) of each literal block drawn as a tree."""
    lines = doc.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].rstrip().endswith("::"):
            start, index = index + 1, index + 1
            while index < len(lines) and (not lines[index].strip() or lines[index].startswith(" ")):
                index += 1
            block = lines[start:index]
            if any(mark in line for line in block for mark in TREE):
                blocks.append((start, block))
        else:
            index += 1
    return blocks


def docstring_trees() -> list[tuple[str, int, list[str]]]:
    """(file, first line, lines) of every call tree in a docstring of fxdebug."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc:
                continue
            first = node.body[0].lineno  # the docstring's first line in the file
            for offset, block in _blocks_of_docstring(doc):
                found.append((path.relative_to(PACKAGE.parent).as_posix(), first + offset, block))
    return found


def markdown_trees(path: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """(file, first line, lines) of every fenced block of a markdown page."""
    found, block, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if block is None:
                block, start = [], number + 1
            else:
                found.append((path.relative_to(PACKAGE.parent).as_posix(), start, block))
                block = None
        elif block is not None:
            block.append(line)
    return found


def missing_names(trees) -> list[str]:
    """``file:line: name`` of every name of these trees not found in the package."""
    module_parts = _module_part_names()
    missing = []
    for where, first, block in trees:
        for number, line in enumerate(block, first):
            line = QUOTED.sub("", line)
            names = CALLED.findall(line)
            names += [n for n in DOTTED.findall(line) if n not in names
                      and n.rsplit(".", 1)[1] not in SUFFIXES]
            for name in names:
                first = name.split(".")[0]
                if first == "self" or name in ("e.g", "i.e"):  # the user's code, prose
                    continue
                if first in VALUES and (first not in module_parts or not resolves(name)):
                    found = value_resolves(name)
                elif "." not in name and not resolves(name):
                    found = name in attribute_names()  # a method named alone: recompile()
                else:
                    found = resolves(name)
                if not found:
                    missing.append(f"{where}:{number}: {name}")
            missing += [f"{where}:{number}: {name}" for name in FILE.findall(line)
                        if not file_found(name)]
    return missing


def test_docstring_call_trees_name_what_exists():
    trees = docstring_trees()
    assert len(trees) > 40, "the call trees were not found: see _blocks_of_docstring"
    assert missing_names(trees) == [], "call trees naming what is not there (file:line: name)"


def test_how_it_works_names_what_exists():
    trees = markdown_trees(DOCS / "how-it-works.md")
    assert len(trees) >= 3
    assert missing_names(trees) == [], "docs/how-it-works.md names what is not there"


def test_how_it_works_pipeline_lists_every_pass_instrument_runs():
    pipeline = next(block for _, _, block in markdown_trees(DOCS / "how-it-works.md")
                    if block and block[0].startswith("instrument(model)"))
    build_pipeline = importlib.import_module("fxdebug.instrument").build_pipeline
    passes = [type(p).__name__ for p in build_pipeline(capture="all", grads=True)]
    assert len(passes) >= 3
    assert [name for name in passes if name not in "\n".join(pipeline)] == []


def test_how_it_works_lists_every_error_class():
    text = (DOCS / "how-it-works.md").read_text()
    errors = sorted({cls.__name__ for module in modules().values() for cls in list(vars(module).values())
                     if isinstance(cls, type) and issubclass(cls, (fxdebug.FxdebugError,
                                                                   fxdebug.FxdebugWarning))
                     and cls.__module__.startswith("fxdebug") and not cls.__name__.startswith("_")})
    assert len(errors) >= 10
    assert [name for name in errors if name not in text] == []


@pytest.mark.parametrize("line, missing", [
    ("  ├─ passes.Capture(...)      capture nodes", []),
    ("  ├─ passes.NoSuchPass(...)   a pass", ["passes.NoSuchPass"]),
    ("  ├─ _Token.release()         a lock", []),
    ("  ├─ _Token.create(parent)    a lock", ["_Token.create"]),
    ("  └─ gm(x), torch.compile(gm) run", []),
    ("  └─ tracing.no_such(model)   then", ["tracing.no_such"]),
    ("  └─ see writer.py and nowhere.py", ["nowhere.py"]),
])
def test_the_check_finds_a_stale_name(line, missing):
    found = missing_names([("here.py", 1, [line])])
    assert [entry.split(": ", 1)[1] for entry in found] == missing
