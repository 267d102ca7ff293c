"""``fxdebug.watch_nonfinite``: the NaN watch, able to look inside a ``torch.compile``'d model.

The watch itself lives in :mod:`fxdebug.nonfinite.watch`; it replays a flagged step
eagerly. A compiled model's NaN can be made by the compiled code alone (a
reduction ordered differently, a fusion), and then the eager replay is finite. The
watch made here is given :func:`~fxdebug.compiled.check_compiled` for that case: it
runs on the step's inputs, RNG state and buffers with the model's own backend and
names the first node where the compiled code differs from eager::

    watch_nonfinite(torch.compile(model))
      └─ check() on a flagged step: replay eagerly (find_nonfinite)
           └─ finite: NOT REPRODUCED, check_compiled(model inside, *step inputs,
                backend=the model's) -> report.compiled.first_divergence (key, file:line)
"""

from __future__ import annotations

import torch

from ..nonfinite.watch import NonfiniteWatch
from ..nonfinite.watch import watch_nonfinite as watch_eagerly
from .check import check_compiled

__all__ = ["watch_nonfinite"]


def watch_nonfinite(model: torch.nn.Module, ignore=None, group=None) -> NonfiniteWatch:
    """Watch a training loop for NaN/Inf; name the node that made it on the first bad step.

    :func:`fxdebug.nonfinite.watch_nonfinite` (see there: the flag per step, the
    replay, ``torch.distributed``), given :func:`fxdebug.check_compiled` for a
    ``torch.compile``'d model whose flagged step the eager replay does not
    reproduce: ``report.compiled`` is then its report on the step's inputs, and
    the report names the node where the compiled code first differs from eager.

    Example::

        >>> import torch, fxdebug
        >>> watch = fxdebug.watch_nonfinite(torch.nn.Linear(2, 2))
        >>> out = watch(torch.ones(3, 2)); out.sum().backward()
        >>> watch.check() is None, watch
        (True, <NonfiniteWatch Linear, 1 step(s), all finite so far>)
    """
    return watch_eagerly(model, ignore=ignore, group=group, check_compiled=check_compiled)
