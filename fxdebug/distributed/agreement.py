"""Every rank learns whether one failed, so that an error on one rank stops all of them.

A collective analysis runs local work (checks, tracing, a forward) between its
collectives. Where that work fails on one rank only, the others would wait in the
next collective until its timeout; instead every rank reports how its part went
(one small all-reduce), and where any failed every rank raises the same
:class:`~fxdebug.errors.FxdebugError`, naming the rank(s) and their messages (one
gather, only then)::

    value, error = attempt(lambda: local_work())
    raise_if_any_failed(group, error, "fxdebug.precision_sensitivity")

>>> attempt(lambda: 1 + 1)
(2, None)
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from ..errors import FxdebugError
from .rank_group import RankGroup, on_ranks

__all__ = ["attempt", "collective_device", "failed_ranks", "raise_on_failure",
           "raise_if_any_failed"]

T = TypeVar("T")


def attempt(work: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``(work(), None)``, or ``(None, the exception it raised)``: the caller hands the
    exception to :func:`raise_if_any_failed`, which raises it on every rank.

    >>> attempt(lambda: 1 / 0)[1].__class__.__name__
    'ZeroDivisionError'
    """
    try:
        return work(), None
    except Exception as error:  # noqa: BLE001 - raised again, on every rank, by the caller
        return None, error


def collective_device(group: RankGroup) -> torch.device:
    """Where this process's tensors for a collective on ``group`` go: the CPU for gloo, the
    current CUDA device for another backend where CUDA is in use.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> collective_device(RankGroup.of())
    device(type='cpu')
    >>> dist.destroy_process_group()
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return group.backend_device(torch.device("cuda", torch.cuda.current_device()) if cuda
                                else torch.device("cpu"))


def failed_ranks(group: RankGroup, flags: torch.Tensor) -> list[int]:
    """The global ranks whose slot of the all-reduced ``flags`` is set, in group order.

    >>> failed_ranks(RankGroup(None, (0, 2, 5), 0), torch.tensor([0.0, 1.0, 1.0]))
    [2, 5]
    """
    return [group.members[slot] for slot in range(group.size) if float(flags[slot]) > 0]


def _text(error: BaseException) -> str:
    return str(error) if isinstance(error, FxdebugError) else f"{type(error).__name__}: {error}"


def raise_on_failure(group: RankGroup, failed: list[int], error: Exception | None,
                     what: str) -> None:
    """Where ``failed`` (the same list on every rank) names ranks: gather their messages and
    raise the same :class:`~fxdebug.errors.FxdebugError` on every rank (chained from the
    rank's own exception where it failed itself). A collective, only when ``failed``.

    >>> raise_on_failure(RankGroup(None, (0, 1), 0), [], None, "work")  # none failed: nothing
    """
    if not failed:
        return
    messages: list[Any] = group.gather(None if error is None else _text(error))
    told = "; ".join(f"rank {rank}: {messages[group.members.index(rank)]}" for rank in failed)
    raise FxdebugError(
        f"{what} failed on {on_ranks(failed)} of {group.size}, so every rank stopped there "
        f"(it is a collective: every rank calls it, each with its own batch). {told}") from error


def raise_if_any_failed(group: RankGroup, error: Exception | None, what: str) -> None:
    """Raise on every rank of ``group`` where ``error`` is not None on any: the failing
    rank(s) named with their messages. A collective: every rank of ``group`` calls it.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> raise_if_any_failed(RankGroup.of(), None, "work")   # none failed: nothing
    >>> try:
    ...     raise_if_any_failed(RankGroup.of(), ValueError("a bad batch"), "work")
    ... except FxdebugError as error:
    ...     print(str(error).split(". ")[-1])
    rank 0: ValueError: a bad batch
    >>> dist.destroy_process_group()
    """
    flags = torch.zeros(group.size, dtype=torch.float64, device=collective_device(group))
    if error is not None:
        flags[group.slot] = 1.0
    group.all_reduce(flags)
    raise_on_failure(group, failed_ranks(group, flags), error, what)
