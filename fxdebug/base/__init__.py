"""The base room: what every other room imports, below everything but the errors.

    Report                  report.py        a verdict (.ok), .table(), a one-line repr,
                                             _repr_html_, to_dict(): every result (the
                                             runtime's Records are a report too)
    fit_table(rows, ...)    fit_to_width.py  the one table renderer (tabulate's "simple"):
                                             every table, print_tabular's too; fitted to
                                             the terminal, what to give up first, long
                                             cells ending in "…"
    records_table_html      records_html.py  the Records table as HTML (Jupyter, the page)
    shape_text, TOLERANCES  formatting.py    shapes, dtypes, numbers, places; the tolerances
    progress(...)           progress.py      a progress line on a terminal, nothing elsewhere
    torch_compat            torch_compat/    every use of a torch internal or of an API that
                                             changed between torch versions (torch_version.py:
                                             the installed version, the oldest supported)

>>> from fxdebug.base import fit_table
>>> print(fit_table([["a", 1]], ["key", "n"], width=20))
key      n
-----  ---
a        1
"""

from .fit_to_width import ellipsize, fit_line, fit_table, table_width
from .report import Report

__all__ = ["Report", "fit_table", "fit_line", "table_width", "ellipsize"]
