"""Standalone dumps: a folder that runs where torch is installed and fxdebug is not.

An instrumented module's code calls fxdebug's runtime (capture, gradient and
breakpoint nodes), so its dump imports ``fxdebug``. ``dump(..., standalone=True)``
(``fxdebug dump --standalone``) dumps a copy without them::

    standalone_copy(gm)                   the user's gm is left as it is
      ├─ copy the graph, share the submodules and weights
      ├─ drop the nodes that only observe: begin_run, capture, capture_stats,
      │  record_grads, stop (breakpoints); own_value's users read its input again
      ├─ traced_message(template, names, values) -> 'template'.format(*values)
      │  (a torch._assert message filled with the run's values, in plain Python)
      └─ anything else of fxdebug's (a gradient edit, a checkpoint, an eager region)
         changes what the module computes: FxdebugError naming the node and its pass

Outputs and parameter gradients are those of ``gm``: the dropped nodes change no value.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, cast

import torch
import torch.fx as fx

from ..errors import FxdebugError
from .. import runtime
from ..runtime import PROXY_IN_TEXT
from ..tracing.graph_module import MODES_META
from ..tracing.keys import META_PASS, META_SOURCE, inherit_key, node_key
from ..base.formatting import format_location

__all__ = ["standalone_copy", "fxdebug_nodes"]

# Nodes that only observe (they return None and change no value) and pass-through views.
_OBSERVERS = (runtime.begin_run, runtime.capture, runtime.capture_stats, runtime.record_grads,
              runtime.stop)
_PASS_THROUGH = (runtime.own_value,)


def _is_fxdebug(obj) -> bool:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module == "fxdebug" or module.startswith("fxdebug.")


def fxdebug_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that call a function or a module of fxdebug (what makes a dump import it).

    >>> import torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    >>> [node.name for node in fxdebug_nodes(gm)]
    ['begin_run', 'capture_0']
    >>> fxdebug_nodes(standalone_copy(gm))
    []
    """
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_fxdebug(node.target):
            found.append(node)
        elif node.op == "call_module" and _is_fxdebug(gm.get_submodule(node.target)):
            found.append(node)
    return found


def _format_call(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``'... got {}!'.format(getitem_2)`` for ``traced_message('... got Proxy(getitem_2)!', ...)``."""
    # traced_message's arguments: the text, the names of its values, the values
    template, names, values = cast(tuple[str, Sequence[str], Sequence[Any]], node.args)
    by_name = dict(zip(names, values))
    ordered = []

    def field(match):
        if match.group(1) not in by_name:
            return match.group(0)
        ordered.append(by_name[match.group(1)])
        return "{}"

    text = PROXY_IN_TEXT.sub(field, template.replace("{", "{{").replace("}", "}}"))
    with graph.inserting_before(node):
        return inherit_key(graph.call_method("format", (text, *ordered)), node)


def _refuse(gm: fx.GraphModule, node: fx.Node) -> FxdebugError:
    target = node.target if node.op == "call_function" else type(gm.get_submodule(str(node.target)))
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"
    where = [format_location(node.meta[META_SOURCE])] if node.meta.get(META_SOURCE) else []
    where += [f"inserted by pass {node.meta[META_PASS]}"] if node.meta.get(META_PASS) else []
    return FxdebugError(
        f"cannot dump {type(gm).__name__} standalone: node {node_key(node)!r} "
        f"({', '.join(where) or 'no source line'}) calls {name}, which changes "
        f"what the module computes (a gradient edit, a checkpoint, code run eagerly), and a "
        f"folder without fxdebug cannot run it. Dump without standalone=True (the folder then "
        f"imports fxdebug: install fxdebug where it runs), or dump the module before that pass.")


def standalone_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` without fxdebug's observing nodes, sharing its submodules and weights.

    >>> import torch, fxdebug
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> gm = fxdebug.instrument(model, grads=True)
    >>> plain = standalone_copy(gm)
    >>> "fxdebug" in plain.code, hasattr(plain, "fxdebug_recorder"), "fxdebug" in gm.code
    (False, False, True)
    >>> x = torch.randn(3, 2)
    >>> torch.equal(plain(x), model(x))
    True
    """
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is runtime.traced_message:
            node.replace_all_uses_with(_format_call(graph, node))
            graph.erase_node(node)
        elif node.target in _PASS_THROUGH:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _OBSERVERS and not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):  # the recorder and other attributes nothing reads now
        if node.op == "get_attr" and not node.users and _is_fxdebug(_attribute(gm, node.target)):
            graph.erase_node(node)
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copied.training = gm.training
    copied.meta.update({key: value for key, value in getattr(gm, "meta", {}).items()
                        if key != MODES_META})  # a copy in one mode: it follows none
    for attr in ("_in_spec", "_out_spec"):  # pytree inputs and outputs
        if getattr(gm, attr, None) is not None:
            setattr(copied, attr, getattr(gm, attr))
    remaining = fxdebug_nodes(copied)
    if remaining:
        raise _refuse(copied, remaining[0])
    return copied


def _attribute(gm: torch.nn.Module, target: str):
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
