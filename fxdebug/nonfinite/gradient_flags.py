"""The watch's per-step gradient flag: a few numbers, finite when every parameter gradient is.

::

    GradientFlags()(parameters)     the gradients read in one C-level pass (no Python per
      │                             parameter on the usual step)
      ├─ dense CPU gradients:       concatenated in groups planned once per parameter list
      │                             (same dtype, same trailing shape, up to _CHUNK values),
      │                             one torch.cat and one sum per group, each of _ALONE
      │                             values or more summed alone; a frozen or unused
      │                             parameter's missing gradient is left out
      └─ anything else:             one fused max|g| (foreach_norm: one kernel on a GPU);
                                    a DTensor's by its shard, a sparse one's by its values

The groups are a plan, not a promise: ``torch.cat`` itself refuses tensors whose
devices, layouts or trailing shapes disagree, so a parameter changed in place since
the plan was made (``p.data = ...``) is caught there; its group goes the general way
for that step and the next step plans again, never a partial check.
"""

from __future__ import annotations

import math
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Callable

import torch

from ..base.torch_compat import foreach_norm

__all__ = ["GradientFlags", "flag_sum"]

_CHUNK = 1 << 20
"""Most values one group concatenates (4 MiB of float32)."""

_ALONE = 1 << 12
"""A gradient of this many values or more is summed alone: copying it into a group costs more
than the sum's own call (resnet50's 25.6M gradient values, 2 threads: 8.1 ms when gradients up
to _CHUNK values were concatenated, 2.6 ms so)."""

_GRAD = attrgetter("grad")
_PLAIN = torch.Tensor


class GradientFlags:
    """``flags(parameters)``: 0-dim tensors (a list, or one tensor off the CPU) that are all
    finite exactly when every float gradient of ``parameters`` is; None without gradients.

    >>> net = torch.nn.Linear(2, 2); net(torch.ones(1, 2)).sum().backward()
    >>> flags = GradientFlags()
    >>> all(math.isfinite(v) for v in map(float, flags(list(net.parameters()))))
    True
    >>> net.bias.grad[0] = float("nan")
    >>> all(math.isfinite(v) for v in map(float, flags(list(net.parameters()))))
    False
    """

    def __init__(self) -> None:
        self._planned: list[torch.Tensor] = []  # the parameters the plan was made for
        self._groups: list[tuple[Callable, bool]] = []  # (pick the group's gradients, alone?)
        self._rest: list[int] = []  # indices of parameters for the general path

    def __call__(self, parameters: list[torch.Tensor]) -> list[torch.Tensor] | torch.Tensor | None:
        planned = self._planned
        if len(planned) != len(parameters) or not all(map(is_, planned, parameters)):
            self._plan(parameters)
        grads = list(map(_GRAD, parameters))
        sums: list[torch.Tensor] = []
        rest = [parameters[i] for i in self._rest]
        strided = torch.strided
        for pick, alone in self._groups:
            members = pick(grads)
            if alone:
                flat = members
                if flat is None:  # frozen or unused
                    continue
            else:
                flat = _concatenated(members)
            if flat is _NOTHING:
                continue
            if flat is None or type(flat) is not _PLAIN or flat.layout is not strided:
                # changed since the plan (p.data = ..., a sparse gradient): the general path
                # checks these, and the next step plans again
                rest += (pick(parameters),) if alone else pick(parameters)
                self._planned = []
                continue
            sums.append(flag_sum(flat))
        if rest:
            norms = _max_abs(_float_grads(rest))
            if norms and norms[0].device.type != "cpu":
                if not sums:
                    return _stacked_max(norms)
                norms = [_stacked_max(norms)]
            sums += norms
        return sums or None

    def _plan(self, parameters: list[torch.Tensor]) -> None:
        """Sort the parameters into groups by their gradients (by the parameter where it has
        none yet: a gradient has its parameter's dtype, device and shape): plain dense float
        CPU tensors of at least one dimension, by dtype and trailing shape, in order; the
        others into the general path."""
        groups: list[list[int]] = []
        totals: list[int] = []
        open_groups: dict[tuple, int] = {}  # (dtype, trailing shape) -> group being filled
        rest: list[int] = []
        for index, parameter in enumerate(parameters):
            grad = parameter.grad
            tensor = parameter if grad is None else grad
            if (type(tensor) not in (torch.nn.Parameter, _PLAIN) or not tensor.is_cpu
                    or tensor.layout is not torch.strided or tensor.dim() == 0
                    or not (tensor.is_floating_point() or tensor.is_complex())):
                rest.append(index)
                continue
            size = tensor.numel()
            if size >= _ALONE:  # summed where it lies: a copy into a group would cost more
                groups.append([index])
                totals.append(size)
                continue
            key = (tensor.dtype, tuple(tensor.shape[1:]))
            group = open_groups.get(key)
            if group is None or totals[group] + size > _CHUNK:
                group = open_groups[key] = len(groups)
                groups.append([])
                totals.append(0)
            groups[group].append(index)
            totals[group] += size
        self._groups = [(itemgetter(*members), len(members) == 1) for members in groups]
        self._rest = rest
        self._planned = list(parameters)


_NOTHING = torch.empty(0)
"""What :func:`_concatenated` gives for a group without gradients (all frozen or unused)."""


def _concatenated(grads: tuple) -> torch.Tensor | None:
    """The gradients' values in one tensor (along the first dimension); ``_NOTHING`` where
    none has a gradient; None where ``torch.cat`` refuses them (its own check of devices,
    layouts and trailing shapes: changed since the plan) or one is not a plain tensor."""
    try:
        return torch.cat(grads)
    except TypeError:  # a None among them: a frozen or unused parameter
        pass
    except RuntimeError:
        return None
    present = [grad for grad in grads if grad is not None]
    if not present:
        return _NOTHING
    if not all(map(is_, map(type, present), repeat(_PLAIN))):
        return None
    try:
        return torch.cat(present)
    except RuntimeError:
        return None


def _float_grads(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty float gradients of ``parameters``; a DTensor's by its local shard."""
    grads = []
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None and (grad.is_floating_point() or grad.is_complex()):
            if type(grad) is not _PLAIN and hasattr(grad, "to_local"):
                grad = grad.to_local()  # a DTensor (FSDP2): its local shard
            if grad.layout is not torch.strided:  # sparse (Embedding(sparse=True)): its values
                grad = grad.coalesce().values() if grad.is_sparse else grad.values()
            if grad.numel():  # max|g| of nothing has no value (an empty shard)
                grads.append(grad)
    return grads


def _max_abs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """max|g| of each gradient (exact: no overflow, NaN where a value is), one fused call."""
    return foreach_norm(grads, math.inf) if grads else []


def flag_sum(flat: torch.Tensor) -> torch.Tensor:
    """The sum of a float tensor (of a complex one, of its real and imaginary parts), half
    precision in float32: non-finite where a value is. It may also overflow on finite values
    (gradients near 1e38); the watch confirms a flag on the values themselves before it
    reports, so that only costs the confirmation.

    >>> flag_sum(torch.tensor([1.0, float("inf")], dtype=torch.float16))
    tensor(inf)
    """
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if flat.dtype in (torch.float32, torch.float64):
        return flat.sum()
    return flat.sum(dtype=torch.float32)


def _stacked_max(norms: list[torch.Tensor]) -> torch.Tensor:
    """The max of 0-dim norms on one device, as float32 on the first's device (one kernel)."""
    device = norms[0].device
    return torch.stack([n if n.dtype == torch.float32 and n.device == device
                        else n.to(device, torch.float32) for n in norms]).max()
