"""The one shape every fxdebug report has: a verdict, a table, a one-line repr, HTML, a dict.

A report subclasses :class:`Report` and writes three things: :meth:`Report.table`
(the text a person reads, drawn with :func:`fxdebug.base.fit_to_width.fit_table` so it
fits 80 columns), :meth:`Report._size` and :meth:`Report._finding`. Everything
else comes from here::

    report.ok            True / False, where the report has a verdict (report.verdict(): None
                         where it has none)
    str(report)          report.table()
    repr(report)         <EquivalenceReport 12 outputs, DIFFERENT: first divergence layer1.0.conv2 ...>
    report._repr_html_() the table in a <pre> (Jupyter), unless the report draws its own
    report.to_dict()     JSON-safe: kind, ok, size, finding and the report's fields
                         (dataclass fields, tensors as shape and dtype, non-finite floats as text),
                         made so by fxdebug.runtime.values.json_safe (the one nested-value
                         walker sits above this module: importing it hands json_safe here)

>>> class Count(Report):
...     def __init__(self, n): self.n = n
...     ok = property(lambda self: self.n == 0)
...     def table(self, wide=None): return f"{self.n} problem(s)"
...     def _size(self): return "3 nodes"
...     def _finding(self): return f"{self.n} problem(s)" if self.n else ""
>>> Count(2)
<Count 3 nodes, DIFFERENT: 2 problem(s)>
>>> import fxdebug.runtime  # to_dict's nested-value walker (imported by every fxdebug report)
>>> Count(0).to_dict()
{'kind': 'Count', 'ok': True, 'size': '3 nodes', 'finding': '', 'n': 0}
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any, Callable

from ..errors import FxdebugError

__all__ = ["Report", "use_json_converter"]

REPR_LIMIT = 160
"""A report's repr is one line of at most this many characters."""


class Report:
    """Base class of fxdebug's reports (see the module docstring)."""

    #: Words for ``ok`` in the one-line repr.
    verdict_words: tuple[str, str] = ("OK", "DIFFERENT")

    def verdict(self) -> bool | None:
        """``self.ok`` where the report has a verdict (an attribute or property), else None."""
        ok = getattr(self, "ok", None)
        return None if ok is None else bool(ok)

    def table(self, wide: bool | None = None) -> str:
        """The report as text (fitted to the terminal unless ``wide=True``)."""
        raise NotImplementedError(f"{type(self).__name__} must define table()")

    def _size(self) -> str:
        """How much the report covers, in a few words (``"75 nodes"``)."""
        return ""

    def _finding(self) -> str:
        """The first finding in a few words (``"first divergence conv1 ..."``), or ``""``."""
        return ""

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        ok = self.verdict()
        verdict = None if ok is None else self.verdict_words[0 if ok else 1]
        text = " ".join(part for part in (type(self).__name__, self._size()) if part)
        text += f", {verdict}" if verdict else ""
        finding = " ".join(self._finding().split())
        text += f": {finding}" if finding else ""
        if len(text) > REPR_LIMIT - 2:
            text = text[:REPR_LIMIT - 3] + "…"
        return f"<{text}>"

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.table(wide=True))}</pre>"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data for a CI log (``json.dumps(report.to_dict())`` works)."""
        out: dict[str, Any] = {"kind": type(self).__name__, "ok": self.verdict(),
                               "size": self._size(),
                               "finding": " ".join(self._finding().split())}
        out.update(self._fields())
        if not _JSON_CONVERTER:
            raise FxdebugError(f"{type(self).__name__}.to_dict() makes nested values JSON-safe with "
                               f"fxdebug.runtime.values.json_safe, and fxdebug.runtime is not imported "
                               f"yet: import fxdebug.runtime (or fxdebug.runtime.values) first.")
        return _JSON_CONVERTER[0](out)

    def _fields(self) -> dict[str, Any]:
        """The report's own data for :meth:`to_dict`: its dataclass fields or attributes."""
        if dataclasses.is_dataclass(self):
            return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                    if not field.name.startswith("_")}
        return {name: value for name, value in vars(self).items() if not name.startswith("_")}


_JSON_CONVERTER: list[Callable[[Any], Any]] = []


def use_json_converter(convert: Callable[[Any], Any]) -> None:
    """Hand :meth:`Report.to_dict` the function that makes nested values JSON-safe:
    :func:`fxdebug.runtime.values.json_safe`, which calls this when imported (the nested-value
    walker sits above this module, which cannot import it).

    >>> import fxdebug.runtime.values
    >>> _JSON_CONVERTER == [fxdebug.runtime.values.json_safe]
    True
    """
    _JSON_CONVERTER[:] = [convert]
