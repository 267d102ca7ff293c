"""Every private torch name fxdebug uses, in one place, each with a public fallback.

fxdebug supports every torch release of the last year (``torch>=2.9``). A
private name (``torch._dynamo``, ``torch.fx.graph_module._forward_from_src``,
``grad_fn._saved_*``, ...) may change in any release, so the rest of the
package never touches one: it calls the functions below. Each says which
private name it reads, the torch versions it was checked on, and what it
does when that name is missing (a public way to the same result, or a
clear "needs torch X" error); ``tests/test_layout.py`` fails on a private
``torch._*`` name anywhere else in the package.

>>> torch_version() >= (2, 9)
True
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as _pytree  # no public pytree module up to torch 2.14 (checked 2.9.1, 2.14.1)

__all__ = ["torch_version", "tree_leaves", "is_op_packet", "op_schema", "SET_GRAD_ENABLED",
           "ENTER_AUTOCAST", "EXIT_AUTOCAST", "AUTOCAST_NODE_FUNCTIONS", "CODE_ONLY_MODULE",
           "autocast_arguments", "foreach_norm", "foreach_copy_"]

tree_leaves = _pytree.tree_leaves
"""``torch.utils._pytree.tree_leaves`` (checked on 2.9.1 and 2.14.1; torch has no public twin)."""

SET_GRAD_ENABLED = torch._C._set_grad_enabled
"""What ``no_grad``/``enable_grad`` call: the grad-mode node ``torch.export`` emits too
(2.9.1, 2.14.1). torch keeps it through dead-code elimination."""

ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
"""The autocast nodes ``torch.export`` emits (2.9.1, 2.14.1); both reach a TorchFunctionMode."""

AUTOCAST_NODE_FUNCTIONS = (ENTER_AUTOCAST, EXIT_AUTOCAST)

CODE_ONLY_MODULE: type = getattr(fx.graph_module, "_CodeOnlyModule", fx.GraphModule)
"""What ``torch.load`` re-traces a saved GraphModule into (2.9.1, 2.14.1); GraphModule if gone."""


def autocast_arguments(autocast: torch.autocast) -> tuple:
    """``(device, dtype, enabled, cache_enabled)`` of a ``torch.autocast`` object, as
    ``ENTER_AUTOCAST`` takes them (its private ``_enabled``/``_cache_enabled``, 2.9.1 and
    2.14.1; the constructor's defaults where they are gone).

    >>> autocast_arguments(torch.autocast("cpu", dtype=torch.bfloat16))
    ('cpu', torch.bfloat16, True, True)
    """
    enabled = getattr(autocast, "_enabled", True)
    cache = getattr(autocast, "_cache_enabled", torch.is_autocast_cache_enabled())
    return (autocast.device, autocast.fast_dtype, enabled, cache)


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor, as 0-dim tensors on its device, without a host read.

    ``torch._foreach_norm`` (checked on 2.9.1 and 2.14.1): one fused kernel on CUDA, one
    call on the CPU. Where it is gone, ``torch.linalg.vector_norm`` of each tensor (the
    same values, one kernel per tensor). ``ord=math.inf`` is max|x|: exact, never
    overflowing, NaN where a value is NaN.

    >>> [round(float(n), 3) for n in foreach_norm([torch.ones(4), torch.full((2,), 3.0)])]
    [2.0, 4.243]
    >>> big = [torch.tensor([3e38, -3e38])]  # finite values whose 2-norm overflows
    >>> [bool(torch.isfinite(n)) for n in foreach_norm(big) + foreach_norm(big, ord=float("inf"))]
    [False, True]
    """
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, ord))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair, in one call where torch has one.

    ``torch._foreach_copy_`` (checked on 2.9.1 and 2.14.1); where it is gone, one
    ``Tensor.copy_`` per pair (the same result).

    >>> targets = [torch.zeros(2), torch.zeros(1)]
    >>> foreach_copy_(targets, [torch.ones(2), torch.full((1,), 3.0)])
    >>> [t.tolist() for t in targets]
    [[1.0, 1.0], [3.0]]
    """
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


def is_op_packet(value) -> bool:
    """``value`` is an ``OpOverloadPacket`` such as ``torch.ops.aten.add`` (2.9.1, 2.14.1).

    >>> is_op_packet(torch.ops.aten.add), is_op_packet(torch.add)
    (True, False)
    """
    packet_type = getattr(torch._ops, "OpOverloadPacket", None)
    if packet_type is not None:
        return isinstance(value, packet_type)
    return callable(getattr(value, "overloads", None)) and hasattr(value, "default")


def op_schema(op) -> "torch.FunctionSchema":
    """The schema of an ``OpOverload`` (its ``_schema``, 2.9.1 and 2.14.1).

    >>> [arg.name for arg in op_schema(torch.ops.aten.relu.default).arguments]
    ['self']
    """
    return op._schema


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (public ``torch.__version__``).

    >>> isinstance(torch_version()[1], int)
    True
    """
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
