"""What every fxdebug result shares: the one report shape and the one table renderer.

Below everything else (the runtime's Records are a report too)::

    Report                  report.py        a verdict (.ok), .table(), a one-line repr,
                                             _repr_html_, to_dict(): every result
    fit_table(rows, ...)    fit_to_width.py  the one table renderer (tabulate's "simple"):
                                             every table, print_tabular's too; fitted to
                                             the terminal, what to give up first, long
                                             cells ending in "…"

>>> from fxdebug.base import fit_table
>>> print(fit_table([["a", 1]], ["key", "n"], width=20))
key      n
-----  ---
a        1
"""

from .fit_to_width import ellipsize, fit_line, fit_table, table_width
from .report import Report

__all__ = ["Report", "fit_table", "fit_line", "table_width", "ellipsize"]
