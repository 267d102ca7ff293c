"""Where a NaN or Inf came from: find it in one run, or watch every training step for it.

::

    find_nonfinite(model, *inputs)      nonfinite.py   first node making NaN/Inf, forward
                                                       and backward
    watch_nonfinite(model)              watch.py       a flag per step, find_nonfinite on
      │                                                the first bad one (replayed)
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

from .nonfinite import NonfiniteReport, find_nonfinite
from .watch import NonfiniteWatch, watch_nonfinite
from .watch_ranks import RankFinding, RankNonfiniteReport
from .watch_report import WatchReport

__all__ = ["find_nonfinite", "NonfiniteReport", "watch_nonfinite", "NonfiniteWatch",
           "WatchReport", "RankNonfiniteReport", "RankFinding"]
