"""The public API: what ``import fxdebug`` offers, lazily, and what type checkers see."""

import ast
import importlib
import pathlib
import subprocess
import sys

import fxdebug

from subprocesses import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]
INIT = REPO / "fxdebug" / "__init__.py"


def _type_checking_imports() -> dict[str, str]:
    """name -> the module it is imported from, in ``if TYPE_CHECKING:`` of fxdebug/__init__.py."""
    tree = ast.parse(INIT.read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If)
              and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1, "fxdebug/__init__.py needs one `if TYPE_CHECKING:` block"
    names: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        package = "fxdebug" + (f".{node.module}" if node.module else "")
        for alias in node.names:
            name = alias.asname or alias.name
            assert name not in names, f"{name} imported twice"
            names[name] = package
    return names


def test_lazy_table_all_and_type_checking_imports_agree():
    imported = _type_checking_imports()
    assert sorted(fxdebug._LAZY) == sorted(fxdebug.__all__) == sorted(imported)
    assert len(set(fxdebug.__all__)) == len(fxdebug.__all__)
    for name, package in imported.items():
        lazy = fxdebug._LAZY[name]
        # `from .equivalence import vjp` (lazy: fxdebug.equivalence) or `from . import analysis`
        assert lazy in (package, f"{package}.{name}") or (
            getattr(importlib.import_module(package), name) is getattr(fxdebug, name)), name


def test_every_public_name_resolves_to_what_type_checkers_see():
    for name, package in _type_checking_imports().items():
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
             ("equivalence", "nonfinite", "distributed", "runs", "hazards", "analysis")]
    reports = {name for room in rooms for name in room.__all__
               if isinstance(getattr(room, name), type) and issubclass(getattr(room, name), Report)}
    assert reports <= public, reports - public
    assert {"NonfiniteWatch", "PartialReport", "Hazards", "StaleCaptureError", "PassReport",
            "GraphChangedError"} <= public


def test_import_fxdebug_does_not_import_torch():
    probe = ("import sys, fxdebug\n"
             "print('TORCH', 'torch' in sys.modules, len(fxdebug.__all__))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert f"TORCH False {len(fxdebug.__all__)}" in result.stdout, result.stderr[-2000:]


def test_package_ships_its_type_marker():
    assert (REPO / "fxdebug" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"fxdebug" = ["py.typed"]' in pyproject
