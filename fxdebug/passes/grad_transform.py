"""GradTransform: edit gradients in backward, for activations and parameters, as a pass.

Seed 001 by hand::

    x.register_hook(lambda grad: torch.clamp(grad, min=0))       # inside forward
    net.fc1.bias.register_hook(lambda grad: torch.zeros(grad.shape))

As passes::

    fxdebug.instrument(net, passes=[GradTransform.clamp(min=0, include=["relu"]),
                                    GradTransform.zero(include=["fc1.bias"])])

which inserts::

    fc1_bias = self.fc1.bias
    edit_grads_fc1_bias = fxdebug_runtime_edited_parameter(fxdebug_grad_edit_1, fc1_bias, 'fc1.bias')
    ...
    relu = self.relu(conv)
    edit_grads_relu = fxdebug_runtime_edit_grads(fxdebug_grad_edit_0, relu, 'relu')
    ...
    fc1 = fxdebug_runtime_call_with_parameters(self.fc1, {'bias': edit_grads_fc1_bias}, flatten)

A parameter's gradient is edited on its uses in the graph: each forward
makes a view of the parameter whose gradient the edit replaces, and the
graph (and the module that owns the parameter, through
``call_with_parameters``) reads that view. Every backward through the
instrumented module is edited; the shared parameter never gets a hook, so
the caller's own model, run without fxdebug, never sees the edit.
"""

from __future__ import annotations

import difflib

import torch
import torch.fx as fx

from .. import runtime
from ..errors import SelectionError
from ..tracing.keys import META_KEY, META_PASS, META_SOURCE
from ..tracing.selection import matches, select
from ._placement import own_inputs
from .base import Pass

__all__ = ["GradTransform"]


class _Clamp:
    def __init__(self, min=None, max=None):
        self.min, self.max = min, max

    def __call__(self, grad):
        return grad.clamp(min=self.min, max=self.max)


class _Scale:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, grad):
        return grad * self.factor


def _zero(grad):
    return torch.zeros_like(grad)


class GradTransform(Pass):
    """Replace the gradient of selected activations / parameters by ``fn(grad)`` in backward.

    Args:
        fn: ``grad -> grad``; keep it picklable (a module-level function or
            one of the ready-made edits) if the module will be saved.
        include: keys or globs of activations (``"relu"``, ``"layer1.*"``)
            and/or parameter names (``"fc1.bias"``). Every pattern must match
            something.
        description: shown in the generated module's repr.

    Ready-made: :meth:`clamp`, :meth:`zero`, :meth:`scale`.

    Example::

        >>> import torch, fxdebug
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> gm = fxdebug.instrument(net, capture=[], passes=[
        ...     fxdebug.passes.GradTransform.zero(include=["0.bias"])])
        >>> gm(torch.ones(1, 2)).sum().backward()
        >>> net[0].bias.grad
        tensor([0., 0.])
    """

    name = "grad-transform"

    def __init__(self, fn, include, description: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"GradTransform needs a callable grad -> grad, got {fn!r}")
        patterns = [include] if isinstance(include, str) else list(include or ())
        if not patterns:
            raise SelectionError("GradTransform needs include=[...]: the activation keys or "
                                 "parameter names whose gradients it edits.")
        self.fn = fn
        self.include = patterns
        self.description: str = description or str(getattr(fn, "__name__", type(fn).__name__))

    @classmethod
    def clamp(cls, min=None, max=None, include=()) -> "GradTransform":
        """Clamp gradients to ``[min, max]`` (seed 001: no negative gradient into the conv)."""
        return cls(_Clamp(min, max), include, f"clamp(min={min}, max={max})")

    @classmethod
    def zero(cls, include=()) -> "GradTransform":
        """Zero gradients (seed 001: no gradient for the fc bias)."""
        return cls(_zero, include, "zero")

    @classmethod
    def scale(cls, factor: float, include=()) -> "GradTransform":
        """Multiply gradients by ``factor``."""
        return cls(_Scale(factor), include, f"scale({factor})")

    def run(self, gm: fx.GraphModule) -> bool:
        parameter_names = [name for name, _ in gm.named_parameters()]
        activation_patterns: list[str] = []
        parameters: list[str] = []
        for pattern in self.include:
            hits = [name for name in parameter_names if matches(name, pattern)]
            parameters.extend(hit for hit in hits if hit not in parameters)
            if not hits:
                activation_patterns.append(pattern)
        try:
            targets = select(gm, activation_patterns, None, None, None) if activation_patterns else []
        except SelectionError as exc:
            close = difflib.get_close_matches(str(activation_patterns[0]), parameter_names, n=3)
            hint = f" Close parameter names: {', '.join(map(repr, close))}." if close else ""
            raise SelectionError(f"pass {self.name!r}: {exc}{hint}") from None
        index = sum(1 for name, _ in gm.named_children() if name.startswith("fxdebug_grad_edit_"))
        attr = f"fxdebug_grad_edit_{index}"
        gm.add_submodule(attr, runtime.GradEdit(self.fn, self.description))
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        with (graph.inserting_after(anchor) if anchor else graph.inserting_before(None)):
            edit = graph.create_node("get_attr", attr, name=attr)
        edit.meta[META_KEY], edit.meta[META_PASS] = attr, self.name
        last = edit
        for name in parameters:
            last = _edit_parameter(gm, edit, name, last, self.name)
        targets = own_inputs(gm, targets, self.name)
        for target in targets:
            place = last if target.anchor.op == "placeholder" else target.anchor
            if place.op == "placeholder":  # before the edit node itself: after the input's view
                place = last
            with graph.inserting_after(place):
                node = graph.create_node("call_function", runtime.edit_grads,
                                         (edit, target.value, target.key), {},
                                         name=f"edit_grads_{target.key}")
            node.meta[META_KEY] = f"{target.key}:edit"
            node.meta[META_PASS] = self.name
            node.meta[META_SOURCE] = target.source
        return True


def _edit_parameter(gm: fx.GraphModule, edit: fx.Node, name: str, after: fx.Node,
                    pass_name: str) -> fx.Node:
    """Make every use of parameter ``name`` in the graph read an edited view; return the view's node."""
    graph = gm.graph
    with graph.inserting_after(after):
        param = graph.create_node("get_attr", name, name=name.replace(".", "_"))
    with graph.inserting_after(param):
        view = graph.create_node("call_function", runtime.edited_parameter, (edit, param, name),
                                 {}, name=f"edit_grads_{name}")
    param.meta[META_KEY], param.meta[META_PASS] = name, pass_name
    view.meta[META_KEY], view.meta[META_PASS] = f"{name}:edit", pass_name
    uses = 0
    for node in list(graph.nodes):
        if node is param:
            continue
        if node.op == "get_attr" and node.target == name:
            node.replace_all_uses_with(view)
            uses += 1
        elif node.op == "call_module" and name.startswith(f"{node.target}."):
            with graph.inserting_before(node):
                module = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
            module.meta[META_KEY], module.meta[META_PASS] = f"{node.target}:module", pass_name
            node.op, node.target = "call_function", runtime.call_with_parameters
            node.args = (module, {name[len(str(module.target)) + 1:]: view}) + tuple(node.args)
            uses += 1
        elif node.op == "call_function" and node.target is runtime.call_with_parameters:
            module, mapping = node.args[0], node.args[1]
            if name.startswith(f"{module.target}."):
                node.args = (module, {**mapping, name[len(module.target) + 1:]: view}) + \
                    tuple(node.args[2:])
                uses += 1
    if not uses:
        raise SelectionError(
            f"pass {pass_name!r}: parameter {name!r} is not used by the traced graph (no node "
            f"reads it, and no module call owns it), so there is no gradient to edit. Include "
            f"a parameter the model uses, or an activation key.")
    return view
