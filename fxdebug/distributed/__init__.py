"""Ranks of a ``torch.distributed`` job: which rank went out of sync, and at which key.

::

    compare_ranks(records_or_module)   ranks.py         fingerprints gathered, majority per key
      ├─ the group, DDP unwrapped, DTensor shards       rank_group.py
      └─ the report                                     ranks_report.py
    ShardedRecords: a sharded run loaded from disk      sharded.py: pieces assembled on read
      ├─ statistics of the full tensor from the pieces  sharded_stats.py
      └─ pieces of unknown placement                    unknown_placement.py
    compare_runs(live sharded records, ...)             live_shards.py: gathered to rank 0
    moment summaries reduced over ranks (the monitor)   summaries.py
    find_nonfinite / the watch on a sharded model       sharded_replay.py: full parameters,
                                                        the outcome agreed by every rank
    the precision what-if on a sharded model            unsharded_copy.py: the model as plain
                                                        modules, full parameters, every rank
    an error on one rank stops every rank               agreement.py

(The NaN watch across ranks is :mod:`fxdebug.nonfinite.watch_ranks`: it is the rank half of
the watch and files its findings with the watch's own localizer and report.)

>>> import fxdebug
>>> fxdebug.distributed.compare_ranks.__name__
'compare_ranks'
"""

from .ranks import compare_ranks
from .ranks_report import RankEntry, RankReport

__all__ = ["compare_ranks", "RankReport", "RankEntry"]
