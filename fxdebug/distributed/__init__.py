"""Ranks of a ``torch.distributed`` job: which rank went out of sync, and at which key.

::

    compare_ranks(records_or_module)   ranks.py         fingerprints gathered, majority per key
      ├─ the group, DDP unwrapped, DTensor shards       rank_group.py
      └─ the report                                     ranks_report.py

(The NaN watch across ranks is :mod:`fxdebug.nonfinite.watch_ranks`.)

>>> import fxdebug
>>> fxdebug.distributed.compare_ranks.__name__
'compare_ranks'
"""

from .ranks import compare_ranks
from .ranks_report import RankEntry, RankReport

__all__ = ["compare_ranks", "RankReport", "RankEntry"]
