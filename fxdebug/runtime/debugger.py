"""The function ``passes.Breakpoint`` nodes call: stop in pdb inside the generated forward.

Generated code with ``Breakpoint("layer1.0.conv2")`` (resnet18)::

    layer1_0_relu = getattr(self.layer1, "0").relu(layer1_0_bn1)
    stop_layer1_0_conv2 = fxdebug_runtime_stop('layer1.0.conv2', 'Conv2d', {'layer1_0_relu': layer1_0_relu})
    layer1_0_conv2 = getattr(self.layer1, "0").conv2(layer1_0_relu)

``stop`` prints what the node will receive and starts pdb on the *caller's*
frame, the generated ``forward``: pdb shows the line of the node, and the
node's inputs are local variables there (``p layer1_0_relu.shape``).
``PYTHONBREAKPOINT`` is honoured like ``breakpoint()``: ``0`` disables every
stop, another hook (``ipdb.set_trace``) is called instead of pdb. Like the
other runtime functions it is kept by ``eliminate_dead_code`` and re-emits
itself under re-tracing.
"""

from __future__ import annotations

import contextlib
import os
import sys

from torch.fx.node import has_side_effect

from ..base.formatting import value_text
from .nodes import emit_if_tracing

__all__ = ["stop", "stops_disabled"]

_DISABLED = [0]


@contextlib.contextmanager
def stops_disabled():
    """Run code without stopping at Breakpoint nodes (``fxdebug.dump`` runs the model this way).

    >>> with stops_disabled():
    ...     stop("relu", "ReLU", {})
    """
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


@has_side_effect
def stop(key: str, op: str, inputs: dict):
    """Stop in pdb just before node ``key``; ``inputs`` maps its input variables to their values."""
    emitted = emit_if_tracing(stop, (key, op, inputs), {})
    if emitted is not None:
        return emitted
    hook = os.environ.get("PYTHONBREAKPOINT", "")
    if _DISABLED[0] or hook == "0":
        return None
    described = ", ".join(f"{name} ({value_text(value)})" for name, value in inputs.items())
    print(f"fxdebug: stopped before node {key!r} ({op}); its inputs: {described or 'none'}",
          flush=True)
    if hook not in ("", "pdb.set_trace"):
        sys.breakpointhook()
        return None
    import pdb
    pdb.Pdb().set_trace(sys._getframe(1))
    return None
