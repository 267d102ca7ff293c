"""The step's numbers over the ranks of a sharded model: what every rank's report is made of.

Each rank runs the step of the unsharded copy on its own batch; the numbers of the
global step are combined over the ranks (every combination a collective, in float64)::

    World.step(run, extras)   the step's loss and parameter gradients: the mean over ranks
                              (what DDP and FSDP train with for a mean loss; tensor-parallel
                              ranks hold the same batch, and a duplicate changes no mean),
                              and sums of the extra numbers asked (a node's ||x - x64||^2 and
                              ||x64||^2), with every rank's outcome in the same all-reduce: a
                              rank whose step failed stops every rank, naming it
    World.sum(values)         sums over ranks (counts of underflowing values, sizes)
    World.max(values)         maxima over ranks (amax)
    World.agree(error)        an error on one rank raised on every rank

>>> global_error([4.0, 0.0], [16.0, 9.0])   # sqrt((4 + 0) / (16 + 9))
0.4
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, cast

import torch

from ..distributed.agreement import (attempt, collective_device, failed_ranks,
                                     raise_if_any_failed, raise_on_failure)
from ..distributed.rank_group import RankGroup
from .steps import Step

__all__ = ["World", "global_error", "squared_norms"]

_WHAT = "fxdebug.precision_sensitivity"


def squared_norms(value: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """``[||value - reference||^2, ||reference||^2]`` in float64, as :func:`relative_error`
    sums them.

    >>> squared_norms(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    [4.0, 17.0]
    """
    difference = float(torch.linalg.vector_norm(value.double() - reference.double())) ** 2
    return [difference, float(torch.linalg.vector_norm(reference.double())) ** 2]


def global_error(differences: Sequence[float], norms: Sequence[float]) -> float:
    """``relative_error`` from squared norms summed over ranks: ``sqrt(sum d / sum n)``
    (``sqrt(sum d)`` where the reference is zero; ``inf`` where not finite).

    >>> global_error([1.0, 3.0], [0.0, 0.0]), global_error([float("nan")], [1.0])
    (2.0, inf)
    """
    difference, norm = math.fsum(differences), math.fsum(norms)
    if difference != difference or difference == float("inf"):
        return float("inf")
    return (difference / norm) ** 0.5 if norm > 0 else difference ** 0.5


class World:
    """The ranks of a process group as the sensitivity analysis combines its steps over them.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> world = World(RankGroup.of())
    >>> world.sum([1.0, 2.0]), world.max([3.0])
    ([1.0, 2.0], [3.0])
    >>> step, extras = world.step(lambda: Step(torch.tensor(2.0), [torch.ones(2)], {}, {}),
    ...                           [torch.Size([2])], lambda step: [5.0], count=1)
    >>> step.loss.item(), step.grads[0].tolist(), extras
    (2.0, [1.0, 1.0], [5.0])
    >>> dist.destroy_process_group()
    """

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.device = collective_device(group)

    def agree(self, error: Exception | None, what: str = _WHAT) -> None:
        """Raise on every rank where ``error`` is set on any (a collective)."""
        raise_if_any_failed(self.group, error, what)

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        if not values:
            return []
        buffer = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self.group.all_reduce(buffer, op)
        return buffer.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (one collective)."""
        return self._reduce(values, "sum")

    def max(self, values: Sequence[float]) -> list[float]:
        """Each of ``values``' largest over the ranks (one collective)."""
        return self._reduce(values, "max")

    def step(self, run: Callable[[], Step], shapes: Sequence[torch.Size],
             extras: Callable[[Step], list[float]] | None = None, count: int = 0,
             what: str = _WHAT) -> tuple[Step, list[float]]:
        """``run()`` on this rank, then the global step: loss and gradients (``shapes``: the
        parameters') averaged over the ranks in float64, and the ``count`` numbers
        ``extras(step)`` gives summed over them; the watched values stay this rank's."""
        size, slot = self.group.size, self.group.slot
        found, error = attempt(lambda: _with_extras(run, extras))
        numels = [math.prod(shape) for shape in shapes]
        buffer = torch.zeros(size + 1 + sum(numels) + count, dtype=torch.float64,
                             device=self.device)
        if found is None:
            buffer[slot] = 1.0
        else:
            step, local = found
            parts = [step.loss.reshape(1)] + [g.reshape(-1) for g in step.grads]
            pieces = torch.cat([p.detach().to(self.device, torch.float64) for p in parts])
            buffer[size:size + pieces.numel()] = pieces
            if count:
                buffer[size + pieces.numel():] = torch.tensor(local, dtype=torch.float64)
        self.group.all_reduce(buffer)
        raise_on_failure(self.group, failed_ranks(self.group, buffer[:size]), error, what)
        step, _ = cast("tuple[Step, list[float]]", found)  # not None: every rank raised above
        mean = buffer[size:size + 1 + sum(numels)] / size
        grads = [g.reshape(shape) for g, shape in
                 zip(torch.split(mean[1:], numels), shapes)]
        total = buffer[size + 1 + sum(numels):].tolist()
        return Step(mean[0], grads, step.values, step.value_grads), total


def _with_extras(run: Callable[[], Step], extras: Callable[[Step], list[float]] | None
                 ) -> tuple[Step, list[float]]:
    step = run()
    return step, (extras(step) if extras is not None else [])
