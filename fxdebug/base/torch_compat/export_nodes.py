"""The grad-mode and autocast functions ``no_grad``/``autocast`` call and ``torch.export``
puts in its graphs as nodes, and the shape-guard submodule some exports add.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["AUTOCAST_NODE_FUNCTIONS", "ENTER_AUTOCAST", "EXIT_AUTOCAST", "SET_GRAD_ENABLED",
           "autocast_arguments", "is_autocast_function", "is_export_guard_call",
           "is_tensor_metadata_assert"]

SET_GRAD_ENABLED = torch._C._set_grad_enabled
"""What ``no_grad``/``enable_grad`` call: the grad-mode node ``torch.export`` emits too
(2.9.1, 2.14.1). torch keeps it through dead-code elimination."""

ENTER_AUTOCAST, EXIT_AUTOCAST = (torch.amp.autocast_mode._enter_autocast,
                                 torch.amp.autocast_mode._exit_autocast)
"""The autocast nodes ``torch.export`` emits (2.9.1, 2.14.1); both reach a TorchFunctionMode."""

AUTOCAST_NODE_FUNCTIONS = (ENTER_AUTOCAST, EXIT_AUTOCAST)


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


def is_export_guard_call(node: fx.Node) -> bool:
    """A call of the shape-guard submodule (``_guards_fn``) some torch.export versions put
    in the graph of ``ExportedProgram.module()`` (2.9.1; not 2.14.1's default).

    >>> any(is_export_guard_call(n) for n in fx.symbolic_trace(torch.nn.ReLU()).graph.nodes)
    False
    """
    return node.op == "call_module" and str(node.target).startswith("_guards")


def is_tensor_metadata_assert(node: fx.Node) -> bool:
    """A dtype/device check torch.export puts in its graphs
    (``torch.ops.aten._assert_tensor_metadata.default``, 2.9.1 and 2.14.1; where the op is
    gone no node matches): a graph widened to float64 drops it.

    >>> any(is_tensor_metadata_assert(n) for n in fx.symbolic_trace(torch.nn.ReLU()).graph.nodes)
    False
    """
    packet = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    return packet is not None and node.op == "call_function" and node.target is getattr(
        packet, "default", None)


def is_autocast_function(target) -> bool:
    """``target`` enters or leaves an autocast region in an exported graph (the private
    ``_enter_autocast``/``_exit_autocast`` of ``torch.amp.autocast_mode``, 2.9.1 and 2.14.1,
    recognised by name so a re-imported copy counts too).

    >>> is_autocast_function(ENTER_AUTOCAST), is_autocast_function(torch.relu)
    (True, False)
    """
    return any(target is known for known in AUTOCAST_NODE_FUNCTIONS) or getattr(
        target, "__name__", "") in (
        "_enter_autocast", "_exit_autocast")
