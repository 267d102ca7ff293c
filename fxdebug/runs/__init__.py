"""Runs on disk and side by side: save, stream while running, load, compare.

::

    save_records(records, path)            saved_runs.py   a manifest.json + one file of bytes
    load_records(path)                     saved_runs.py   Records again (lazily read)
    instrument(model, folder=path)         run_writer.py   every forward written while it runs
    compare_runs(a, b)                     run_comparison.py key by key, first divergence
      ├─ across dtypes: what rounding can explain        rounding.py
      └─ reference=: rounding told from bugs by a float64 run   reference.py

A sharded run (a folder per rank) is assembled by :mod:`fxdebug.distributed.sharded`.

>>> import os, tempfile, torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
>>> _ = gm(torch.ones(2))
>>> path = fxdebug.runs.save_records(fxdebug.records(gm), os.path.join(tempfile.mkdtemp(), "a"))
>>> fxdebug.runs.compare_runs(path, fxdebug.records(gm)).ok
True
"""

from .run_comparison import RunComparison, RunEntry, compare_runs
from .run_writer import RunWriter
from .saved_runs import SavedRecords, load_records, save_records
from ..distributed.sharded import ShardedRecords
from .. import errors as _errors

ReferenceMismatchError = _errors.ReferenceMismatchError  # its old path (defined in fxdebug.errors)

__all__ = ["save_records", "load_records", "SavedRecords", "ShardedRecords", "RunWriter",
           "compare_runs", "RunComparison", "RunEntry"]
