"""Private torch names live in the package ``fxdebug/base/torch_compat/`` only.

torch may rename or drop any private name (``torch._dynamo``, ``torch.utils._pytree``,
``grad_fn._saved_*``, ``module._forward_hooks``...) in any release. fxdebug supports every
release of the last year, so each private name it needs sits in one module, with the
versions it was checked on and a public fallback. This test reads every
``fxdebug/**/*.py`` with ``ast`` and fails on a private torch name outside that package
(and on one inside it that does not say the torch versions it was checked on):

* ``import torch._x``, ``from torch._x import y``, ``from torch.x import _y``;
* ``torch._x``, ``fx.graph_module._x``, ``nn.modules.module._x``: a private name in an
  attribute chain that starts at a name bound to torch (``import torch.fx as fx``);
* ``_saved_*``: what autograd names the tensors a ``grad_fn`` saved;
* ``obj._x`` (read, write, ``getattr(obj, "_x")``) on anything but ``self``/``cls`` where
  ``_x`` is a name fxdebug never defines itself (a private attribute of somebody else's
  object, which for fxdebug means torch's), and ``obj._x`` or a ``"_x"`` string where ``_x``
  is a private name of torch's own objects (tensor, module, GraphModule, graph, node,
  tracer, op, grad_fn, torch's modules) as the running torch spells them.

What it cannot see: a private attribute reached through ``self`` in a subclass of a torch
class (``DebugGraphModule`` overriding ``GraphModule._code``); those classes say so.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import torch
import torch.fx as fx

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxdebug"
COMPAT = "base/torch_compat"  # a package: every module in it (and only those) may use them


def _in_compat(path: str) -> bool:
    """``path`` (relative to the package, ``/``-separated) is a module of torch_compat."""
    return path.startswith(COMPAT + "/")

# Files whose private names are known and on their way out.
ALLOWED_FILES = {
}

# Private-looking names that are not torch's private API.
ALLOWED_NAMES = {
    # torch.fx's own generated code asserts with torch._assert (symbolic_trace turns `assert`
    # into it, torchvision's models call it), so fxdebug must recognise that exact function
    # as a node target; it is listed in torch's API reference ("a wrapper around Python's
    # assert which is symbolically traceable") and has kept its name since torch 1.8.
    "_assert": "torch._assert: the traceable assert torch.fx emits; documented in torch's API",
    "_getframe": "sys._getframe: CPython's documented frame access, not torch",
    "_fields": "namedtuple._fields: documented public API of collections.namedtuple",
    "_asdict": "namedtuple._asdict: documented public API of collections.namedtuple",
    "_replace": "namedtuple._replace: documented public API of collections.namedtuple",
    "_make": "namedtuple._make: documented public API of collections.namedtuple",
}


# (file, name): a string that only looks like a private torch attribute.
ALLOWED_IN_FILE = {
    ("passes/checkpoint.py", "_graph"): "a key of the checkpointed region's own __dict__",
    ("runtime/eager_ops.py", "_op"): "a suffix of fxdebug's keys (dropout_op), not an attribute",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name != "_"


def _files() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def _torch_aliases(tree: ast.Module) -> dict[str, None]:
    """Names a module binds to torch or to something imported from torch."""
    names: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or alias.name.split(".")[0]] = None
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" \
                and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = None
    return names


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` -> ``["a", "b", "c"]``; ``[]`` when it does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _own_names(trees: dict[str, ast.Module]) -> dict[str, None]:
    """Private names fxdebug defines itself: functions, classes, variables, ``self._x = ...``,
    ``setattr(self, "_x", ...)`` and ``obj.__dict__["_x"]`` keys."""
    own: dict[str, None] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own[node.name] = None
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own[node.id] = None
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own[node.attr] = None
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant):
                own[str(node.slice.value)] = None
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and len(node.args) >= 2 \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" \
                    and isinstance(node.args[1], ast.Constant):
                own[str(node.args[1].value)] = None
    return own


def _torch_object_names() -> dict[str, None]:
    """Private attribute names of torch's own objects, as this torch spells them."""
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    objects = [torch.ones(1, requires_grad=True) * 2, torch.nn.Linear(1, 1), gm, gm.graph,
               next(iter(gm.graph.nodes)), fx.Tracer(), torch.autocast("cpu"),
               torch.ops.aten.add.default, torch.ops.aten.add, torch.nn.Dropout(),
               (torch.ones(1, requires_grad=True) * 2).grad_fn, torch, torch.fx.graph,
               torch.fx.graph_module, torch.nn.modules.module, torch.amp.autocast_mode]
    return {name: None for obj in objects for name in dir(obj) if _private(name)}


def _attribute_uses(tree: ast.Module):
    """``(line, name, how)`` of every private attribute fxdebug reaches on an object."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
            yield node.lineno, node.attr, "self" if on_self else "attribute"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            on_self = isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")
            yield node.lineno, node.args[1].value, "self" if on_self else node.func.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier() and _private(node.value):
            yield node.lineno, node.value, "string"


def private_torch_uses() -> list[str]:
    """``file:line: what`` of every private torch name outside the torch_compat package."""
    trees = _files()
    own, torch_names = _own_names(trees), _torch_object_names()
    found: list[str] = []
    for path, tree in trees.items():
        if not (_in_compat(path) or path in ALLOWED_FILES):
            found += _uses_in(path, tree, own, torch_names)
    return sorted(dict.fromkeys(found))


def generated_private_uses(folder: pathlib.Path) -> list[str]:
    """``file:line: what`` of every private torch name in the Python files of a dumped folder
    (the code fxdebug generated: module.py, run.py, __init__.py), checked as fxdebug's own."""
    trees = {path.relative_to(folder).as_posix(): ast.parse(path.read_text(), str(path))
             for path in sorted(folder.rglob("*.py"))}
    own, torch_names = _own_names(trees), _torch_object_names()
    return sorted(dict.fromkeys(use for path, tree in trees.items()
                                for use in _uses_in(path, tree, own, torch_names)))


def _uses_in(path: str, tree: ast.Module, own: dict, torch_names: dict) -> list[str]:
    found: list[str] = []
    aliases = _torch_aliases(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(
                        _private(part) for part in alias.name.split(".")):
                    found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{path}:{node.lineno}: from {node.module} import ...")
            found += [f"{path}:{node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            private = [part for part in chain[1:] if _private(part)]
            if chain and chain[0] in aliases and private and private[0] not in ALLOWED_NAMES:
                found.append(f"{path}:{node.lineno}: {'.'.join(chain)}")
    for line, name, how in _attribute_uses(tree):
        if name.startswith("_saved_"):
            found.append(f"{path}:{line}: {name} ({how}; autograd's saved tensors)")
        elif how != "self" and name not in ALLOWED_NAMES \
                and (path, name) not in ALLOWED_IN_FILE \
                and (name in torch_names or (how != "string" and name not in own)):
            found.append(f"{path}:{line}: {name} ({how})")
    return found


def test_no_private_torch_name_outside_torch_compat():
    assert private_torch_uses() == [], (
        "move these into a module of fxdebug/base/torch_compat/ (with the torch versions "
        "checked and a public fallback), re-export them from its __init__.py and call that")


def test_the_check_finds_each_kind_of_private_name(tmp_path, monkeypatch):
    package = tmp_path / "fxdebug"
    (package / COMPAT).mkdir(parents=True)
    (package / COMPAT / "__init__.py").write_text("from .dynamo import reset\n")
    (package / COMPAT / "dynamo.py").write_text("from torch._dynamo import reset\n")
    # a module beside the package, where torch_compat used to be one file, is not part of it
    (package / "base" / "torch_compat.py").write_text("import torch._dynamo\n")
    (package / "bad.py").write_text(
        "import torch\nimport torch.fx as fx\nimport torch.utils._pytree as pytree\n"
        "from torch._dynamo import reset\nfrom torch.fx.graph_module import _CodeOnlyModule\n"
        "x = torch._ops.OpOverload\ny = fx.graph_module._forward_from_src\n"
        "def f(module, fn):\n"
        "    return module._forward_hooks, getattr(fn, '_saved_self'), getattr(module, '_orig_mod')\n"
        "z = torch._assert\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    found = private_torch_uses()
    expected = ["bad.py:3: import torch.utils._pytree", "bad.py:4: from torch._dynamo import ...",
                "bad.py:5: from torch.fx.graph_module import _CodeOnlyModule",
                "bad.py:6: torch._ops.OpOverload", "bad.py:7: fx.graph_module._forward_from_src",
                "bad.py:9: _forward_hooks (attribute)", "bad.py:9: _orig_mod (getattr)",
                "base/torch_compat.py:1: import torch._dynamo"]
    assert [f for f in expected if f not in found] == []
    assert any("_saved_self" in f for f in found)
    assert not any("_assert" in f or f.startswith(COMPAT + "/") for f in found)


def _uses_private(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and _private(sub.attr) and not (
                isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and _private(sub.value) \
                and sub.value.isidentifier():
            return True
        if isinstance(sub, (ast.Import, ast.ImportFrom)) and any(
                _private(part) for alias in sub.names
                for part in [*(getattr(sub, "module", None) or "").split("."),
                             *alias.name.split(".")]):
            return True
    return False


def unversioned_private_names() -> list[str]:
    """``file: what`` of the functions and constants in the torch_compat package that touch
    a private name without saying, in their docstring or the comment next to them, that it
    was checked on torch 2.9.1."""
    silent = []
    for path in sorted((PACKAGE / COMPAT).rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        silent += [f"{name}: {what}" for what in _unversioned_in(path.read_text())]
    return silent


def _unversioned_in(source: str) -> list[str]:
    lines = source.splitlines()
    body = ast.parse(source).body
    silent = []
    for index, node in enumerate(body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            body_only = node.body[1:] if ast.get_docstring(node) else node.body
            if any(_uses_private(statement) for statement in body_only) \
                    and "2.9.1" not in (ast.get_docstring(node) or ""):
                silent.append(f"{node.name} (line {node.lineno})")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)) \
                and _uses_private(node):
            after = body[index + 1] if index + 1 < len(body) else None
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(
                after.value, ast.Constant) and isinstance(after.value.value, str) else ""
            first = node.lineno - 1  # with the comment lines right above it
            while first > 0 and lines[first - 1].lstrip().startswith("#"):
                first -= 1
            near = "\n".join(lines[first:node.end_lineno]) + doc
            if "2.9.1" not in near:
                silent.append(f"line {node.lineno}")
    return silent


def test_every_private_name_in_torch_compat_says_the_versions_it_was_checked_on():
    assert unversioned_private_names() == [], "say which torch versions these were checked on"


def test_the_version_check_finds_a_silent_private_name(tmp_path, monkeypatch):
    (tmp_path / COMPAT).mkdir(parents=True)
    (tmp_path / COMPAT / "__init__.py").write_text('from .grad import SEEN\n')
    (tmp_path / COMPAT / "grad.py").write_text(
        'import torch\n'
        'SEEN = torch._C._set_grad_enabled  # checked on 2.9.1 and 2.14.1\n'
        'HIDDEN = torch._C._get_tracing_state\n'
        'def quiet(module):\n    """No versions."""\n    return module._forward_hooks\n'
        'def said(module):\n    """(2.9.1, 2.14.1)."""\n    return module._forward_hooks\n'
        'def public(module):\n    """Nothing private."""\n    return module.training\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert unversioned_private_names() == [f"{COMPAT}/grad.py: line 3",
                                           f"{COMPAT}/grad.py: quiet (line 4)"]


def test_the_package_reexports_every_name_of_its_modules():
    """``torch_compat.X`` reaches every name: the modules are a layout, not an API."""
    import importlib

    from fxdebug.base import torch_compat
    names: list[str] = []
    for path in sorted((PACKAGE / COMPAT).glob("[!_]*.py")):
        module = importlib.import_module(f"fxdebug.base.torch_compat.{path.stem}")
        names += module.__all__
        assert [name for name in module.__all__
                if getattr(torch_compat, name, None) is not getattr(module, name)] == [], path.name
    assert sorted(set(names) - set(torch_compat.__all__)) == []
    assert len(torch_compat.__all__) == len(set(torch_compat.__all__))


def _dumps(folder: pathlib.Path) -> list[pathlib.Path]:
    """Dumps of every model of tests/dump_models.py, by the fx front end and by torch.export."""
    import fxdebug
    from dump_models import DictInput, Gadgets, Opaque
    torch.manual_seed(0)
    pair = {"a": torch.randn(2, 3), "b": torch.randn(2, 3)}
    made = [
        fxdebug.dump(fxdebug.instrument(fxdebug.trace(Gadgets(), leaf_modules=[Opaque])),
                     torch.randn(2, 6), folder=folder / "gadgets", allow_pickled_modules=True),
        fxdebug.dump(fxdebug.instrument(Opaque(6)), torch.randn(2, 6), folder=folder / "opaque"),
        fxdebug.dump(fxdebug.instrument(fxdebug.trace(
            DictInput(), concrete_args={"d": {"a": fx.PH, "b": fx.PH}})), pair, folder=folder / "dict_input"),
        fxdebug.dump(fxdebug.instrument(fxdebug.trace(Opaque(6), torch.randn(2, 6), frontend="export")),
                     torch.randn(2, 6), folder=folder / "opaque_export"),
        fxdebug.dump(fxdebug.instrument(fxdebug.trace(DictInput(), pair, frontend="export")),
                     pair, folder=folder / "dict_input_export"),
    ]
    return [pathlib.Path(path) for path in made]


def test_no_private_torch_name_in_the_code_a_dump_generates(tmp_path):
    """A dumped folder runs wherever torch runs, so its code uses public torch only: fx's own
    pytree flattening of inputs and outputs is written as plain Python."""
    folders = _dumps(tmp_path)
    for folder in folders:
        assert sorted(path.name for path in folder.glob("*.py")) == ["__init__.py", "module.py", "run.py"]
    assert {folder.name: generated_private_uses(folder) for folder in folders} == {
        folder.name: [] for folder in folders}
    code = (tmp_path / "dict_input_export" / "module.py").read_text()
    assert "d_a = d['a']" in code or "= d['a']" in code, code  # the plain flattening ran
