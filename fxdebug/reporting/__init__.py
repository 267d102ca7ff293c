"""Reading a graph or a run: tables of nodes, diffs of passes, plots of a run.

Nothing here changes a graph or runs a pass::

    print_tabular(gm, *inputs)          node_table.py: one row per node (key, opcode, target,
      └─ node_views(gm)                 args, shape, dtype, module, source, pass)
    diff(before, after)                 graph_diff.py: + / - / ~ rows, matched by name and
      ├─ snapshot(gm)                   provenance (passes.inherit_key), and a
      └─ GraphDiff.table / code_diff    unified diff of the generated code
    plot_norms(records, "norms.png")    plots.py: activation and gradient norms per node
    report(gm_or_reports, "r.html")     html.py: one self-contained HTML page (records,
                                        norm charts, coloured diffs, first divergence)
    SeriesView(charts, marks, tables)   series_view.py: values over steps as plain data,
      ├─ view_figure(view)              drawn by plots.py (matplotlib) and by
      └─ series_html(view)              series_html.py (inline SVG, for the page)

>>> import torch, fxdebug
>>> print(fxdebug.reporting.diff(fxdebug.trace(torch.nn.ReLU()), fxdebug.trace(torch.nn.ReLU())).table())
no change (3 nodes)
"""

from . import html, plots
from .html import report
from .graph_diff import DiffRow, GraphDiff, GraphSnapshot, diff, snapshot
from .. import errors as _errors

GraphChangedError = _errors.GraphChangedError  # its old path (defined in fxdebug.errors)
from .node_table import NodeView, node_views, print_tabular

__all__ = ["print_tabular", "node_views", "NodeView", "diff", "GraphDiff", "DiffRow",
           "GraphSnapshot", "snapshot", "plots", "html", "report"]
