"""Record: one captured tensor (its view or copy, or its statistics), and the two kinds of
stats-mode Record whose summary is not simply held: a row of a batch, and a stale one.

>>> import torch
>>> r = Record("fc", "Linear", (2,), torch.float32, torch.tensor([1.0, 3.0]), False)
>>> r.stats.mean, r.stale
(2.0, False)
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import FxdebugError
from ..base import torch_compat
from ..base.formatting import dtype_text, shape_text
from .placement import Placement, local_value
from ..stats.summary import Stats, stats_from_summary, tensor_stats

__all__ = ["Record", "StaleStatsRecord", "BatchedStatsRecord"]

# Record without its __init__ (the capture fast paths fill its fields themselves)
_new_record = object.__new__


def _version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; ``None`` where it has none (inference tensors)."""
    return torch_compat.tensor_version(tensor)


@dataclasses.dataclass
class Record:
    """One captured tensor.

    ``value`` is the tensor in tensor mode (``None`` in stats mode, where
    ``summary`` holds its statistics on the tensor's device, see
    :mod:`fxdebug.stats.summary`);
    ``copied`` says whether it is a copy (taken because a later in-place op
    writes to it) or a view of the model's own activation. A view whose
    tensor was written in place after the capture (``stale``) is never shown
    as the captured value: ``rec[key]`` raises :class:`~fxdebug.errors.StaleCaptureError`.
    ``placement`` (a :class:`~fxdebug.runtime.placement.Placement`) is where the value sits on
    a device mesh under tensor or sequence parallelism (``None`` for a tensor no mesh shards):
    a DTensor's exact placements, or for a plain local tensor the placement its
    ParallelStyle gives it, or "local, placement unknown".
    ``via`` says how it was captured: ``"graph"`` (a capture node), ``"eager module"`` (the output
    of a module call that ran eagerly) or ``"eager op"`` (a torch function or
    tensor method inside code that ran eagerly).
    """

    key: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: torch.Tensor | None
    copied: bool
    _stats: Stats | None = None
    via: str = "graph"
    summary: torch.Tensor | None = None
    version: int | None = None
    placement: Placement | None = None

    @property
    def stale(self) -> bool:
        """Whether the (viewed) tensor was written in place after it was captured."""
        return self.version is not None and self.value is not None \
            and _version_of(self.value) != self.version

    def __getstate__(self) -> dict:
        # A copy (pickle, torch.save, deepcopy, all_gather_object) holds a new tensor with a
        # version counter of its own: keep how far the tensor moved since its capture instead.
        state = dict(self.__dict__)
        version = self.version
        now = None if version is None or self.value is None else _version_of(self.value)
        state["version"] = None if now is None or version is None else ("moved", now - version)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self.version, tuple):
            now = _version_of(self.value)
            self.version = None if now is None else now - self.version[1]

    def __repr__(self) -> str:
        stats = self.stats
        shape = shape_text(self.shape)
        dtype = dtype_text(self.dtype)
        copied = ", copied" if self.copied else ""
        if self.placement is not None:
            copied += f", {self.placement.describe()}"
        return (f"Record({self.key!r}, {self.op}, {shape} {dtype}{copied}, mean={stats.mean:.4g} "
                f"std={stats.std:.4g} min={stats.min:.4g} max={stats.max:.4g} "
                f"non-finite={stats.nonfinite})")

    @property
    def stats(self) -> Stats:
        if self._stats is None:
            if self.summary is not None:
                self._stats = stats_from_summary(self.summary)
            elif self.value is not None:  # of this rank's piece where the value is sharded
                self._stats = tensor_stats(self._local(self.value))
            else:
                raise FxdebugError(f"the capture of {self.key!r} holds neither its tensor nor its "
                                   f"statistics (a Record built by hand?): pass value= or "
                                   f"summary=.")
        return self._stats

    def _local(self, value: torch.Tensor) -> torch.Tensor:
        return value if self.placement is None else local_value(value)

    @property
    def nbytes(self) -> int:
        if self.value is None:
            return 0
        local = self._local(self.value)
        return local.numel() * local.element_size()


@dataclasses.dataclass(repr=False)
class StaleStatsRecord(Record):
    """A stats-mode capture whose tensor was written in place before its statistics were taken
    (by code fxdebug could not see): it shows no statistics rather than those of the new values."""

    @property
    def stale(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Record({self.key!r}, {self.op}, {shape_text(self.shape)} {dtype_text(self.dtype)}, stale)"


class BatchedStatsRecord(Record):
    """A stats-mode capture whose summary is a row of the statistics of many captures computed
    together (:mod:`fxdebug.runtime.stats_batch`): row ``_row`` of ``_batch[0]``, taken when
    first read."""

    _batch: list = [None]
    _row = 0

    @property
    def summary(self) -> torch.Tensor | None:
        found = self.__dict__.get("_summary")
        if found is None and self._batch[0] is not None:
            found = self.__dict__["_summary"] = self._batch[0][self._row]
        return found

    @summary.setter
    def summary(self, value: torch.Tensor | None) -> None:
        self.__dict__["_summary"] = value

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_summary"] = self.summary  # its own row, not the whole batch
        state.pop("_batch", None)
        state.pop("_row", None)
        return state
