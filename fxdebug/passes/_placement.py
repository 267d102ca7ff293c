"""Where recording passes put their nodes: one recorder ``get_attr`` and ``begin_run``, then a node per target."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import runtime
from ..runtime import RECORDER_ATTR, map_leaves
from ..tracing.keys import META_KEY, META_PASS, META_SOURCE

__all__ = ["ensure_recorder", "insert_per_target", "own_inputs"]

# Nodes that take the caller's inputs as they are: they read no gradient.
_READS_INPUTS = ("begin_run", "begin_part")


def ensure_recorder(gm: fx.GraphModule, pass_name: str) -> fx.Node:
    """Return the ``get_attr`` node of the recorder, adding it and ``begin_run`` if missing."""
    graph = gm.graph
    for node in graph.nodes:
        if node.op == "get_attr" and node.target == RECORDER_ATTR:
            return node
    if not isinstance(getattr(gm, RECORDER_ATTR, None), runtime.Recorder):
        gm.add_submodule(RECORDER_ATTR, runtime.Recorder())
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        context = graph.inserting_before(next(iter(graph.nodes)))
    else:
        context = graph.inserting_after(anchor)
    with context:
        recorder = graph.create_node("get_attr", RECORDER_ATTR, name=RECORDER_ATTR)
    with graph.inserting_after(recorder):
        begin = graph.create_node("call_function", runtime.begin_run,
                                  (recorder, tuple(placeholders)), {}, name="begin_run")
    for node, key in ((recorder, RECORDER_ATTR), (begin, "begin_run")):
        node.meta[META_KEY] = key
        node.meta[META_PASS] = pass_name
    return recorder


def insert_per_target(gm: fx.GraphModule, recorder: fx.Node, targets, pass_name: str,
                      name_prefix: str, key_suffix: str, call, after=()) -> None:
    """Insert ``fn(recorder, value, key, op, **kwargs)`` after each target, ``call(target) -> (fn, kwargs)``.

    A node goes right after the node its target's value is complete at (inputs:
    after ``begin_run``); several nodes at one spot keep the targets' order, and
    go after nodes of fxdebug's own that call one of the functions in ``after``.
    """
    graph = gm.graph
    start = recorder.next  # begin_run
    last_inserted: dict[fx.Node, fx.Node] = {}
    for target in targets:
        place = start if target.anchor.op == "placeholder" else target.anchor
        anchor = last_inserted.get(place, place)
        while (anchor.next.op == "call_function" and anchor.next.meta.get(META_PASS)
               and anchor.next.target in after):
            anchor = anchor.next
        fn, kwargs = call(target)
        with graph.inserting_after(anchor):
            node = graph.create_node("call_function", fn,
                                     (recorder, target.value, target.key, target.op), kwargs,
                                     name=f"{name_prefix}_{target.key}")
        node.meta[META_KEY] = f"{target.key}:{key_suffix}"
        node.meta[META_PASS] = pass_name
        node.meta[META_SOURCE] = target.source
        last_inserted[place] = node


def own_inputs(gm: fx.GraphModule, targets, pass_name: str) -> list:
    """Route every use of the graph's inputs through ``own_value`` (once); return ``targets`` re-pointed.

    A gradient hook on a tensor the caller passed in would outlive the run
    (and fire in the caller's own backward); hooks go on the view
    ``own_value`` makes in each forward instead. ``begin_run`` keeps the
    inputs themselves.
    """
    graph = gm.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    owned: dict[fx.Node, fx.Node] = {}
    for placeholder in placeholders:
        existing = [user for user in placeholder.users
                    if user.op == "call_function" and user.target is runtime.own_value]
        if existing:
            owned[placeholder] = existing[0]
            continue
        with graph.inserting_after(placeholders[-1]):
            own = graph.create_node("call_function", runtime.own_value, (placeholder,), {},
                                    name=f"{placeholder.name}_own")
        own.meta[META_KEY] = f"{placeholder.meta.get(META_KEY, placeholder.name)}:own"
        own.meta[META_PASS] = pass_name
        placeholder.replace_all_uses_with(
            own, delete_user_cb=lambda user, own=own: user is not own and not (
                user.op == "call_function" and getattr(user.target, "__name__", "") in _READS_INPUTS))
        owned[placeholder] = own

    def repoint(node: fx.Node) -> fx.Node:
        return owned.get(node, node)

    return [dataclasses.replace(target, value=map_leaves(repoint, target.value, _is_node))
            for target in targets]


def _is_node(value) -> bool:
    return isinstance(value, fx.Node)
