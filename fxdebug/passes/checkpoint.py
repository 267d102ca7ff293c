"""Checkpoint: recompute selected module calls in backward instead of keeping their activations.

Seed 002 by hand::

    out = torch.utils.checkpoint.checkpoint(create_custom_forward(layer), hidden, mask,
                                            use_reentrant=False, preserve_rng_state=True)

As a pass, ``Checkpoint(include=["layer1", "layer2"])`` on resnet18 replaces the
nodes of each selected call by one call::

    fxdebug_checkpoint_layer1 = self.fxdebug_checkpoint_layer1
    layer1 = self.layer1
    checkpoint_layer1 = fxdebug_passes_checkpoint_checkpointed(
        fxdebug_checkpoint_layer1, layer1, maxpool, preserve_rng_state = True)

The segment (``gm.fxdebug_checkpoint_layer1.body``, a GraphModule running the
children of ``layer1``) runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``: its activations are dropped after the forward and
recomputed in backward. With ``preserve_rng_state=True`` the recomputation
draws the same dropout masks, so outputs and gradients equal the original's.
BatchNorm running statistics are restored after the recomputation, so they too
end as without checkpointing (plain ``checkpoint`` updates them twice).

A selected call is skipped, with a warning and an entry in ``pass.skipped``,
when recomputing it would not give the same values: it writes in place to its
inputs (run :class:`~fxdebug.passes.Functionalize` first), a later node writes
in place to one of its inputs, or it holds nodes another pass inserted
(run ``Checkpoint`` before ``Capture``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import warnings

import torch
import torch.fx as fx
import torch.utils.checkpoint

from .aliasing import AliasAnalysis
from ..errors import FidelityWarning, SelectionError
from ..tracing.graph_module import DebugGraphModule
from ..tracing.keys import (META_KEY, META_PASS, META_RETURNS, META_SOURCE, ModuleReturn,
                            inherit_key, node_key, op_name)
from ..tracing.locations import caller_stacklevel, short_list
from ..base.formatting import format_location
from ..runtime import emit_if_tracing
from ..tracing.selection import close_keys_hint, key_depth, matches
from .base import Pass

__all__ = ["Checkpoint", "CheckpointSegment", "checkpointed"]

_NOT_IDENTIFIER = re.compile(r"[^0-9a-zA-Z_]")


class _RestoreBuffers:
    """Context of the recomputation: buffers (BatchNorm statistics) end as they began."""

    def __init__(self, buffers):
        self.buffers = buffers
        self.saved = []

    def __enter__(self):
        with torch.no_grad():
            self.saved = [buffer.detach().clone() for buffer in self.buffers]
        return self

    def __exit__(self, *exc_info):
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.saved):
                buffer.copy_(saved)
        self.saved = []
        return False


class CheckpointSegment(torch.nn.Module):
    """One checkpointed segment: ``body`` is a GraphModule of the segment's nodes.

    It holds no modules of its own: the graph passes the segment's module
    (``self.layer1``) to each call, and ``body`` runs that module's children.
    So ``parameters()`` and ``state_dict()`` of the checkpointed GraphModule
    list every parameter once, under its usual name, also after
    ``torch.save``/``torch.load`` and ``deepcopy``.

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
    >>> gm = fxdebug.passes.Checkpoint(include=["0"])(fxdebug.trace(net)).graph_module
    >>> gm.fxdebug_checkpoint_0
    CheckpointSegment(key='0', module='0')
    >>> list(dict(gm.named_parameters()))
    ['0.0.weight', '0.0.bias']
    """

    def __init__(self, graph: fx.Graph, key: str, path: str, module: torch.nn.Module) -> None:
        super().__init__()
        self.key = key
        self.path = path
        self.__dict__["_module"] = None  # plain attributes: never registered as submodules
        self.__dict__["body"] = None
        self.__dict__["_graph"] = graph
        self.bind(module)

    def bind(self, module: torch.nn.Module) -> fx.GraphModule:
        """The body, running the children of ``module`` (rebuilt when ``module`` is another one)."""
        if self.__dict__["_module"] is not module:
            root = torch.nn.Module()
            *parents, last = self.path.split(".")
            holder = root
            for name in parents:
                holder.add_module(name, torch.nn.Module())
                holder = getattr(holder, name)
            holder.add_module(last, module)
            safe = _NOT_IDENTIFIER.sub("_", self.key)
            self.__dict__["body"] = DebugGraphModule(root, self.__dict__["_graph"],
                                                     class_name=f"Checkpointed_{safe}")
            self.__dict__["_module"] = module
        return self.__dict__["body"]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_graph"] = state["body"].graph if state["body"] is not None else state["_graph"]
        return state

    def forward(self, module: torch.nn.Module, *args):
        return self.bind(module)(*args)

    def recompute_contexts(self):
        """``context_fn`` for checkpoint: nothing around the forward; buffers restored after
        the recomputation."""
        return contextlib.nullcontext(), _RestoreBuffers(list(self.__dict__["_module"].buffers()))

    def extra_repr(self) -> str:
        return f"key={self.key!r}, module={self.path!r}"


def checkpointed(segment: CheckpointSegment, module: torch.nn.Module, *args,
                 preserve_rng_state: bool = True):
    """Run ``segment(module, *args)`` under ``checkpoint(..., use_reentrant=False)``.

    The function the Checkpoint pass's nodes call; called with fx Proxies
    (re-tracing) it emits itself again.
    """
    emitted = emit_if_tracing(checkpointed, (segment, module) + args,
                               {"preserve_rng_state": preserve_rng_state})
    if emitted is not None:
        return emitted
    segment.bind(module)
    return torch.utils.checkpoint.checkpoint(segment, module, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state,
                                             context_fn=segment.recompute_contexts)


@dataclasses.dataclass
class _Segment:
    key: str
    module_type: str
    nodes: list
    source: tuple | None
    leaf: bool
    path: str  # the module whose call this is


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A selected call :class:`Checkpoint` left as it is, and why."""

    key: str
    op: str
    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key} ({self.op}, {self.location}): {self.reason}"


def _module_path(key: str, anchor: fx.Node) -> str:
    """The module path behind a module-call key (``block_1`` is the second call of ``block``)."""
    anchor_key = node_key(anchor)
    if anchor_key == key or anchor_key.startswith(key + "."):
        return key
    stripped = re.sub(r"_\d+$", "", key)
    return stripped


def _segments(gm: fx.GraphModule) -> list[_Segment]:
    """Every module call of the graph as a contiguous run of nodes, in graph order."""
    nodes = list(gm.graph.nodes)
    found: list[_Segment] = []
    for index, node in enumerate(nodes):
        if node.op == "call_module" and META_PASS not in node.meta:
            found.append(_Segment(node_key(node), op_name(node, gm), [node],
                                  node.meta.get(META_SOURCE), True, str(node.target)))
        for ret in node.meta.get(META_RETURNS, ()):
            path = _module_path(ret.key, node)
            run = []
            for position in range(index, -1, -1):
                current = nodes[position]
                key = node_key(current)
                inside = key == path or key.startswith(path + ".")
                earlier_call = current is not node and any(
                    other.key != ret.key and _module_path(other.key, current) == path
                    for other in current.meta.get(META_RETURNS, ()))
                if not inside or earlier_call or current.op in ("placeholder", "output"):
                    break
                run.append(current)
            if run:
                found.append(_Segment(ret.key, ret.module_type, run[::-1], ret.source, False,
                                      path))
    return found


def _as_patterns(name: str, value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    try:
        patterns = list(value)
    except TypeError:
        raise SelectionError(f"Checkpoint {name}= must be a key, a glob or a list of them, "
                             f"got {value!r}.") from None
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise SelectionError(f"Checkpoint {name}= entries must be keys or globs (str), "
                                 f"got {pattern!r}.")
    return patterns


class Checkpoint(Pass):
    """Wrap selected module calls in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    Args:
        include: keys or globs of module calls (``"layer1"``, ``"layer*"``,
            ``"encoder.layers.*"``); a pattern selects the outermost calls it
            matches. ``None`` (default): every top-level container call
            (resnet's ``layer1`` ... ``layer4``).
        exclude: keys or globs of calls to keep out; a call containing one
            is not checkpointed as a whole (its other parts still can be).
        preserve_rng_state: restore the RNG state for the recomputation, so
            dropout draws the same masks (seed 002). ``False`` is faster when
            the segments draw no random numbers.

    Attributes (after running):
        segments: keys of the checkpointed calls, in graph order.
        skipped: :class:`Skipped` records, also given in a warning.

    Example::

        >>> import torch, fxdebug
        >>> net = torch.nn.Sequential(
        ...     torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)),
        ...     torch.nn.Linear(4, 1)).train()
        >>> gm = fxdebug.trace(net)
        >>> step = fxdebug.passes.Checkpoint(include=["0"])
        >>> _ = step(gm); step.segments
        ['0']
        >>> x = torch.randn(8, 4)
        >>> _ = torch.manual_seed(0); gm(x).sum().backward()
        >>> grad = net[0][0].weight.grad.clone(); net.zero_grad()
        >>> _ = torch.manual_seed(0); net(x).sum().backward()
        >>> torch.equal(grad, net[0][0].weight.grad)
        True
    """

    name = "checkpoint"

    def __init__(self, include=None, exclude=None, preserve_rng_state: bool = True) -> None:
        self.include = _as_patterns("include", include)
        self.exclude = _as_patterns("exclude", exclude)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.segments: list[str] = []
        self.skipped: list[Skipped] = []

    # -- selection ---------------------------------------------------------------------------
    def _select(self, gm: fx.GraphModule) -> list[_Segment]:
        every = _segments(gm)
        keys = list(dict.fromkeys(segment.key for segment in every))
        for kind, patterns in (("include", self.include), ("exclude", self.exclude)):
            for pattern in patterns:
                if not any(matches(key, pattern) for key in keys):
                    hint = close_keys_hint(pattern, keys)
                    raise SelectionError(
                        f"Checkpoint {kind} pattern {pattern!r} matches no module call.{hint} "
                        f"fxdebug.print_tabular(fxdebug.trace(model)) lists the keys; module "
                        f"paths like 'layer1' and globs like 'layer*' work.")
        if self.include:
            chosen = [s for s in every if any(matches(s.key, p) for p in self.include)]
        else:
            chosen = [s for s in every if key_depth(s.key) == 0 and not s.leaf] or \
                     [s for s in every if key_depth(s.key) == 0]
        if self.exclude:
            def excluded(segment):
                return any(matches(node_key(node), p) or matches(segment.key, p)
                           for node in segment.nodes for p in self.exclude)
            chosen = [s for s in chosen if not excluded(s)]
        position = {node: index for index, node in enumerate(gm.graph.nodes)}
        chosen.sort(key=lambda s: (position[s.nodes[0]], -len(s.nodes)))
        picked: list[_Segment] = []
        taken: set = set()
        for segment in chosen:
            if any(node in taken for node in segment.nodes):
                continue
            picked.append(segment)
            taken.update(segment.nodes)
        return picked

    # -- checks ------------------------------------------------------------------------------
    def _why_not(self, gm, segment, aliases, position) -> str | None:
        inside = set(segment.nodes)
        inserted = [node for node in segment.nodes if META_PASS in node.meta]
        if inserted:
            passes = ", ".join(dict.fromkeys(str(node.meta[META_PASS]) for node in inserted))
            return (f"it holds {len(inserted)} node(s) inserted by pass {passes}, which "
                    f"recomputation would run twice; run Checkpoint before that pass.")
        inputs = _external_inputs(segment.nodes, inside)
        start = position[segment.nodes[0]]
        shared: dict[fx.Node, fx.Node] = {}
        for value in inputs:
            for member in aliases.members(value):
                shared.setdefault(member, value)
        for writer, written in aliases.writes():
            if position[writer] >= start and written in shared:
                where = "it writes" if writer in inside else f"{node_key(writer)!r} writes"
                return (f"{where} in place to its input {node_key(shared[written])!r} "
                        f"({op_name(writer, gm)}, "
                        f"{format_location(writer.meta.get(META_SOURCE))}), so the recomputation "
                        f"in backward would not see the same input; run "
                        f"fxdebug.passes.Functionalize() first.")
        for node in segment.nodes:
            if node.op == "call_module" and not (node.target == segment.path or
                                                 node.target.startswith(segment.path + ".")):
                return (f"it calls {node.target!r}, a module registered outside "
                        f"{segment.path!r}; checkpoint the calls around it instead.")
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
                    return (f"{node_key(node)!r} (Embedding(max_norm=...)) renormalises its "
                            f"weight in place, which recomputation would do again.")
        if all(node.op == "get_attr" for node in segment.nodes):
            return "it only reads parameters."
        if not _external_outputs(segment.nodes, inside):
            return "nothing outside it uses its result."
        return None

    # -- the rewrite -------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule) -> bool:
        self.segments = []
        self.skipped = []
        picked = self._select(gm)
        aliases = AliasAnalysis(gm)
        position = {node: index for index, node in enumerate(gm.graph.nodes)}
        ready = []
        for segment in picked:
            reason = self._why_not(gm, segment, aliases, position)
            if reason is None:
                ready.append(segment)
            else:
                self.skipped.append(Skipped(segment.key, segment.module_type,
                                            format_location(segment.source), reason))
        for segment in ready:
            self._wrap(gm, segment)
            self.segments.append(segment.key)
        if self.skipped:
            listed = short_list([str(item) for item in self.skipped], limit=1)
            warnings.warn(f"Checkpoint left {len(self.skipped)} selected call(s) as they are: "
                          f"{listed} (step.skipped lists them)", FidelityWarning,
                          stacklevel=caller_stacklevel())
        return bool(ready)

    def _wrap(self, gm: fx.GraphModule, segment: _Segment) -> None:
        graph = gm.graph
        nodes = [node for node in segment.nodes if node.op != "get_attr"]
        first = nodes[0]
        for node in segment.nodes:  # parameters go in as arguments: no stale copies in the body
            if node.op == "get_attr":
                first.prepend(node)
        inside = set(nodes)
        inputs = _external_inputs(nodes, inside)
        outputs = _external_outputs(nodes, inside)

        body_graph = fx.Graph()
        copies: dict[fx.Node, fx.Node] = {}
        for value in inputs:
            placeholder = body_graph.placeholder(value.name)
            placeholder.meta.update({k: v for k, v in value.meta.items()
                                     if k in (META_KEY, META_SOURCE)})
            copies[value] = placeholder
        for node in nodes:
            copies[node] = body_graph.node_copy(node, copies.__getitem__)
        result = copies[outputs[0]] if len(outputs) == 1 else tuple(copies[o] for o in outputs)
        body_graph.output(result)
        safe = _NOT_IDENTIFIER.sub("_", segment.key)
        attribute, index = f"fxdebug_checkpoint_{safe}", 0
        while hasattr(gm, attribute):
            index += 1
            attribute = f"fxdebug_checkpoint_{safe}_{index}"
        module = gm.get_submodule(segment.path)
        segment_module = CheckpointSegment(body_graph, segment.key, segment.path, module)
        gm.add_submodule(attribute, segment_module)

        with graph.inserting_before(first):
            holder = graph.get_attr(attribute)
            owner = graph.get_attr(segment.path)
            call = graph.create_node("call_function", checkpointed, (holder, owner, *inputs),
                                     {"preserve_rng_state": self.preserve_rng_state},
                                     name=f"checkpoint_{safe}")
        owner.meta.update({META_KEY: f"{segment.key}:module", META_PASS: self.name,
                           META_SOURCE: segment.source})
        holder.meta.update({META_KEY: f"{segment.key}:checkpoint", META_PASS: self.name,
                            META_SOURCE: segment.source})
        results = [call]
        if len(outputs) > 1:
            call.meta.update({META_KEY: f"{segment.key}:checkpoint", META_PASS: self.name,
                              META_SOURCE: segment.source})
            results = []
            anchor = call
            for index, output in enumerate(outputs):
                with graph.inserting_after(anchor):
                    item = graph.call_function(operator.getitem, (call, index))
                inherit_key(item, output)
                results.append(item)
                anchor = item
        else:
            inherit_key(call, outputs[0])
        call.meta["fxdebug_checkpoint"] = segment.key
        renames = {output.name: result.name for output, result in zip(outputs, results)}
        returns = _carried_returns(nodes, renames)
        if segment.leaf:
            returns.insert(0, ModuleReturn(segment.key, segment.module_type,
                                           (("", results[0].name),), segment.source))
        if returns:
            results[-1].meta[META_RETURNS] = returns + list(results[-1].meta.get(META_RETURNS, ()))
        for output, result in zip(outputs, results):
            output.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
        for node in reversed(nodes):
            graph.erase_node(node)


def _external_inputs(nodes, inside) -> list[fx.Node]:
    found: dict[fx.Node, None] = {}
    for node in nodes:
        for value in node.all_input_nodes:
            if value not in inside:
                found.setdefault(value, None)
    return list(found)


def _external_outputs(nodes, inside) -> list[fx.Node]:
    return [node for node in nodes if any(user not in inside for user in node.users)]


def _carried_returns(nodes, renames: dict[str, str]) -> list:
    """Module-output records of the segment whose values all leave it, renamed to the results."""
    carried = []
    for node in nodes:
        for ret in node.meta.get(META_RETURNS, ()):
            if all(name in renames for _, name in ret.items):
                carried.append(type(ret)(ret.key, ret.module_type,
                                         tuple((sub, renames[name]) for sub, name in ret.items),
                                         ret.source))
    return carried
