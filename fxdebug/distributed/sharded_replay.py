"""What a replay of a sharded model's step (FSDP2, tensor parallel) needs on every rank.

A model whose parameters are ``DTensor``s runs collectives in its forward and
backward (FSDP2's all-gathers and reduce-scatters, tensor parallelism's
all-reduces), so its step is replayed on every rank at once, in lockstep
(``find_nonfinite(..., lockstep=True)``)::

    sharded_parameter(module)      the first DTensor parameter's name: replay together
    kept_parameters(module)        around the replay: each parameter's local values and
                                   gradient as they were, FSDP2's shards put back in place
    OutcomeGroup.of(ranks)         a gloo group of the same ranks, for the replay's own
                                   agreement (what each rank found, or the error that stopped
                                   it): never mixed up with the model's collectives, and
                                   with a timeout longer than theirs

Everything here is public ``torch.distributed`` (``new_group``, ``all_gather_object``,
``FSDPModule.reshard``, ``DTensor.to_local``).

>>> sharded_parameter(torch.nn.Linear(2, 2))
''
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Any, Iterator

import torch

__all__ = ["sharded_parameter", "kept_parameters", "OutcomeGroup", "local"]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``tensor``: a DTensor's local shard, any other tensor itself.

    >>> local(torch.ones(1))
    tensor([1.])
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor) is not torch.Tensor else tensor


def sharded_parameter(module: torch.nn.Module) -> str:
    """The name of the first ``DTensor`` parameter of ``module`` (FSDP2's shards, a tensor
    parallel layer's), or ``""``: such a model's step runs collectives, so every rank
    replays it together."""
    for name, parameter in module.named_parameters():
        if type(parameter) is not torch.nn.Parameter and hasattr(parameter, "to_local"):
            return name
    return ""


def _reshard(module: torch.nn.Module) -> None:
    """Put FSDP2's sharded parameters back in place of the all-gathered ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 has no FSDP2 module to reshard
        return
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@contextlib.contextmanager
def kept_parameters(module: torch.nn.Module) -> Iterator[None]:
    """Around a replay: every parameter's local values and gradient (a DTensor's shard) are
    as they were afterwards, and FSDP2's sharded parameters are the module's again (a
    forward without backward can leave the all-gathered ones registered).

    >>> lin = torch.nn.Linear(1, 1)
    >>> before = lin.weight.detach().clone()
    >>> with kept_parameters(lin):
    ...     with torch.no_grad():
    ...         _ = lin.weight.add_(1)
    ...     lin.weight.grad = torch.ones(1, 1)
    >>> torch.equal(lin.weight, before), lin.weight.grad is None
    (True, True)
    """
    named = list(module.named_parameters())
    saved = [(p, local(p).detach().clone(),
              None if p.grad is None else local(p.grad).detach().clone()) for _, p in named]
    try:
        yield
    finally:
        if [id(p) for _, p in module.named_parameters()] != [id(p) for _, p in named]:
            _reshard(module)
        with torch.no_grad():
            for parameter, values, grad in saved:
                local(parameter).copy_(values)  # the same bits, unless the replay wrote
                if grad is None:
                    parameter.grad = None
                elif parameter.grad is not None:
                    local(parameter.grad).copy_(grad)


@dataclasses.dataclass(frozen=True)
class OutcomeGroup:
    """A gloo process group of the watch's ranks, used only to agree on a replay's outcome.

    Its timeout is twice torch's default (an hour): a rank whose replay stopped inside
    the model waits here while the others' collective in the model times out (the
    model's process group's own timeout), then they join it and every rank learns
    which one stopped, and why.
    """

    group: Any

    @classmethod
    def of(cls, members: tuple[int, ...]) -> "OutcomeGroup":
        import torch.distributed as dist
        from torch.distributed.constants import default_pg_timeout
        timeout = max(default_pg_timeout, datetime.timedelta(minutes=30)) * 2
        return cls(dist.new_group(ranks=list(members), backend="gloo", timeout=timeout,
                                  use_local_synchronization=True))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, small), in group order."""
        import torch.distributed as dist
        found: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, obj, group=self.group)
        return found
