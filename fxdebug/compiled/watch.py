"""``fxdebug.watch_nonfinite``: the NaN watch, able to look inside a ``torch.compile``'d model.

The watch itself is :class:`fxdebug.nonfinite.watch.NonfiniteWatch`; it replays a
flagged step eagerly. A compiled model's NaN can be made by the compiled code alone
(a reduction ordered differently, a fusion), and then the eager replay is finite.
The watch made here is given :func:`~fxdebug.compiled.check_compiled` for that case:
it runs on the step's inputs, RNG state and buffers with the model's own backend and
names the first node where the compiled code differs from eager::

    watch_nonfinite(torch.compile(model))
      └─ check() on a flagged step: replay eagerly (find_nonfinite)
           └─ finite: NOT REPRODUCED, check_compiled(model inside, *step inputs,
                backend=the model's) -> report.compiled.first_divergence (key, file:line)
"""

from __future__ import annotations

from typing import Callable

import torch

from ..nonfinite.watch import NonfiniteWatch
from .check import check_compiled as _check_compiled

__all__ = ["watch_nonfinite"]


def watch_nonfinite(model: torch.nn.Module, ignore=None, group=None,
                    check_compiled: Callable | None = None) -> NonfiniteWatch:
    """Watch a training loop for NaN/Inf; name the node that made it on the first bad step.

    Each step costs one finiteness flag (a sum of the outputs, sums or a fused
    max|g| of the parameter gradients) and one read in :meth:`NonfiniteWatch.check`;
    the model runs eagerly, untouched. The first step whose outputs or
    parameter gradients hold a NaN or an Inf is replayed node by node with
    :func:`fxdebug.find_nonfinite` (same inputs, random-number state and
    buffers), which names the node that created it, forward or backward,
    with the user's ``file:line``. ``watch(x, mask=m)``: keyword arguments
    are passed on. ``watch.remove()``, or ``with fxdebug.watch_nonfinite(model)
    as watch:``, takes its hooks off, as torch's hook handles.

    Under ``torch.distributed`` (initialised when ``check()`` first runs, or
    ``group`` given) ``check()`` is a collective: one all-reduce of a vector of
    two numbers per rank per step, so every rank stops on the same step;
    the report names the ranks that went non-finite and, from their own
    replays, the node, with ``file:line`` (a ``DistributedDataParallel``
    model's module is replayed, without collectives).

    A replay that is finite while the step was not says ``NOT REPRODUCED``
    (``report.reproduced`` is False, ``ok`` too) and what to do. A
    ``torch.compile``'d model is replayed eagerly, so its compiled code's NaN
    does not come back there: :func:`fxdebug.check_compiled` then runs on the
    step's inputs with the model's backend, and ``report.compiled`` names the
    node where the compiled code first differs from eager.

    Args:
        model: the ``nn.Module`` the loop trains (``DistributedDataParallel``,
            ``torch.compile(model)`` too).
        ignore: keys or globs whose outputs may be non-finite on purpose.
        group: the process group whose ranks watch together (default: every rank).
        check_compiled: ``(module, *inputs, backend=, grads=) -> report``, run on a
            compiled model's step that the eager replay does not reproduce
            (default: :func:`fxdebug.check_compiled`).

    Example::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(2, 2)
        ...     def forward(self, x, scale=1.0):
        ...         return torch.log(self.fc(x) * scale)
        >>> _ = torch.manual_seed(0)
        >>> with fxdebug.watch_nonfinite(Net()) as watch:
        ...     for step in range(20):
        ...         out = watch(torch.randn(4, 2), scale=2.0)
        ...         out.nan_to_num().sum().backward()
        ...         report = watch.check()
        ...         if report is not None:
        ...             break
        >>> report.forward.key, report.forward.created
        ('log', True)
    """
    return NonfiniteWatch(model, ignore=ignore, group=group,
                          check_compiled=_check_compiled if check_compiled is None
                          else check_compiled)
