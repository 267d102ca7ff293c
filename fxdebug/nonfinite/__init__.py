"""Where a NaN or Inf came from: find it in one run, or watch every training step for it.

::

    find_nonfinite(model, *inputs)      nonfinite.py   first node making NaN/Inf, forward
                                                       and backward
    NonfiniteWatch(model)               watch.py       a flag per step, find_nonfinite on
      │  (fxdebug.watch_nonfinite)                     the first bad one (replayed)
      ├─ a model fx cannot trace: replayed module by module        watch_modules.py
      ├─ its report, NOT REPRODUCED when the replay is finite      watch_report.py
      └─ torch.distributed: the flag all-reduced, every rank's finding gathered
                                                                   watch_ranks.py

>>> import torch, fxdebug
>>> class Log(torch.nn.Module):
...     def forward(self, x):
...         return torch.log(x)
>>> fxdebug.nonfinite.find_nonfinite(Log(), -torch.ones(2), grads=False).ok
False
"""

from typing import Any

from ..errors import deprecated
from .nonfinite import NonfiniteReport, find_nonfinite
from .watch import NonfiniteWatch
from .watch_ranks import RankFinding, RankNonfiniteReport
from .watch_report import WatchReport

__all__ = ["find_nonfinite", "NonfiniteReport", "NonfiniteWatch", "WatchReport",
           "RankNonfiniteReport", "RankFinding"]


def __getattr__(name: str) -> Any:
    """``fxdebug.nonfinite.watch_nonfinite``, the eager watch, is deprecated: one
    ``fxdebug.watch_nonfinite`` takes the same arguments and looks inside compiled code too."""
    if name == "watch_nonfinite":
        deprecated("fxdebug.nonfinite.watch_nonfinite", "fxdebug.watch_nonfinite (the same "
                   "arguments; it also names the node a torch.compile'd model's compiled code "
                   "makes a NaN at)")
        return NonfiniteWatch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
