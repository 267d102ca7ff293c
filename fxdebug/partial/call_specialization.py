"""Specialising one module call for tracing: what stays an input, what is fixed.

A part of a part-by-part model is traced for the call it is first called with:
tensors (also inside lists and dicts) become graph inputs, every other argument
(``None``, flags, sizes) is fixed with ``concrete_args``. :func:`call_plan`
says how, or why the call cannot be traced (``*args``, an ``ImageList``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect

import torch
import torch.fx as fx

from ..runtime import RECORDER_ATTR, SharedRecorder, leaves
from ..base import torch_compat
from ..base.formatting import dtype_text
from ..tracing.fidelity import static_forward
from ..tracing.keys import META_RETURNS, ModuleReturn
from ..tracing.module_copy import module_tree_copy
from .report import PARTIAL_REPORT_ATTR

__all__ = ["CallPlan", "call_plan", "ExportPlan", "export_plan", "call_forward", "strip_guards", "note_part_output", "set_submodule",
           "clean_tree", "is_fx_leaf", "is_container"]


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                   torch.layout, torch.memory_format, type(Ellipsis), slice, enum.Enum)


def _is_constant(value) -> bool:
    return isinstance(value, _CONSTANT_TYPES) and not isinstance(value, torch.Tensor)


@functools.lru_cache(maxsize=None)
def _forward_signature(cls) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    leaves, _ = torch_compat.tree_flatten(value)
    tensors = sum(isinstance(leaf, torch.Tensor) for leaf in leaves)
    if tensors:
        return f"{type(value).__name__} of {tensors} tensor(s)"
    text = repr(value)
    return text if len(text) <= 40 and " at 0x" not in text else type(value).__name__


@dataclasses.dataclass
class CallPlan:
    """How to trace and call a module for one call: or why it cannot be."""

    signature: tuple = ()
    positional: list = dataclasses.field(default_factory=list)
    concrete_args: dict = dataclasses.field(default_factory=dict)
    description: str = ""
    reason: str = ""
    keywords: tuple = ()  # given through **kwargs: traced as named inputs, in this order


def call_plan(module: torch.nn.Module, args: tuple, kwargs: dict) -> CallPlan:
    """Bind a call to ``forward``'s parameters; tensors stay inputs, the rest is fixed."""
    # a class is hashable; torch's stubs declare Module.__hash__ in a way mypy reads as not
    signature = _forward_signature(type(module))  # type: ignore[arg-type]
    if signature is None:
        return CallPlan(reason="its forward has no inspectable signature")
    takes_self = static_forward(module) is None
    try:
        bound = signature.bind(*((module,) if takes_self else ()), *args, **kwargs)
    except TypeError as exc:
        return CallPlan(reason=f"the call does not match forward's signature ({exc})")
    names: list[str] = []
    values: list = []
    described: list[str] = []
    extra: list = []
    plan = CallPlan()
    keyword_only = any(p.kind == p.KEYWORD_ONLY for p in signature.parameters.values())
    for index, (name, parameter) in enumerate(signature.parameters.items()):
        if index == 0 and takes_self:
            continue  # self
        given = bound.arguments.get(name)
        if (parameter.kind == parameter.VAR_POSITIONAL and given and not keyword_only
                and all(isinstance(value, torch.Tensor) for value in given)):
            extra = list(given)  # tensors through *args: graph inputs after the named ones
            described.append(f"*{name}={len(extra)} tensor(s)")
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            if given:
                return CallPlan(reason=f"it is called with extra arguments through "
                                        f"{'*' if parameter.kind == parameter.VAR_POSITIONAL else '**'}"
                                        f"{name} that are not all tensors (or with keyword-only "
                                        f"parameters after them), which tracing cannot fix")
            continue
        value = bound.arguments.get(name, parameter.default)
        if value is inspect.Parameter.empty:
            return CallPlan(reason=f"argument {name!r} is missing")
        why = _add(plan, name, value, names, values, described)
        if why:
            return CallPlan(reason=why)
    leaves, spec = torch_compat.tree_flatten(values)
    marks = tuple(("tensor",) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
                  for leaf in leaves)
    plan.signature = (tuple(m.training for m in module.modules()), spec, marks, len(extra),
                      plan.keywords)
    plan.positional = values + extra
    plan.description = f"({', '.join(described)})"
    return plan


def _add(plan: CallPlan, name: str, value, names: list, values: list, described: list) -> str:
    """Add one argument to ``plan``: a graph input (tensors) or fixed; why not, or ``""``."""
    names.append(name)
    values.append(value)
    if isinstance(value, torch.Tensor):
        described.append(name)
        return ""
    leaves, spec = torch_compat.tree_flatten(value)
    odd = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)
           and not _is_constant(leaf)]
    if odd:
        return (f"argument {name!r} holds a value of type {type(odd[0]).__name__}, which "
                f"is neither a tensor, a container of tensors nor a constant")
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        plan.concrete_args[name] = torch_compat.tree_unflatten(
            [fx.PH if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
    else:
        plan.concrete_args[name] = value
    described.append(f"{name}={_describe(value)}")
    return ""


@dataclasses.dataclass
class ExportPlan:
    """How to export a module for one call (``args``, ``kwargs`` as given): or why not.

    ``signature`` holds everything the exported graph is specialised to: the
    training flags, the grad mode, the structure of the arguments, every
    tensor's shape, dtype, device and layout, every other value.
    """

    signature: tuple = ()
    positional: list = dataclasses.field(default_factory=list)
    description: str = ""
    reason: str = ""


def _describe_tensor(tensor: torch.Tensor) -> str:
    return f"{dtype_text(tensor.dtype)}[{', '.join(map(str, tensor.shape))}]"


def export_plan(module: torch.nn.Module, args: tuple, kwargs: dict) -> ExportPlan:
    """The specialisation of ``module(*args, **kwargs)`` for ``torch.export``.

    >>> plan = export_plan(torch.nn.ReLU(), (torch.ones(2, 3),), {"inplace": None})
    >>> plan.description, plan.reason
    ('(float32[2, 3], inplace=None)', '')
    >>> export_plan(torch.nn.ReLU(), (object(),), {}).reason[:36]
    'argument 0 holds a value of type obj'
    """
    leaves, spec = torch_compat.tree_flatten((tuple(args), dict(kwargs)))
    marks: list[tuple] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            marks.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.layout))
        elif _is_constant(leaf):
            marks.append((type(leaf), leaf))
        else:
            where = next((f"argument {name!r}" for name, value in kwargs.items()
                          if any(item is leaf for item in torch_compat.tree_leaves(value))), None)
            where = where or next((f"argument {index}" for index, value in enumerate(args)
                                   if any(item is leaf for item in torch_compat.tree_leaves(value))), "")
            return ExportPlan(reason=f"{where} holds a value of type {type(leaf).__name__}, "
                                     f"which torch.export cannot take as an input")
    described = [_describe_export(value) for value in args]
    described += [f"{name}={_describe_export(value)}" for name, value in kwargs.items()]
    return ExportPlan(signature=(tuple(m.training for m in module.modules()),
                                 torch.is_grad_enabled(), spec, tuple(marks)),
                      positional=[*args, *kwargs.values()],
                      description=f"({', '.join(described)})")


def _describe_export(value) -> str:
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(item, torch.Tensor) for item in value):
        return f"{type(value).__name__} of {', '.join(map(_describe_tensor, value))}"
    return _describe(value)


def call_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Run the class's own ``forward`` on ``module`` (a ``@staticmethod`` forward without it).

    >>> call_forward(torch.nn.ReLU(), (torch.tensor([-1.0, 2.0]),), {})
    tensor([0., 2.])
    """
    static = static_forward(module)
    if static is not None:
        return static(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def strip_guards(gm: fx.GraphModule) -> None:
    """Drop the asserts fx adds for fixed arguments (the dispatcher checks them on every
    call) and the inputs' defaults (it passes every input): fx prints defaults into the
    target of its pytree unpacking (``a = None, = tree_flatten_spec(...)``, a SyntaxError)
    where an argument holds tensors in a tuple (HF's ``position_embeddings``)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        node.args = ()
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if node.target is torch._assert or (torch_compat.ASSERT_IS_NONE is not None
                                            and node.target is torch_compat.ASSERT_IS_NONE):
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            for arg in inputs:
                if arg.op == "call_function" and not arg.users:
                    gm.graph.erase_node(arg)


def note_part_output(gm: fx.GraphModule, path: str, module_type: str) -> None:
    """Record the part's own output as a module output keyed ``path`` (as in a full trace)."""
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    value = output.args[0] if output.args else None
    specs = torch_compat.pytree_specs(gm.graph)
    # arguments given as pytrees: the graph returns flat outputs
    if specs is not None and specs[1] is not None and isinstance(value, (list, tuple)):
        value = torch_compat.tree_unflatten(list(value), specs[1])
    items = leaves(value, is_leaf=lambda item: isinstance(item, fx.Node))
    if not items:
        return
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    anchor = max((node for _, node in items), key=order.__getitem__)
    record = ModuleReturn(path, module_type, tuple((sub, node.name) for sub, node in items), None)
    anchor.meta.setdefault(META_RETURNS, []).append(record)


def set_submodule(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    torch_compat.set_child(parent, name, module)


def clean_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a dispatch subtree with the dispatchers taken out: what tracing sees."""
    clean = module_tree_copy(module, share_parameters=True)  # FSDP2 swaps the module's own
    for sub in clean.modules():
        sub.__dict__.pop("forward", None)
        sub.__dict__.pop(PARTIAL_REPORT_ATTR, None)
        if isinstance(torch_compat.own_children(sub).get(RECORDER_ATTR), SharedRecorder):
            delattr(sub, RECORDER_ATTR)  # public: drops it from the children
    return clean


_LEAF_TRACER: fx.Tracer | None = None


def is_fx_leaf(module: torch.nn.Module) -> bool:
    global _LEAF_TRACER
    if _LEAF_TRACER is None:
        _LEAF_TRACER = fx.Tracer()
    return _LEAF_TRACER.is_leaf_module(module, "")


def is_container(module: torch.nn.Module) -> bool:
    """ModuleList, ModuleDict and other modules without a forward of their own."""
    return getattr(type(module), "forward", None) is torch.nn.Module.forward

