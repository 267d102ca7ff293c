"""Functions of the script being run (``__main__``), copied into module.py as source.

A notebook or a script defines its ``torch.fx.wrap``'d functions in ``__main__``,
which the dumped folder cannot import. :class:`ScriptSource` copies each such
function's source, and what it uses from ``__main__`` as far as that is plain
code: modules (imported again), importable functions and classes (imported by
name), constants written as literals, and other functions and classes of the
script (copied the same way). Anything else, or a function whose source Python
does not have (typed at an interactive prompt), is an error naming it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
import textwrap
import types

from ..errors import FxdebugError
from .literals import Imports, NotLiteral, importable, literal

__all__ = ["ScriptSource", "RESERVED_NAMES", "is_script_object"]

# names module.py defines itself: a copied definition must not replace them
RESERVED_NAMES = ("os", "torch", "HERE", "FROZEN", "TIED", "TRAINING", "TRAINING_EXCEPTIONS",
                  "load", "_set_tensor", "_pickled_modules", "PICKLED_SHA256", "pickled")


def is_script_object(obj) -> bool:
    """Whether ``obj`` is a function or class defined at the top level of ``__main__``.

    >>> is_script_object(len), is_script_object(textwrap.dedent)
    (False, False)
    """
    qualname = getattr(obj, "__qualname__", "")
    return (isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__"
            and "<" not in qualname and "." not in qualname)


def _bound_names(tree: ast.AST) -> set[str]:
    """Names a definition binds inside itself (arguments, assignments, loops, imports)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return bound


class ScriptSource:
    """The definitions copied from ``__main__``, and the imports they need (``self.imports``)."""

    def __init__(self, reserved=()) -> None:
        self.imports = Imports()
        self.reserved = set(RESERVED_NAMES) | set(reserved)
        self.definitions: dict[str, tuple[int, str]] = {}   # name -> (line in the script, code)
        self.constants: dict[str, str] = {}
        self.originals: dict[str, str] = {}  # name in module.py -> name in the script

    def add(self, name: str, obj, where: str) -> None:
        """Copy ``obj`` (a function or class of ``__main__``), known in module.py as ``name``."""
        if name in self.definitions:
            return
        if name in self.reserved:
            raise FxdebugError(f"cannot dump: {where} uses {name!r} from the script, a name "
                               f"module.py defines itself. Rename it in your script and dump again.")
        try:
            lines, first = inspect.getsourcelines(obj)
        except (OSError, TypeError) as exc:
            raise FxdebugError(
                f"cannot dump: {where} uses {obj.__qualname__}, defined in the script being run "
                f"(__main__) without source Python can read ({exc}); it was typed at an "
                f"interactive prompt or made by exec. Define it in a file (a script, a notebook "
                f"cell or a module) and trace and dump again.") from exc
        code = textwrap.dedent("".join(lines)).rstrip() + "\n"
        if obj.__name__ != name:
            code += f"{name} = {obj.__name__}\n"
        self.definitions[name] = (first, code)
        self.originals[name] = obj.__name__
        tree = ast.parse(code)
        bound = _bound_names(tree) - {obj.__name__}
        namespace = getattr(obj, "__globals__", None)
        if namespace is None:  # a class: its methods' globals are the script's
            namespace = vars(sys.modules["__main__"])
        used = dict.fromkeys(node.id for node in ast.walk(tree)
                             if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load))
        for used_name in used:
            if used_name in bound or used_name == obj.__name__:
                continue
            if used_name not in namespace:
                if hasattr(builtins, used_name):
                    continue
                raise FxdebugError(f"cannot dump: {obj.__qualname__} (copied from the script for "
                                   f"{where}) uses {used_name!r}, which the script does not define.")
            self._resolve(used_name, namespace[used_name], f"{obj.__qualname__}, used by {where}")

    def _resolve(self, name: str, value, where: str) -> None:
        if name in self.reserved and name not in ("os", "torch"):
            raise FxdebugError(f"cannot dump: {where} uses {name!r} from the script, a name "
                               f"module.py defines itself. Rename it in your script and dump again.")
        if isinstance(value, types.ModuleType):
            line = f"import {value.__name__}" + ("" if name == value.__name__ else f" as {name}")
            if name in ("os", "torch") and name != value.__name__:
                raise FxdebugError(f"cannot dump: {where} uses {name!r} for module "
                                   f"{value.__name__}; module.py needs that name. Rename it.")
            self.imports.lines[line] = None
            return
        if is_script_object(value):
            self.add(name, value, where)
            return
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
            found = importable(value)
            if not isinstance(found, str):
                self.imports.add_object(name, *found)
                return
        try:
            self.constants[name] = f"{name} = {literal(value)}"
            return
        except NotLiteral:
            pass
        raise FxdebugError(
            f"cannot dump: {where} uses {name!r} from the script, a {type(value).__name__} that "
            f"cannot be written as code (only modules, importable functions and classes, functions "
            f"and classes of the script, and constants such as numbers, strings and tuples are "
            f"copied). Pass it as an argument, or move the function to an importable module.")

    def text(self) -> str:
        """The constants, then the definitions in the order of the script."""
        if not self.definitions:
            return ""
        blocks = [code for _, code in sorted(self.definitions.values())]
        head = "# -- copied from the script that was run (__main__) by fxdebug.dump --"
        return "\n\n".join([head + ("\n" + "\n".join(self.constants.values()) if self.constants else "")]
                           + blocks).rstrip() + "\n"

    def names(self) -> list[str]:
        """The script's names of the copied definitions, in the script's order."""
        return [self.originals[name]
                for name, _ in sorted(self.definitions.items(), key=lambda item: item[1])]
