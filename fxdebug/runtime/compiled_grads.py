"""Gradient hooks under ``torch.compile``: registered eagerly, on the tensors autograd sees.

Call tree::

    record_grads(recorder, value, key, op)      while dynamo traces (is_compiling())
      └─ register_grad_hooks(record_grads, ...)  torch.compiler.disable: dynamo ends the graph
                                                 before the call of record_grads
    record_grads(recorder, value, key, op)      the compiled code's call, after that graph:
                                                 run eagerly on the real tensors (dynamo
                                                 compiles no frame of it: torch_compat.
                                                 run_eagerly_from_compiled_code), hooks file
                                                 into the Records of this run

A hook must sit on a tensor autograd sees, and file into the Records of the
run that made it; neither exists while dynamo traces. Dynamo runs a
``torch.compiler.disable`` function eagerly between two graphs (a graph
break, by design, without a warning), so gradients are exactly eager's, at
the cost of one graph break per gradient-recording node.

This module is imported only while dynamo traces (``torch.compiler.disable``
imports dynamo, which ``import fxdebug`` does not).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["register_grad_hooks", "REASON"]


REASON = ("fxdebug registers the gradient hooks of instrument(..., grads=True) eagerly, on the "
          "tensors autograd sees: a graph break per gradient-recording node. Compile without "
          "fullgraph=True, or instrument with grads=False.")


@functools.partial(torch.compiler.disable, reason=REASON)
def register_grad_hooks(fn: Callable, recorder, value: Any, key: str, op: str,
                        stats_only: bool) -> None:
    """``fn(recorder, value, key, op, stats_only)``, never compiled (dynamo runs it eagerly).

    >>> seen = []
    >>> register_grad_hooks(lambda *args: seen.append(args[2]), None, None, "fc", "Linear", False)
    >>> seen
    ['fc']
    """
    fn(recorder, value, key, op, stats_only)
