"""The one table renderer: tabulate's ``simple`` format, fitted to the terminal.

Every fxdebug table is drawn by :func:`fit_table` (``print_tabular``, diffs,
pass reports, Records and every other report's ``table()``): text columns,
left-aligned unless ``colalign`` says otherwise, the same bytes as
``tabulate(rows, headers, tablefmt="simple", disable_numparse=True)``.

A table is fitted only when there is a width to fit: ``COLUMNS`` when set,
else the terminal's width when standard output is a terminal. Written to a
file or a pipe (and with ``wide=True``) a table keeps every column and every
character, so saved output and tests stay byte-identical.

To fit, in this order: long header names get their short form, overlong cells
in the truncatable columns end in ``…``, then the least important columns are
dropped (a last line names them: ``wide=True`` in Python, ``--wide`` on the command
line shows all), then truncatable cells shrink further::

    fit_table(rows, headers, width=80, drop=("std", "min"), truncate=("key",))

>>> rows = [["layer1.0.conv1", "Conv2d", "1.0", "2.0"]]
>>> print(fit_table(rows, ["key", "op", "mean", "std"], width=22, drop=("std", "op")))
key             mean
--------------  ------
layer1.0.conv1  1.0
(hidden: std, op; --wide shows all)
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import Sequence

from tabulate import tabulate

__all__ = ["table_width", "fit_table", "ellipsize", "fit_line"]

ELLIPSIS = "…"
MIN_CELL = 12  # a truncated cell keeps at least this many characters
FIRST_CAP = 40  # before dropping columns, truncatable cells are capped at this width
SEPARATOR = 2  # tabulate's "simple" format puts two spaces between columns


def table_width(wide: bool | None = None) -> int | None:
    """Characters a table may use, or ``None`` for the full table.

    ``wide=True`` is always the full table. Otherwise ``COLUMNS`` wins when set;
    else the terminal's width when standard output is a terminal; else (a file,
    a pipe, a notebook) ``None``.

    >>> table_width(wide=True) is None
    True
    """
    if wide:
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = sys.stdout
    try:
        if stream is None or not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


def fit_line(text: str, width: int | None) -> str:
    """``text`` broken after ``", "`` into lines of at most ``width`` characters (``None``: as is).

    A title over a fitted table fits the same width; a piece longer than the
    width is broken at its spaces (or, with none, inside a word), never cut.

    >>> print(fit_line("torchvision.models:resnet18: ResNet, input 1x3x224x224, capture=modules", 40))
    torchvision.models:resnet18: ResNet,
      input 1x3x224x224, capture=modules
    >>> print(fit_line("a/very/long/path/to/models.py:make_model, input 1x3", 20))
    a/very/long/path/to/
      models.py:make_mod
      el, input 1x3
    """
    if width is None or len(text) <= width:
        return text
    lines: list[str] = []
    current = ""
    for piece in text.split(", "):
        candidate = f"{current}, {piece}" if current else piece
        if current and len(candidate) + 1 > width:  # + 1: the comma that ends a broken line
            lines.append(current + ",")
            current = "  " + piece
        else:
            current = candidate
    lines.append(current)
    fitted: list[str] = []
    for line in lines:  # a piece longer than the width: broken at spaces, else inside words
        fitted += [line] if len(line) <= width else textwrap.wrap(
            line.lstrip(), width, subsequent_indent="  ", break_on_hyphens=False,
            initial_indent="  " if line.startswith("  ") else "")
    return "\n".join(fitted)


def ellipsize(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``…`` when cut.

    >>> ellipsize("layer4.1.downsample.0", 10)
    'layer4.1.…'
    """
    if len(text) <= width:
        return text
    return text[:max(width - 1, 0)] + ELLIPSIS


def _widths(rows, headers) -> list[int]:
    # tabulate's "simple" format pads each header by two (its MIN_PADDING)
    return [max([len(h) + 2] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]


def _total(widths) -> int:
    return sum(widths) + SEPARATOR * max(len(widths) - 1, 0)


def _render(cells: list[list[str]], headers: list[str], align: list[str] | None) -> str:
    """tabulate's ``simple`` format with text columns, written out: tabulate guesses a type
    for every cell, which costs most of the time of a table of a large graph."""
    if align is not None and not all(a in ("left", "right") for a in align) or any(
            len(row) != len(headers) or not all(c.isascii() and "\n" not in c for c in row)
            for row in cells) or not all(h.isascii() and "\n" not in h for h in headers):
        # multi-line or wide characters, ragged rows, other alignments: tabulate's own layout
        kwargs = {"colalign": tuple(align)} if align is not None else {}
        return tabulate(cells, headers=headers, disable_numparse=True, tablefmt="simple", **kwargs)
    cells = [[c.strip() for c in row] for row in cells]
    widths = [len(h) + 2 for h in headers]  # tabulate pads each header by two (MIN_PADDING)
    for row in cells:
        for index, cell in enumerate(row):
            if len(cell) > widths[index]:
                widths[index] = len(cell)
    right = [a == "right" for a in align] if align is not None and cells else [False] * len(widths)

    def line(values: list[str]) -> str:  # tabulate aligns headers as their column
        return "  ".join(v.rjust(w) if r else v.ljust(w)
                         for v, w, r in zip(values, widths, right)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)]
                     + [line(row) for row in cells])


def fit_table(rows: Sequence[Sequence[object]], headers: Sequence[str], *,
              width: int | None = None, drop: Sequence[str] = (), truncate: Sequence[str] = (),
              short: dict[str, str] | None = None,
              colalign: Sequence[str] | None = None) -> str:
    """Render ``rows`` under ``headers`` (tabulate's ``simple``), fitted to ``width`` characters.

    ``drop``: header names to drop, least important first. ``truncate``: header
    names whose cells may end in ``…``. ``short``: short forms of long header
    names. ``colalign``: ``"left"`` / ``"right"`` per column. ``width=None``
    renders the full table, unchanged.

    >>> print(fit_table([["relu", "0.5"], ["layer1.0.conv1", "12.25"]], ["key", "mean"],
    ...                 colalign=("left", "right")))
    key               mean
    --------------  ------
    relu               0.5
    layer1.0.conv1   12.25
    """
    cells = [[str(cell) for cell in row] for row in rows]
    headers = [str(header) for header in headers]
    align = list(colalign) if colalign is not None else None
    if width is None or _total(_widths(cells, headers)) <= width:
        return _render(cells, headers, align)
    if short:
        headers = [short.get(h, h) for h in headers]
        truncate = [short.get(h, h) for h in truncate]
        drop = [short.get(h, h) for h in drop]
    cut = [i for i, h in enumerate(headers) if h in truncate]

    def cap(limit: int) -> None:
        for row in cells:
            for i in cut:
                row[i] = ellipsize(row[i], max(limit, len(headers[i])))

    cap(FIRST_CAP)
    hidden: list[str] = []
    for name in drop:
        if _total(_widths(cells, headers)) <= width:
            break
        if name in headers:
            index = headers.index(name)
            hidden.append(name)
            del headers[index]
            for row in cells:
                del row[index]
            if align is not None:
                del align[index]
            cut = [i for i, h in enumerate(headers) if h in truncate]
    excess = _total(_widths(cells, headers)) - width
    if excess > 0 and cut:  # shrink the widest truncatable column first, down to MIN_CELL
        widths = _widths(cells, headers)
        for i in sorted(cut, key=lambda i: -widths[i]):
            target = max(MIN_CELL, widths[i] - excess)
            for row in cells:
                row[i] = ellipsize(row[i], target)
            excess -= widths[i] - target
            if excess <= 0:
                break
    text = _render(cells, headers, align)
    if hidden:
        text += f"\n(hidden: {', '.join(hidden)}; --wide shows all)"
    return text
