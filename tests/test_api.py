"""The public API: what ``import fxdebug`` offers, lazily, and what type checkers see."""

import ast
import importlib
import importlib.util
import inspect
import io
import pathlib
import subprocess
import sys
import typing

import pytest

import fxdebug

from subprocesses import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]


STUB = REPO / "fxdebug" / "__init__.pyi"


def stub_text() -> str:
    """fxdebug/__init__.pyi as fxdebug._LAZY gives it: each public name imported from where
    ``fxdebug.<name>`` finds it, for type checkers and IDEs (``import fxdebug`` itself imports
    nothing until a name is used)."""
    lines = ['"""What type checkers and IDEs see of ``import fxdebug``: written by',
             "``python tests/test_api.py`` from ``fxdebug._LAZY`` (the one list of public names);",
             'do not edit."""', "", "__version__: str", ""]
    for name, module_name in fxdebug._LAZY.items():
        value = getattr(fxdebug, name)
        relative = module_name[len("fxdebug"):]
        if inspect.ismodule(value):  # a subpackage or module: from its parent
            parent, _, last = value.__name__.rpartition(".")
            assert last == name, (name, value.__name__)
            lines.append(f"from {parent[len('fxdebug'):] or '.'} import {name} as {name}")
        elif hasattr(importlib.import_module(module_name), "__path__") and \
                importlib.util.find_spec(f"{module_name}.{name}") is not None:
            # a submodule of that name (fxdebug.dumping.dump): mypy would take `from .dumping
            # import dump` for it, so the function comes from the module that defines it
            lines.append(f"from {value.__module__[len('fxdebug'):]} import {name} as {name}")
        else:
            lines.append(f"from {relative} import {name} as {name}")
    lines += ["", "__all__ = ["] + [f"    {name!r}," for name in fxdebug.__all__] + ["]", ""]
    return "\n".join(lines).replace("from .. import", "from . import")


def _stub_imports() -> dict[str, str]:
    """name -> the module it is imported from, in fxdebug/__init__.pyi."""
    names: dict[str, str] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1, ast.dump(node)
            for alias in node.names:
                assert alias.asname == alias.name, "re-exported as itself: `import x as x`"
                assert alias.name not in names, f"{alias.name} imported twice"
                names[alias.name] = "fxdebug" + (f".{node.module}" if node.module else "")
    return names


def test_the_type_stub_is_written_from_the_one_list():
    assert STUB.read_text() == stub_text(), "run python tests/test_api.py to rewrite it"
    assert sorted(fxdebug._LAZY) == sorted(fxdebug.__all__) == sorted(_stub_imports())
    assert len(set(fxdebug.__all__)) == len(fxdebug.__all__)


def test_every_public_name_resolves_to_what_type_checkers_see():
    for name, package in _stub_imports().items():
        assert getattr(fxdebug, name) is getattr(importlib.import_module(package), name), name


def test_every_public_exception_and_report_is_exported():
    from fxdebug import errors
    from fxdebug.base.report import Report
    public = {name for name in fxdebug.__all__}
    exceptions = {name for name, value in vars(errors).items()
                  if isinstance(value, type) and issubclass(value, (Exception, Warning))
                  and value.__module__ == "fxdebug.errors"}
    assert exceptions <= public, exceptions - public
    rooms = [importlib.import_module(f"fxdebug.{room}") for room in
             ("equivalence", "nonfinite", "distributed", "runs", "hazards", "compiled", "partial",
              "monitoring", "precision", "reporting")]
    reports = {name for room in rooms for name in room.__all__
               if isinstance(getattr(room, name), type) and issubclass(getattr(room, name), Report)}
    assert reports <= public, reports - public
    assert {"NonfiniteWatch", "PartialReport", "Hazards", "StaleCaptureError", "PassReport",
            "GraphChangedError", "ReferenceMismatchError", "ShardedRecords"} <= public


def _fxdebug_classes(hint) -> list[type]:
    """The fxdebug classes a type hint names (``A | B``, ``dict[str, A]`` too)."""
    found = [hint] if isinstance(hint, type) and hint.__module__.startswith("fxdebug") else []
    return found + [c for arg in typing.get_args(hint) for c in _fxdebug_classes(arg)]


def test_every_type_a_public_function_returns_is_public():
    """What a user gets back from a public function can be named: fxdebug.ShardedRecords, ..."""
    returned = {}
    for name in fxdebug.__all__:
        value = getattr(fxdebug, name)
        functions = [value] if inspect.isfunction(value) else [
            method for method in vars(value).values() if inspect.isfunction(method)
            and not method.__name__.startswith("_")] if isinstance(value, type) else []
        for function in functions:
            hint = typing.get_type_hints(inspect.unwrap(function)).get("return")
            for cls in _fxdebug_classes(hint):
                returned[cls.__name__] = f"{name}.{function.__name__}"
    assert "ShardedRecords" in returned and "PassManagerResult" in returned, returned
    missing = {cls: where for cls, where in returned.items()
               if getattr(fxdebug, cls, None) is None or cls not in fxdebug.__all__}
    assert not missing, f"returned by public functions but not in fxdebug.__all__: {missing}"


def test_internal_packages_are_not_public_but_still_import():
    for name in ("runtime", "tables", "tracing", "keys", "analysis", "frontend", "dumping"):
        assert name not in fxdebug.__all__, name
    assert fxdebug.runtime.Records is fxdebug.Records  # pickles and dumped folders use the path
    assert not (REPO / "fxdebug" / "analysis").exists()  # its names live in their rooms
    with pytest.raises(AttributeError, match="no attribute 'no_such_room'"):
        fxdebug.no_such_room  # noqa: B018


def test_public_names_come_from_one_list():
    """``__all__`` is the lazy table's keys; the type checkers' block names the same."""
    assert fxdebug.__all__ == list(fxdebug._LAZY)
    assert not set(fxdebug._DEPRECATED) & set(fxdebug._LAZY)


def test_deprecated_names_warn_and_still_work():
    import torch
    gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU()))
    with pytest.warns(fxdebug.FxdebugDeprecationWarning, match="use fxdebug.print_tabular"):
        text = fxdebug.tabular(gm, torch.ones(1, 2))
    printed = io.StringIO()
    fxdebug.print_tabular(gm, torch.ones(1, 2), file=printed)
    assert printed.getvalue() == text + "\n" and "1x3" in text
    with pytest.warns(DeprecationWarning, match="use fxdebug.passes.inherit_key"):
        assert fxdebug.keys.inherit_key is fxdebug.passes.inherit_key


def test_import_fxdebug_does_not_import_torch():
    probe = ("import sys, fxdebug\n"
             "print('TORCH', 'torch' in sys.modules, len(fxdebug.__all__))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert f"TORCH False {len(fxdebug.__all__)}" in result.stdout, result.stderr[-2000:]


def test_package_ships_its_type_marker():
    assert (REPO / "fxdebug" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"fxdebug" = ["py.typed", "__init__.pyi"]' in pyproject


if __name__ == "__main__":  # rewrite fxdebug/__init__.pyi from fxdebug._LAZY
    STUB.write_text(stub_text())
    print(f"wrote {STUB}")
