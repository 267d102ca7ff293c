"""Messages of ``torch._assert`` calls that a model formats from traced values.

A model that checks sizes in Python (torchvision's ViT)::

    torch._assert(h == self.image_size, f"Wrong image height! Expected {self.image_size} but got {h}!")

formats its message while fx traces it, when ``h`` is a Proxy: the graph
would say "Expected 224 but got Proxy(getitem_2)" for ever. The tracer keeps
the text as a template and adds a node that fills in the run's values::

    traced_message = fxdebug_runtime_traced_message('... but got Proxy(getitem_2)!', ('getitem_2',), (getitem_2,))
    _assert = torch._assert(eq, traced_message)
"""

from __future__ import annotations

import re

from torch.fx.node import has_side_effect

from .nodes import emit_if_tracing

__all__ = ["TracedMessage", "traced_message", "PROXY_IN_TEXT"]

# How a Proxy formats itself inside an f-string: Proxy(node_name).
PROXY_IN_TEXT = re.compile(r"Proxy\((\w+)\)")


class TracedMessage:
    """An assertion message whose ``Proxy(name)`` parts become the values of this run.

    >>> str(TracedMessage("Expected 32 but got Proxy(getitem_2)!", ("getitem_2",), (64,)))
    'Expected 32 but got 64!'
    """

    __slots__ = ("template", "names", "values")

    def __init__(self, template: str, names: tuple, values: tuple) -> None:
        self.template, self.names, self.values = template, names, values

    def __str__(self) -> str:
        found = dict(zip(self.names, self.values))
        return PROXY_IN_TEXT.sub(
            lambda match: str(found[match.group(1)]) if match.group(1) in found else match.group(0),
            self.template)

    __repr__ = __str__


@has_side_effect
def traced_message(template: str, names: tuple, values: tuple) -> TracedMessage:
    """The message of a ``torch._assert`` with the traced values of ``names`` filled in (lazily)."""
    emitted = emit_if_tracing(traced_message, (template, names, values), {})
    if emitted is not None:
        return emitted
    return TracedMessage(template, names, values)
