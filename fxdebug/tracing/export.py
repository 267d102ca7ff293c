"""The ``torch.export`` front end: graphs for models symbolic tracing cannot follow.

``torch.export`` runs the model on fake tensors shaped like the example
inputs, so it follows data-independent Python control flow that
``symbolic_trace`` cannot (``if x.dim() == 4``, loops over lists, a fixed
number of refinement steps). Its graph holds ATen operators, not module
calls; fxdebug gives every node a key that is a module path all the same::

    export_trace(model, *example_inputs)
      ├─ torch.export.export(copy of model, example_inputs)   parameters shared; the copy
      │                                  also returns every module call's outputs, so an
      │                                  output its caller ignores keeps a node (and a key)
      ├─ run_decompositions({})          functional: no in-place ops, captures stay exact
      ├─ ep.module()                     a GraphModule with the model's parameter names
      └─ keys from node.meta["nn_module_stack"]:
           node inside module ``layer1.0.conv1``   -> "layer1.0.conv1.conv2d"
           the value a module call returns         -> fxdebug_returns "layer1.0.conv1"
                                                      (nesting from one eager run: "attn/0")
           second call of the same module          -> "layer1.0.relu_1" (as fx names it)

Identity modules and eval-mode Dropout return an alias of their input while
exported, so they have a node and a key too. So ``capture="modules"`` captures
the same keys as on a symbolically traced model, and captures, gradients, diffs, equivalence checks and dumps work as
they do there. The graph is specialised to the example inputs' shapes and to
the model's train/eval mode at export time.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from typing import Any

import torch
import torch.fx as fx

from ..errors import TraceFailure
from ..runtime import flatten_tensors
from ..base import torch_compat
from .fidelity import UnfaithfulTrace
from .function_watch import custom_functions_applied
from .graph_module import DebugGraphModule
from .keys import (META_KEY, META_MODULE, META_RETURNS, META_SOURCE, KeyAllocator, ModuleReturn,
                   key_base)
from .locations import is_user_file, user_location_in_traceback
from ..base.formatting import format_location
from .module_copy import module_tree_copy
from .transaction import ModelSnapshot
from .unsupported import refuse_unsupported

__all__ = ["export_trace"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')


def _user_source(node: fx.Node) -> tuple[str, int] | None:
    """The innermost user ``(filename, lineno)`` in the node's recorded stack trace."""
    found = None
    for filename, lineno in _FRAME.findall(node.meta.get("stack_trace") or ""):
        if is_user_file(filename):
            found = (filename, int(lineno))
    return found


def _short_op_name(node: fx.Node) -> str:
    target: Any = node.target
    if torch_compat.is_op_overload(target):
        return target.overloadpacket.__name__
    if torch_compat.is_op_packet(target):
        return target.__name__
    return key_base(node.op, target, "")


def _module_calls(node: fx.Node) -> list[tuple[str, str, str]]:
    """``(call id, module path, class name)`` of the module calls around ``node``, outer first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(call_id, path, str(type_name).rsplit(".", 1)[-1])
            for call_id, (path, type_name) in stack.items() if path]


def _output_structures(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> dict:
    """``{(path, call index): [(subpath, shape), ...]}``: each module call's tensor outputs, eagerly.

    The exported graph shows which nodes leave a module, not how the module
    nested them (``(attn_output, None)``, ``ModelOutput(last_hidden_state=...)``);
    one eager run with forward hooks tells.
    """
    found: dict[tuple[str, int], list[tuple[str, tuple]]] = {}
    calls: dict[str, int] = {}
    handles = []
    for path, module in model.named_modules():
        if not path:
            continue

        def hook(_module, _args, output, path=path):
            index = calls.get(path, 0)
            calls[path] = index + 1
            found[(path, index)] = [(name, tuple(tensor.shape))
                                    for name, tensor in flatten_tensors(output)]

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _scratch_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A tree copy with buffers of its own: the run that tells output structures must not
    update the model's running statistics (BatchNorm in train mode)."""
    twin = module_tree_copy(model)
    for module in twin.modules():
        for name, buffer in list(torch_compat.own_buffers(module).items()):
            if buffer is not None:
                torch_compat.set_own_buffer(module, name, buffer.clone())
    return twin


def _output_items(outputs: list[fx.Node], eager: list[tuple[str, tuple]] | None) -> tuple:
    """``(subpath, node name)`` pairs for a module call's output nodes (graph order given)."""
    if eager and len(eager) == len(outputs):
        free = list(outputs)
        items = []
        for subpath, shape in eager:
            match = next((node for node in free if tuple(getattr(node.meta.get("val"), "shape",
                                                                 ())) == shape), None)
            if match is None:
                break
            free.remove(match)
            items.append((subpath, match.name))
        else:
            return tuple(items)
    if eager and (len(eager) > 1 or eager[0][0]):
        # a nested output of which the graph uses only some leaves (``hidden, _ = attn(x)``):
        # each used one keyed by its place in the output, as a trace of the call alone keys
        # it, where its shape names it alone; else by position among what is used
        shapes = [shape for _, shape in eager]
        named = []
        for node in outputs:
            shape = tuple(getattr(node.meta.get("val"), "shape", ()))
            places = [subpath for subpath, known in eager if known == shape]
            if len(places) != 1 or shapes.count(shape) != 1 or sum(
                    tuple(getattr(o.meta.get("val"), "shape", ())) == shape for o in outputs) != 1:
                break
            named.append((places[0], node.name))
        else:
            return tuple(named)
    if len(outputs) == 1:
        return (("", outputs[0].name),)
    return tuple((str(index), node.name) for index, node in enumerate(outputs))


def _assign_keys(gm: fx.GraphModule, module_paths, structures: dict | None = None) -> None:
    """Keys, scopes, sources and module outputs for every node of an exported graph (what a
    call returns: its nodes read outside it, the model's own output among those readers, and
    the nodes the call returned that only the kept outputs read)."""
    returned, kept = _kept_outputs(gm, gm.meta.get(_KEPT_OWNERS, []))
    keys = KeyAllocator(owned=module_paths)
    nodes = list(gm.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    call_key: dict[str, str] = {}
    call_info: dict[str, tuple[str, int, tuple[str, int] | None]] = {}  # type, depth, source
    call_index: dict[str, tuple[str, int]] = {}
    per_path: dict[str, int] = {}
    members: dict[str, list[fx.Node]] = {}
    for node in nodes:
        calls = _module_calls(node)
        for depth, (call_id, path, type_name) in enumerate(calls):
            if call_id not in call_key:
                call_key[call_id] = keys.allocate(path, owner=True)
                call_info[call_id] = (type_name, depth, _user_source(node))
                call_index[call_id] = (path, per_path.get(path, 0))
                per_path[path] = per_path.get(path, 0) + 1
            members.setdefault(call_id, []).append(node)
        scope = calls[-1][1] if calls else ""
        if node.op in ("placeholder", "output", "get_attr"):
            base = key_base(node.op, node.target, "")
        else:
            name = _short_op_name(node)
            base = f"{scope}.{name}" if scope else name
        node.meta[META_KEY] = keys.allocate(base)
        node.meta[META_MODULE] = scope
        node.meta[META_SOURCE] = _user_source(node)
    ends: list[tuple[int, int, int, Any]] = []
    for order, (call_id, inside) in enumerate(members.items()):
        member_set = dict.fromkeys(inside)
        outputs = [node for node in inside
                   if any(user not in member_set and (user.op != "output" or node in returned)
                          for user in node.users)]
        outputs += [node for node in kept.get(call_index[call_id], ())
                    if node in member_set and node not in outputs]
        outputs.sort(key=position.__getitem__)
        if not outputs:
            continue
        items = _output_items(outputs, (structures or {}).get(call_index[call_id]))
        type_name, depth, source = call_info[call_id]
        anchor = max(outputs, key=position.__getitem__)
        record = ModuleReturn(call_key[call_id], type_name, items, source)
        ends.append((position[anchor], -depth, order, (anchor, record)))
    for _, _, _, (anchor, record) in sorted(ends, key=lambda end: end[:3]):
        anchor.meta.setdefault(META_RETURNS, []).append(record)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _alias(input, *args, **kwargs):
    """forward of an identity module while exported: a node, so the module call has a key."""
    return torch.ops.aten.alias.default(input) if isinstance(input, torch.Tensor) else input


def _with_visible_identities(model: torch.nn.Module) -> torch.nn.Module:
    """Identity and eval-mode Dropout compute nothing, so torch.export would leave no node
    (and no key) for them; on the copy that is exported they return an alias of the input."""
    for module in model.modules():
        if isinstance(module, torch.nn.Identity) or (
                isinstance(module, torch_compat.DROPOUT_TYPES) and not module.training):
            module.__dict__["forward"] = _alias
    return model


def _export(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> fx.GraphModule:
    """torch.export, functionalized, as a GraphModule; without the partial graph torch.export
    prints to stderr when it fails (the TraceFailure says what went wrong)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), custom_functions_applied() as applied:
            exported = torch.export.export(model, inputs, kwargs)
        if applied:
            function, where = applied[0]
            refused = UnfaithfulTrace(
                f"the custom autograd Function {function.__module__}.{function.__qualname__} "
                f"is called in forward: an exported graph keeps its forward and drops its "
                f"backward, so gradients would differ from eager")
            refused.fxdebug_location = where
            raise refused
    except Exception as exc:
        text = printed.getvalue()
        partial_graph = getattr(exc, "partial_fx_graph", None)
        if partial_graph is not None:
            text = text.replace(str(partial_graph), "")
        if text.strip():
            sys.stderr.write(text)
        raise
    if printed.getvalue():
        sys.stderr.write(printed.getvalue())
    alias = torch.ops.aten.alias.default
    stacks = [node.meta.get("nn_module_stack") for node in exported.graph.nodes
              if node.target is alias]
    exported = exported.run_decompositions({})
    regenerated = [node for node in exported.graph.nodes if node.target is alias]
    if len(regenerated) == len(stacks):  # functionalization re-creates views with the scope
        for node, stack in zip(regenerated, stacks):  # of their user; give them theirs back
            if stack:
                node.meta["nn_module_stack"] = stack
    try:
        return exported.module(check_guards=False)
    except TypeError:  # torch without check_guards
        return exported.module()


def _with_every_output_kept(model: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    """On the copy that is exported, every submodule call's tensor outputs are also returned by
    the root, as ``(output, kept)``: torch.export drops a module's output the caller ignores
    (``hidden, _ = self.attn(x)``: the attention weights), so that leaf would have no node to
    capture and no key, while a trace of the call alone, or forward hooks, keep it. The extras
    are taken off the graph's output once keys are assigned (:func:`_drop_kept_outputs`).
    Returns the model and the list of ``(path, call index)`` owning each kept tensor, filled
    as it runs (torch.export puts the module's attributes back after tracing: the list is
    kept here, not on the module)."""
    kept: list[torch.Tensor] = []
    owners: list[tuple[str, int]] = []  # (path, call index) that returned each kept tensor
    calls: dict[str, int] = {}
    for path, module in model.named_modules():
        if not path:
            continue
        inner = module.forward

        @functools.wraps(inner)
        def keeping(*args, _inner=inner, _path=path, **kwargs):
            output = _inner(*args, **kwargs)
            index = calls.get(_path, 0)
            calls[_path] = index + 1
            for _, tensor in flatten_tensors(output):
                kept.append(tensor)
                owners.append((_path, index))
            return output
        module.__dict__["forward"] = keeping
    root = model.forward

    @functools.wraps(root)
    def returning(*args, **kwargs):
        kept.clear()
        owners.clear()
        calls.clear()
        output = root(*args, **kwargs)
        return output, tuple(kept)
    model.__dict__["forward"] = returning
    return model, owners


_KEPT_OWNERS = "_fxdebug_kept_owners"


def _kept_outputs(gm: fx.GraphModule, owners: list[tuple[str, int]]) -> tuple[set, dict]:
    """``(nodes the model itself returns, {(path, call index): nodes that call returned})``
    of a graph exported from :func:`_with_every_output_kept`'s copy."""
    specs = torch_compat.pytree_specs(gm.graph)
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else ()
    spec = None if specs is None else specs[1]
    if spec is None or getattr(spec, "num_children", 0) != 2:
        return set(flat), {}
    first = spec.child(0) if hasattr(spec, "child") else spec.children_specs[0]
    returned = set(flat[:first.num_leaves])
    extras = flat[first.num_leaves:]
    by_call: dict[tuple[str, int], list] = {}
    if len(extras) == len(owners):
        for node, owner in zip(extras, owners):
            if isinstance(node, fx.Node):
                by_call.setdefault(owner, []).append(node)
    return returned, by_call


def _drop_kept_outputs(gm: fx.GraphModule) -> None:
    """The exported graph returns the model's output alone again (see
    :func:`_with_every_output_kept`); a kept leaf nothing else reads is left for the capture
    pass, or for dead-code elimination where it captures nothing."""
    if not torch_compat.keep_first_output(gm.graph):
        raise TraceFailure(
            "fxdebug could not take the module outputs it asked torch.export to keep off the "
            "exported graph's output (this torch's exported graphs return another structure). "
            "Fix: trace with the fx front end, fxdebug.trace(model) or "
            "fxdebug.instrument(model) without frontend='export'.",
            module_path="", module_type=type(gm).__name__, location=None,
            kind="torch.export output", fix="use the fx front end")
    gm.recompile()


def _explained_export(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> fx.GraphModule:
    """:func:`_export` of a copy of ``model``; a TraceFailure saying where when it fails."""
    name = type(model).__name__
    try:
        copy, owners = _with_every_output_kept(_with_visible_identities(module_tree_copy(model)))
        plain = _export(copy, inputs, kwargs)
        plain.meta[_KEPT_OWNERS] = list(owners)
    except Exception as exc:  # any failure of user code under export is explained
        where = (getattr(exc, "fxdebug_location", None)
                 or user_location_in_traceback(exc.__traceback__))
        location = format_location(where) if where else None
        at = f" at {location}" if location else ""
        raise TraceFailure(
            f"fxdebug could not export {name} with torch.export{at}: {_first_line(exc)}. "
            f"Fix: use frontend='auto' (it falls back to instrumenting the traceable parts), "
            f"or make the model exportable (torch.export docs: torch.cond for value-dependent "
            f"branches, registered pytree types for custom outputs).",
            module_path="", module_type=name, location=location, kind="torch.export failed",
            fix="use frontend='auto'") from exc
    for node in list(plain.graph.nodes):
        if torch_compat.is_export_guard_call(node):
            plain.graph.erase_node(node)  # a shape guard call older torch inserts
    return plain


def export_trace(model: torch.nn.Module, *example_inputs,
                 example_kwargs: dict | None = None) -> fx.GraphModule:
    """Build an fxdebug GraphModule of ``model`` with ``torch.export`` on ``example_inputs``.

    Use it through ``fxdebug.trace(model, *inputs, frontend="export")``
    (or ``frontend="auto"``, which tries symbolic tracing first).
    ``example_kwargs`` are keyword arguments of the call (``output_attentions=True``);
    the graph then takes them as ``gm(*example_inputs, **example_kwargs)``
    does, and is specialised to their non-tensor values.

    Returns:
        A GraphModule of ATen operators whose keys are module paths, with
        ``gm.meta["fxdebug_frontend"] == "export"``. It shares the model's
        parameters and buffers; the model is not modified.

    Raises:
        TraceFailure: torch.export failed; the message gives its first line
            and the user line where it happened.

    Example::

        >>> import torch, fxdebug
        >>> class Pick(torch.nn.Module):           # symbolic tracing cannot branch on dim()
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 2)
        ...     def forward(self, x):
        ...         if x.dim() == 3:
        ...             x = x.flatten(1)
        ...         return self.fc(x)
        >>> gm = fxdebug.trace(Pick(), torch.randn(2, 2, 2), frontend="export")
        >>> [r.key for n in gm.graph.nodes for r in n.meta.get("fxdebug_returns", ())]
        ['fc']
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxdebug.trace expects an nn.Module, got {type(model).__name__}.")
    name = type(model).__name__
    example_kwargs = dict(example_kwargs or {})
    if not example_inputs and not example_kwargs:
        raise TraceFailure(
            f"fxdebug could not export {name}: frontend='export' needs example inputs. "
            f"Fix: call fxdebug.trace(model, *inputs, frontend='export').",
            module_path="", module_type=name, location=None, kind="no example inputs",
            fix="pass example inputs")
    # the eager run that tells output structures draws no numbers from the generators the
    # model's own runs use (a seeded run after this one gives what it gives without it)
    tensors = [*model.parameters(), *model.buffers(),
               *torch_compat.tree_leaves((example_inputs, example_kwargs))]
    devices = sorted({t.device.index or 0 for t in tensors
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    refuse_unsupported(model)
    before = ModelSnapshot(model)  # what export's runs write through shared hook state: put back
    try:
        with torch.random.fork_rng(devices=devices):
            plain = _explained_export(model, tuple(example_inputs), example_kwargs)
            _assign_keys(plain, [path for path, _ in model.named_modules() if path],
                         _output_structures(_scratch_copy(model), tuple(example_inputs),
                                            example_kwargs))
            _drop_kept_outputs(plain)
    finally:
        before.restore()
    torch_compat.set_graph_tracer_cls(plain.graph, None)  # torch.export's tracer cannot re-trace a pickled copy
    gm = DebugGraphModule(plain, plain.graph, class_name=name)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(plain, attr):
            setattr(gm, attr, getattr(plain, attr))
    gm.recompile()
    gm.training = model.training
    gm.meta["fxdebug_frontend"] = "export"
    gm.meta["fxdebug_auto_leaves"] = []
    return gm

