"""``fxdebug.runs.sharded``: an old path kept for pickles.

a sharded run loaded from disk and pickled before the sharded code moved holds
``fxdebug.runs.sharded.ShardedRecords`` and ``ShardedRecord``: pickle imports a class from the
module it was defined in, and the code now lives in :mod:`fxdebug.distributed.sharded`.
"""

from ..distributed.sharded import ShardedRecord, ShardedRecords

__all__ = ["ShardedRecord", "ShardedRecords"]
