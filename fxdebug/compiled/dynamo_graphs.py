"""Keys and source lines for the graphs ``torch.compile`` captures, as fxdebug gives traced graphs.

Dynamo inlines every module call into plain torch calls, but it records where
each node came from: ``node.meta["nn_module_stack"]`` (the module calls the
node lies in, ``{call id: ("L['self'].layer1[0].conv1", Conv2d)}``, a repeated
call's id ending in ``@1``), ``"source_fn_stack"`` (for a module's own op, the
module class) and ``"stack_trace"`` (the Python stack). :func:`key_dynamo_graph`
turns them into fxdebug's node meta:

* ``fxdebug_key``: the module path for a module whose call is one op
  (``layer1.0.conv1``; its second call ``layer1.0.conv1_1``), else the
  enclosing module path and the op (``layer1.0.add``, ``flatten``); lifted
  parameters by their names (``layer1.0.conv1.weight``), inputs by theirs;
* ``fxdebug_source``: the innermost user ``(file, line)`` of the stack trace;
* ``fxdebug_returns``: each module call's output, so ``Capture("modules")``
  captures module outputs the way forward hooks see them. A call whose
  result cannot be told apart (more than one value leaves it) is left out,
  never guessed.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from ..tracing.keys import (META_KEY, META_MODULE, META_RETURNS, META_SOURCE, KeyAllocator, ModuleReturn, short_name)
from ..tracing.locations import is_user_file

__all__ = ["key_dynamo_graph", "dynamo_module_path", "stack_location"]

_GETATTR = re.compile(r"getattr\(([^()]*?),\s*['\"]([^'\"]+)['\"]\)")
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_ITEM = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LIFTED = re.compile(r"^[lg]_[a-z0-9]*?_((?:modules_.+?_)*?)(parameters|buffers)_(.+)_$",
                     re.IGNORECASE)


def dynamo_module_path(text: str) -> str:
    """The module path of a dynamo source string.

    >>> dynamo_module_path("L['self'].layer1[0].conv1")
    'layer1.0.conv1'
    >>> dynamo_module_path("getattr(L['self'].features, '3')._modules['fc']")
    'features.3.fc'
    >>> dynamo_module_path("L['self']")
    ''
    """
    path = text
    while True:
        found = _GETATTR.search(path)
        if found is None:
            break
        path = f"{path[:found.start()]}{found.group(1)}.{found.group(2)}{path[found.end():]}"
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _ITEM.sub(r".\1", path)
    parts = path.split(".")
    if parts and parts[0] in ("L", "G"):
        parts = parts[2:]  # L['self'] -> "L", "self"
    elif parts:
        parts = parts[1:]  # self.layer1
    return ".".join(parts)


def stack_location(stack_trace: str | None) -> tuple[str, int] | None:
    """The innermost user ``(file, line)`` of a dynamo ``stack_trace``.

    >>> stack_location('  File "/m/model.py", line 7, in forward\\n    return x + 1\\n')
    ('/m/model.py', 7)
    """
    found = None
    for filename, line in _FRAME.findall(stack_trace or ""):
        if is_user_file(filename):
            found = (filename, int(line))
    return found


def _placeholder_key(node: fx.Node) -> str:
    name = str(node.target)
    lifted = _LIFTED.match(name)
    if lifted:
        modules = [part for part in lifted.group(1).split("modules_") if part]
        path = [part[:-1] if part.endswith("_") else part for part in modules]
        return ".".join(path + [lifted.group(3)])
    if name[:2] in ("L_", "l_", "G_", "g_") and name.endswith("_"):
        return name[2:-1]
    return name


def _calls(node: fx.Node) -> list[tuple[str, str, type]]:
    """``[(call id, module path, module class), ...]`` outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(call, dynamo_module_path(entry[0]), entry[1]) for call, entry in stack.items()]


def key_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Write fxdebug's keys, source lines and module returns into a dynamo graph's meta.

    Returns ``gm`` (edited in place: only ``node.meta``).

    >>> import torch
    >>> graphs = []
    >>> def keep(gm, example_inputs):
    ...     graphs.append(gm)
    ...     return gm.forward
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> _ = torch.compile(model, backend=keep)(torch.ones(1, 2))
    >>> [n.meta["fxdebug_key"] for n in key_dynamo_graph(graphs[0]).graph.nodes][-3:]
    ['0', '1', 'output']
    """
    nodes = [node for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    members: dict[str, list[fx.Node]] = {}
    call_info: dict[str, tuple[str, type]] = {}
    for node in nodes:
        for call, path, cls in _calls(node):
            members.setdefault(call, []).append(node)
            call_info.setdefault(call, (path, cls))
    keys = KeyAllocator(owned=[path for path, _ in call_info.values()])
    call_keys = {call: keys.allocate(path, owner=True) for call, (path, _) in call_info.items()
                 if path}
    for node in gm.graph.nodes:
        node.meta[META_SOURCE] = stack_location(node.meta.get("stack_trace"))
        if node.op == "placeholder":
            node.meta[META_KEY] = keys.allocate(_placeholder_key(node))
            continue
        if node.op == "output":
            node.meta[META_KEY] = keys.allocate("output")
            continue
        calls = _calls(node)
        scope = calls[-1][1] if calls else ""
        node.meta[META_MODULE] = scope
        if calls and scope and len(members[calls[-1][0]]) == 1 and _own_op(node, calls[-1][2]):
            node.meta[META_KEY] = call_keys[calls[-1][0]]  # the module's one op: its path
            continue
        name = short_name(node.op, node.target)
        node.meta[META_KEY] = keys.allocate(f"{scope}.{name}" if scope else name)
    _mark_module_returns(gm, members, call_info, call_keys)
    return gm


def _own_op(node: fx.Node, cls: type) -> bool:
    """Whether ``node`` is what a leaf module (``Linear``, ``ReLU``) computes, as fx keeps it.

    torch 2.14 names the module class in ``source_fn_stack``; torch 2.9 names
    the function it calls (``F.relu``), so a module of ``torch.nn`` (not a
    container) whose call is this one op counts too.
    """
    own_op = node.meta.get("source_fn_stack") or []
    if not own_op:
        return False
    if isinstance(own_op[-1][1], type):
        return True
    return (isinstance(cls, type) and cls.__module__.startswith("torch.nn.")
            and not issubclass(cls, (torch.nn.Sequential, torch.nn.ModuleList,
                                     torch.nn.ModuleDict)))


def _mark_module_returns(gm, members, call_info, call_keys) -> None:
    for call, inside in reversed(list(members.items())):  # inner calls first, as hooks fire
        key = call_keys.get(call)
        if key is None:
            continue
        inside_set = dict.fromkeys(inside)
        leaving = [node for node in inside
                   if any(user not in inside_set for user in node.users)]
        if len(leaving) != 1 or leaving[0] is not inside[-1]:
            continue  # several values leave the call, or not its last: its output is unknown
        last = inside[-1]
        returns = list(last.meta.get(META_RETURNS, ()))
        returns.append(ModuleReturn(key, call_info[call][1].__name__, (("", last.name),),
                                    last.meta.get(META_SOURCE)))
        last.meta[META_RETURNS] = returns
