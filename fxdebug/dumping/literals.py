"""Values and names that can be written as Python code (module.py is made of them).

``literal(value)`` is code that evaluates to ``value`` (or raises NotLiteral);
``importable(obj)`` is the ``(module, qualname)`` under which ``obj`` can be
imported, or why it cannot; :class:`Imports` collects module.py's import block.
"""

from __future__ import annotations

import math
import sys

import torch
from torch.package import sys_importer

__all__ = ["NotLiteral", "literal", "call_arguments", "importable", "Imports"]


class NotLiteral(Exception):
    pass


def literal(value) -> str:
    """Python code that evaluates to ``value`` (raises NotLiteral when there is none)."""
    if value is None or type(value) in (bool, int, str):
        return repr(value)
    if type(value) is float:
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "-float('inf')"
        return repr(value)
    if isinstance(value, torch.Size):
        return f"torch.Size({literal(tuple(value))})"
    if type(value) is tuple:
        items = [literal(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if type(value) is list:
        return f"[{', '.join(literal(v) for v in value)}]"
    if type(value) is dict:
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return repr(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise NotLiteral(type(value).__name__)


def call_arguments(args, kwargs) -> str:
    return ", ".join([literal(a) for a in args] + [f"{k}={literal(v)}" for k, v in kwargs.items()])


# -- importable names -----------------------------------------------------------------------
def importable(obj) -> tuple[str, str] | str:
    """``(module, qualname)`` under which ``obj`` can be imported, or why it cannot."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or ""
    if "<lambda>" in qualname:
        return "is a lambda"
    if "<locals>" in qualname:
        return f"is defined inside a function ({qualname})"
    if module == "__main__":
        return (f"is defined in the script being run (__main__.{qualname}), which the "
                f"dumped folder cannot import")
    try:
        module, qualname = sys_importer.get_name(obj)
    except Exception as exc:  # ObjNotFoundError / ObjMismatchError / ImportError
        return f"cannot be imported by name ({type(exc).__name__}: {exc})"
    if module == "_operator":
        module = "operator"
    return module, qualname


FXDEBUG_MISSING = (
    "this folder's module.py keeps fxdebug's nodes (captures, gradient hooks, breakpoints, "
    "assertion messages), which call fxdebug.runtime, and fxdebug is not installed here: "
    "install it (pip install fxdebug), or dump again with `fxdebug dump --standalone` / "
    "fxdebug.dump(..., standalone=True), a folder that needs only torch")


def _split(text: str, width: int = 80) -> list[str]:
    """``text`` in pieces of about ``width`` characters that join back to it (at spaces)."""
    pieces, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) > width:
            pieces.append(line)
            line = ""
        line += word + " "
    return pieces + [line[:-1]]


class Imports:
    """The import block of module.py: lines and module-level assignments, sorted."""

    def __init__(self) -> None:
        self.lines: dict[str, None] = {"import torch": None}
        self.assignments: dict[str, None] = {}

    @classmethod
    def merged(cls, *parts: "Imports") -> "Imports":
        """One import block holding every line of ``parts``, each once, in the order first seen.

        >>> a, b = Imports(), Imports()
        >>> a.add_object("relu", "torch.nn.functional", "relu"); b.lines["import math"] = None
        >>> print(Imports.merged(a, b).text())
        import math
        import torch
        from torch.nn.functional import relu
        """
        whole = cls()
        for part in parts:
            whole.lines.update(part.lines)
            whole.assignments.update(part.assignments)
        return whole

    def add_object(self, name: str, module: str, qualname: str) -> None:
        if module == "builtins" and qualname == name:
            return
        if "." in qualname:
            self.lines[f"import {module}"] = None
            self.assignments[f"{name} = {module}.{qualname}"] = None
        elif qualname == name:
            self.lines[f"from {module} import {name}"] = None
        else:
            self.lines[f"from {module} import {qualname} as {name}"] = None

    def text(self) -> str:
        plain = sorted(line for line in self.lines if line.startswith("import "))
        froms = sorted(line for line in self.lines if line.startswith("from "))
        others = [line for line in self.lines if not line.startswith(("import ", "from "))]
        ours = [line for line in plain + froms if line.split()[1].split(".")[0] == "fxdebug"]
        lines = [line for line in plain + froms if line not in ours] + others
        if ours:  # where fxdebug is not installed, say what to do instead of No module named
            lines += ["", "try:  # fxdebug's nodes (captures, gradient hooks, breakpoints) call it",
                      *(f"    {line}" for line in ours),
                      "except ImportError as exc:",
                      "    if not (exc.name or '').startswith('fxdebug'):",
                      "        raise",
                      "    raise ImportError(",
                      *(f"        {part!r}" for part in _split(FXDEBUG_MISSING)),
                      "        , name=exc.name) from exc",
                      ""]
        return "\n".join(lines + list(self.assignments))

    def top_level_packages(self) -> list[str]:
        found: dict[str, None] = {}
        for line in sorted(self.lines):
            parts = line.split()
            if parts[0] in ("import", "from") and len(parts) > 1:
                found.setdefault(parts[1].split(".")[0])
        return [name for name in found if name not in sys.stdlib_module_names and name != "torch"]
