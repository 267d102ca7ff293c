"""torch's operators below the public API: ``torch.ops`` overloads and their schemas, the
dispatch mode, the fused ``_foreach`` kernels, and ``assert_close``'s default tolerances.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # no public twin (2.9.1, 2.14.1)

__all__ = ["TorchDispatchMode", "assert_close_tolerances", "flatten_dense", "foreach_copy_",
           "foreach_norm", "is_op_overload", "is_op_packet", "op_schema"]


def is_op_packet(value) -> bool:
    """``value`` is an ``OpOverloadPacket`` such as ``torch.ops.aten.add`` (2.9.1, 2.14.1).

    >>> is_op_packet(torch.ops.aten.add), is_op_packet(torch.add)
    (True, False)
    """
    packet_type = getattr(torch._ops, "OpOverloadPacket", None)
    if packet_type is not None:
        return isinstance(value, packet_type)
    return callable(getattr(value, "overloads", None)) and hasattr(value, "default")


def is_op_overload(value) -> bool:
    """``value`` is an ``OpOverload`` such as ``torch.ops.aten.add.Tensor`` (``torch._ops``,
    2.9.1 and 2.14.1; where it is gone: anything with an ``overloadpacket`` and a schema).

    >>> is_op_overload(torch.ops.aten.add.Tensor), is_op_overload(torch.ops.aten.add)
    (True, False)
    """
    overload_type = getattr(torch._ops, "OpOverload", None)
    if overload_type is not None:
        return isinstance(value, overload_type)
    return hasattr(value, "overloadpacket") and hasattr(value, "_schema")


def op_schema(op) -> "torch.FunctionSchema":
    """The schema of an ``OpOverload`` (its ``_schema``, 2.9.1 and 2.14.1).

    >>> [arg.name for arg in op_schema(torch.ops.aten.relu.default).arguments]
    ['self']
    """
    return op._schema


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


def flatten_dense(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' values one after another in a new 1-D tensor (one dtype, one device).

    ``torch._utils._flatten_dense_tensors`` (checked on 2.9.1 and 2.14.1): one call that
    copies every tensor in C++ (on the CPU several times cheaper than a call per tensor).
    Where it is gone, ``torch.cat`` of each tensor reshaped (the same values).

    >>> flatten_dense([torch.ones(2, 2), torch.zeros(1)])
    tensor([1., 1., 1., 1., 0.])
    """
    fused = getattr(getattr(torch, "_utils", None), "_flatten_dense_tensors", None)
    if fused is not None:
        return fused(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


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


def assert_close_tolerances() -> dict[torch.dtype, tuple[float, float]]:
    """``{dtype: (rtol, atol)}`` that ``torch.testing.assert_close`` picks by default.

    Private: ``torch.testing._comparison._DTYPE_PRECISIONS`` (checked on 2.9.1 and
    2.14.1, the same table on both). Fallback: that table as written in torch 2.14
    (``tests/test_trust_runtime.py`` checks it against assert_close's verdicts).

    >>> assert_close_tolerances()[torch.float32]
    (1.3e-06, 1e-05)
    """
    try:
        from torch.testing._comparison import _DTYPE_PRECISIONS
    except ImportError:  # pragma: no cover - a torch without it
        _DTYPE_PRECISIONS = {
            torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
            torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
            torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
            torch.complex128: (1e-7, 1e-7)}
    return {dtype: (float(rtol), float(atol)) for dtype, (rtol, atol) in _DTYPE_PRECISIONS.items()}
