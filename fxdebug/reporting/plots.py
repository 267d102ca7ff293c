"""Pictures of a run: activation and gradient norms per node, in execution order.

Needs matplotlib, an optional extra: ``pip install 'fxdebug[plot]'``. Figures
are drawn on a ``matplotlib.figure.Figure`` of their own: no pyplot state, no
change of the matplotlib backend (a notebook's inline figures stay as they were).
"""

from __future__ import annotations

import math

from ..errors import FxdebugError
from ..runtime import Records

__all__ = ["plot_norms", "require_matplotlib"]


def require_matplotlib():
    """``matplotlib.figure.Figure``, or an FxdebugError that says how to install matplotlib.

    >>> require_matplotlib().__name__
    'Figure'
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise FxdebugError("plotting needs matplotlib, an optional extra: pip install "
                           "'fxdebug[plot]' (or pip install matplotlib), then run again.") from None
    return Figure


def plot_norms(records: Records, path: str, title: str = "") -> str:
    """Draw the L2 norm of every captured activation (and its gradient) per node; save a PNG.

    Args:
        records: ``fxdebug.records(gm)`` after a forward (and backward, for gradients).
        path: where to write the image.
        title: a title for the figure.

    Returns:
        ``path``.

    Example::

        >>> import os, tempfile, torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)), grads=True)
        >>> gm(torch.ones(1, 2)).sum().backward()
        >>> path = plot_norms(fxdebug.records(gm), os.path.join(tempfile.mkdtemp(), "n.png"))
        >>> open(path, "rb").read(4)
        b'\\x89PNG'
    """
    figure_class = require_matplotlib()
    keys = records.keys()
    if not keys:
        raise FxdebugError("nothing to plot: the records are empty. Run the instrumented module "
                           "once before plotting.")
    activations = [records.record(key).stats.norm for key in keys]
    grads = [records.grads.record(key).stats.norm if key in records.grads else math.nan
             for key in keys]
    figure = figure_class(figsize=(max(6.0, 0.18 * len(keys)), 4.5))
    axis = figure.subplots()
    positions = list(range(len(keys)))
    axis.plot(positions, activations, marker="o", markersize=3, label="activation norm")
    if any(not math.isnan(g) for g in grads):
        axis.plot(positions, grads, marker="s", markersize=3, label="gradient norm")
    axis.set_yscale("log")
    axis.set_xticks(positions)
    axis.set_xticklabels(keys, rotation=90, fontsize=6)
    axis.set_xlabel("node, in execution order")
    axis.set_ylabel("L2 norm")
    axis.set_title(title or "activation and gradient norms per node")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})  # its own Agg canvas
    return path
