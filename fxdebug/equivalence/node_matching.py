"""Which candidate node computes the value of each reference node.

Used by :func:`fxdebug.check_equivalence` to compare two graphs node by node.
Three rules, tried in this order, never a guess by name similarity:

1. **key**: both nodes carry the same ``fxdebug_key`` (a pass that keeps a
   node, or replaces it and calls :func:`fxdebug.passes.inherit_key`);
2. **inputs**: both are unmatched and read exactly the same (matched) inputs in
   the same argument slots, and no other unmatched node does (a plain
   ``torch.fx`` candidate's ``layer1.0.add`` for fxdebug's ``layer1.0.iadd``);
3. **position**: both are unmatched and a matched pair of users reads them in
   the same argument slot (a node a pass replaced without carrying its key).

A module call whose module the candidate changed (other parameters or buffers
than the reference's module at the same path: a conv with a batch norm folded
into its weights) computes another value under the same key, so it is never
paired by key or by inputs, only by position: the fused ``conv1`` is compared
with the reference's ``bn1``, whose value its users now read. A key given with
:func:`fxdebug.passes.inherit_key` is always trusted.

Besides its counterpart, a reference node can be *seen as* another candidate
node by its users: a node a pass inserted in between (``conv1 -> mul -> bn1``),
or, for a reference node the pass removed, whatever node its users read now.
Those are only recorded where the user is the same operation in both graphs,
so a fused node (conv+bn -> conv) is not compared against the conv's input,
and only where what the user reads is a node only the candidate has, or the
counterpart of what the removed node read (its users read its input now).

A user that is the same operation in both graphs but reads, in some argument
slot, the counterpart of *another* reference node than the one its reference
node reads there had its arguments rewired by the pass (:class:`Rewire`): a
skip connection moved to a fused node's output, operands swapped. Such a
user is compared itself, and the rewiring is said on its row.

A match by inputs or by position is a claim that the candidate node computes
the reference node's value. :func:`refuted_matches` withdraws the claim where
the values show the candidate node computes another reference node's value
(a fused Linear+ReLU read in the ReLU's place reads the Linear's inputs too);
matching again with those pairs ``refuted`` pairs it with that node instead.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
import torch.fx as fx

from ..runtime import leaves
from ..tracing.keys import META_PASS, META_PROVENANCE, node_key, op_name

__all__ = ["Match", "NodeMatching", "Rewire", "match_nodes", "module_changed", "value_nodes",
           "arg_slots", "arguments_text", "refuted_matches"]

VALUE_OPS = ("placeholder", "call_function", "call_method", "call_module", "get_attr")


@dataclasses.dataclass(frozen=True)
class Match:
    """The candidate node matched to a reference node, and the rule that matched it."""

    candidate: fx.Node
    how: str  # "key", "inputs" or "position"


@dataclasses.dataclass(frozen=True)
class Rewire:
    """One argument slot of a matched user that reads another reference node's counterpart.

    ``reference`` is what the reference user reads in ``slot``; ``candidate``
    what the candidate user reads there, the counterpart of ``stands_for``
    (another reference node).
    """

    slot: str
    reference: fx.Node
    candidate: fx.Node
    stands_for: fx.Node


@dataclasses.dataclass
class NodeMatching:
    """Result of :func:`match_nodes`; lists are in graph order."""

    counterpart: dict[fx.Node, Match]
    seen_as: dict[fx.Node, list[tuple[fx.Node, fx.Node]]]  # ref node -> [(cand node, ref user)]
    unmatched_reference: list[fx.Node]
    unmatched_candidate: list[fx.Node]
    changed_modules: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    # (reference node, candidate node): same key, but the candidate's module was changed
    rewired: dict[fx.Node, list[Rewire]] = dataclasses.field(default_factory=dict)
    # reference user -> the argument slots its counterpart reads another node's counterpart in


def value_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes that compute a value of the model (fxdebug's own inserted nodes left out)."""
    return [node for node in graph.nodes if node.op in VALUE_OPS and META_PASS not in node.meta]


def arg_slots(node: fx.Node) -> dict[str, fx.Node]:
    """Node inputs by argument slot: ``{"0": a, "1": b, "weight": w, "0/1": c}``.

    >>> import torch, operator
    >>> g = torch.fx.Graph(); a = g.placeholder("a"); b = g.placeholder("b")
    >>> s = g.call_function(operator.sub, (a, b))
    >>> {slot: n.name for slot, n in arg_slots(s).items()}
    {'0': 'a', '1': 'b'}
    """
    slots: dict[str, fx.Node] = {}
    named = [(str(index), arg) for index, arg in enumerate(node.args)] + list(node.kwargs.items())
    for label, arg in named:
        slots.update(leaves(arg, label, is_leaf=lambda value: isinstance(value, fx.Node)))
    return slots


def _same_op(ref: fx.Node, ref_root: torch.nn.Module, cand: fx.Node,
             cand_root: torch.nn.Module) -> bool:
    return ref.op == cand.op and op_name(ref, ref_root) == op_name(cand, cand_root)


def _module_state(root: torch.nn.Module, node: fx.Node) -> list[tuple[str, torch.Tensor]]:
    module = root.get_submodule(str(node.target))
    return list(module.named_parameters()) + list(module.named_buffers())


def module_changed(ref: fx.Node, ref_root: torch.nn.Module, cand: fx.Node,
                   cand_root: torch.nn.Module) -> bool:
    """Whether ``cand`` calls a module whose parameters or buffers differ from ``ref``'s module.

    Only for module calls paired by an implicit key (the same module path, no
    :func:`~fxdebug.passes.inherit_key`): a pass that folded a batch norm into a
    conv kept the conv's path but changed what it computes.

    >>> import copy, torch, fxdebug
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> ref, cand = fxdebug.trace(model), fxdebug.trace(copy.deepcopy(model))
    >>> ref_lin, cand_lin = [next(n for n in g.graph.nodes if n.op == "call_module")
    ...                      for g in (ref, cand)]
    >>> module_changed(ref_lin, ref, cand_lin, cand)        # a copy: the same weights
    False
    >>> with torch.no_grad():
    ...     _ = cand.get_submodule("0").bias.add_(1)          # a pass re-weights it
    >>> module_changed(ref_lin, ref, cand_lin, cand)
    True
    """
    if ref.op != "call_module" or cand.op != "call_module" or cand.meta.get(META_PROVENANCE):
        return False
    ref_state, cand_state = _module_state(ref_root, ref), _module_state(cand_root, cand)
    if [name for name, _ in ref_state] != [name for name, _ in cand_state]:
        return True
    for (_, a), (_, b) in zip(ref_state, cand_state):
        if a is b:
            continue
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return True
        try:
            if not torch.equal(a, b):
                return True
        except (RuntimeError, NotImplementedError):  # no values to compare (meta tensors)
            continue
    return False


def match_nodes(reference: fx.GraphModule, candidate: fx.GraphModule,
                refuted: Iterable[tuple[fx.Node, fx.Node]] = ()) -> NodeMatching:
    """Match the value nodes of ``candidate`` to those of ``reference`` (both keyed).

    ``refuted``: (reference node, candidate node) pairs never to match by
    inputs or position, nor to compare in each other's place (see
    :func:`refuted_matches`).

    >>> import torch, fxdebug
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> ref, cand = fxdebug.trace(model), fxdebug.trace(model)
    >>> m = match_nodes(ref, cand)
    >>> [(r.meta["fxdebug_key"], x.how) for r, x in m.counterpart.items()]
    [('input', 'key'), ('0', 'key'), ('1', 'key')]
    """
    matcher = _Matcher(reference, candidate, refuted)
    matcher.pair_by_key()
    matcher.pair_by_inputs()
    matcher.pair_by_position()
    matcher.pair_by_inputs()  # nodes whose inputs the position rule matched
    return matcher.result()


def _signature(slots: dict[str, fx.Node], translate: Callable[[fx.Node], fx.Node | None]
               ) -> tuple | None:
    """``(slot, translated input)`` of every argument slot; None if one has no translation."""
    items = []
    for label in sorted(slots):
        target = translate(slots[label])
        if target is None:
            return None
        items.append((label, target))
    return tuple(items) or None


class _Matcher:
    """The state of one :func:`match_nodes`: one method per rule, run in the module's order."""

    def __init__(self, reference: fx.GraphModule, candidate: fx.GraphModule,
                 refuted: Iterable[tuple[fx.Node, fx.Node]]) -> None:
        self.reference, self.candidate = reference, candidate
        self.ref_nodes = value_nodes(reference.graph)
        self.cand_nodes = value_nodes(candidate.graph)
        self.ref_set = dict.fromkeys(self.ref_nodes)
        self.cand_set = dict.fromkeys(self.cand_nodes)
        self.counterpart: dict[fx.Node, Match] = {}
        self.owner: dict[fx.Node, fx.Node] = {}  # candidate node -> its reference node
        self.refused = {pair_: None for pair_ in refuted}
        self.changed: list[tuple[fx.Node, fx.Node]] = []
        self.position_only: dict[fx.Node, None] = {}
        self.seen_as: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}

    def pair(self, ref: fx.Node, cand: fx.Node, how: str) -> None:
        self.counterpart[ref] = Match(cand, how)
        self.owner[cand] = ref

    def pair_by_key(self) -> None:
        """Rule 1: the same key, unless the candidate's module was changed (then position only)."""
        cand_by_key = {node_key(node): node for node in self.cand_nodes}
        for ref in self.ref_nodes:
            cand = cand_by_key.get(node_key(ref))
            if cand is not None and cand not in self.owner:
                if module_changed(ref, self.reference, cand, self.candidate):
                    self.changed.append((ref, cand))  # paired by position only, if at all
                else:
                    self.pair(ref, cand, "key")
        self.position_only = {node: None for pair_ in self.changed for node in pair_}

    def pair_by_inputs(self) -> None:
        """Rule 2: the one unmatched pair that reads the same matched inputs in the same slots."""
        counterpart = self.counterpart
        cand_sigs: dict[tuple, list[fx.Node]] = {}
        for cand in self.cand_nodes:
            if cand not in self.owner and cand not in self.position_only:
                sig = _signature(arg_slots(cand), lambda n: n if n in self.cand_set else None)
                if sig is not None:
                    cand_sigs.setdefault(sig, []).append(cand)
        ref_sigs: dict[tuple, list[fx.Node]] = {}
        for ref in self.ref_nodes:
            if ref not in counterpart and ref not in self.position_only:
                sig = _signature(arg_slots(ref), lambda n: counterpart[n].candidate
                                 if n in counterpart else None)
                if sig is not None:
                    ref_sigs.setdefault(sig, []).append(ref)
        for sig, refs in ref_sigs.items():
            cands = cand_sigs.get(sig, [])
            if len(refs) == 1 and len(cands) == 1 and (refs[0], cands[0]) not in self.refused:
                self.pair(refs[0], cands[0], "inputs")

    def pair_by_position(self) -> None:
        """Rule 3: what a matched pair of users reads in the same slot, users last to first;
        where both are matched elsewhere, what the user is seen to read instead (seen_as)."""
        for user in reversed(self.ref_nodes):
            match = self.counterpart.get(user)
            if match is None:
                continue
            same_user = _same_op(user, self.reference, match.candidate, self.candidate)
            cand_slots = arg_slots(match.candidate)
            for label, ref_arg in arg_slots(user).items():
                cand_arg = cand_slots.get(label)
                if (cand_arg is None or ref_arg not in self.ref_set or cand_arg not in self.cand_set
                        or (ref_arg, cand_arg) in self.refused):
                    continue
                existing = self.counterpart.get(ref_arg)
                if existing is not None and existing.candidate is cand_arg:
                    continue
                if existing is None and cand_arg not in self.owner:
                    self.pair(ref_arg, cand_arg, "position")
                elif same_user and (existing is None or cand_arg not in self.owner):
                    entries = self.seen_as.setdefault(ref_arg, [])
                    if all(cand is not cand_arg for cand, _ in entries):
                        entries.append((cand_arg, user))
                # else both are matched elsewhere: the user itself reads other values
                # (operands swapped), and its own comparison shows that (a Rewire, below).

    def read_through_removed(self, ref: fx.Node) -> dict[fx.Node, None]:
        """What a reference node reads, through nodes without a counterpart (removed too)."""
        found: dict[fx.Node, None] = {}
        todo = list(arg_slots(ref).values())
        while todo:
            arg = todo.pop()
            if arg in found or arg not in self.ref_set:
                continue
            found[arg] = None
            if arg not in self.counterpart:
                todo.extend(arg_slots(arg).values())
        return found

    def stands_in(self, ref: fx.Node, cand: fx.Node) -> bool:
        """Whether a user may read ``cand`` in place of ``ref``: a node only the candidate
        has, or the counterpart of what ``ref`` (removed) read."""
        other = self.owner.get(cand)
        return other is None or (ref not in self.counterpart
                                 and other in self.read_through_removed(ref))

    def rewired(self) -> dict[fx.Node, list[Rewire]]:
        """The slots of users, the same operation in both graphs, whose candidate reads another
        reference node's counterpart there."""
        rewired: dict[fx.Node, list[Rewire]] = {}
        for user in self.ref_nodes:
            match = self.counterpart.get(user)
            if match is None or not _same_op(user, self.reference, match.candidate, self.candidate):
                continue
            cand_slots = arg_slots(match.candidate)
            for label, ref_arg in arg_slots(user).items():
                cand_arg = cand_slots.get(label)
                if cand_arg is None or ref_arg not in self.ref_set or cand_arg not in self.cand_set:
                    continue
                mate = self.counterpart.get(ref_arg)
                if mate is not None and mate.candidate is cand_arg:
                    continue
                if self.stands_in(ref_arg, cand_arg):
                    continue
                rewired.setdefault(user, []).append(
                    Rewire(label, ref_arg, cand_arg, self.owner[cand_arg]))
        return rewired

    def result(self) -> NodeMatching:
        counterpart, seen_as = self.counterpart, self.seen_as
        return NodeMatching(
            counterpart={ref: counterpart[ref] for ref in self.ref_nodes if ref in counterpart},
            seen_as={ref: kept for ref in self.ref_nodes if ref in seen_as
                     for kept in [[(cand, user) for cand, user in seen_as[ref]
                                   if self.stands_in(ref, cand)]] if kept},
            unmatched_reference=[ref for ref in self.ref_nodes if ref not in counterpart],
            unmatched_candidate=[cand for cand in self.cand_nodes if cand not in self.owner],
            changed_modules=self.changed, rewired=self.rewired())


def refuted_matches(matching: NodeMatching, agrees: Callable[[fx.Node, fx.Node], bool | None]
                    ) -> list[tuple[fx.Node, fx.Node]]:
    """Matches by inputs or position whose candidate node computes another reference node's value.

    ``agrees(ref, cand)``: whether their values agree (None: not compared). A
    candidate node that differs from its match but agrees with a reference
    node that a user reads it in place of computes that node's value, not its
    match's: a fused Linear+ReLU reads the Linear's inputs, yet its value is
    the ReLU's. Such pairs go to ``match_nodes(..., refuted=...)``.

    >>> import torch, fxdebug
    >>> class Skip(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc1, self.relu = torch.nn.Linear(2, 2), torch.nn.ReLU()
    ...     def forward(self, x):
    ...         return self.relu(self.fc1(x)) * 2
    >>> ref, cand = fxdebug.trace(Skip()), fxdebug.trace(Skip())
    >>> fc1, relu, mul = [n for n in cand.graph.nodes if n.op.startswith("call")]
    >>> _ = cand.add_submodule("fused", torch.nn.Sequential(cand.fc1, torch.nn.ReLU()))
    >>> with cand.graph.inserting_after(fc1):   # a pass fuses Linear+ReLU
    ...     fused = cand.graph.call_module("fused", fc1.args)
    >>> mul.args = (fused, 2); cand.graph.erase_node(relu); cand.graph.erase_node(fc1)
    >>> first = match_nodes(ref, cand)
    >>> [(r.name, m.candidate.name, m.how) for r, m in first.counterpart.items()]
    [('x', 'x', 'key'), ('fc1', 'fused', 'inputs'), ('mul', 'mul', 'key')]
    >>> values_equal = {("fc1", "fused"): False, ("relu", "fused"): True}   # from a run of both
    >>> refuted = refuted_matches(first, lambda r, c: values_equal.get((r.name, c.name)))
    >>> [(r.name, c.name) for r, c in refuted]
    [('fc1', 'fused')]
    >>> again = match_nodes(ref, cand, refuted)
    >>> [(r.name, m.candidate.name, m.how) for r, m in again.counterpart.items()]
    [('x', 'x', 'key'), ('relu', 'fused', 'position'), ('mul', 'mul', 'key')]
    """
    stand_ins: dict[fx.Node, list[fx.Node]] = {}  # candidate node -> reference nodes it stands in
    for ref, entries in matching.seen_as.items():
        for cand, _ in entries:
            stand_ins.setdefault(cand, []).append(ref)
    found = []
    for ref, match in matching.counterpart.items():
        cand = match.candidate
        if match.how in ("inputs", "position") and agrees(ref, cand) is False and any(
                other is not ref and agrees(other, cand) for other in stand_ins.get(cand, ())):
            found.append((ref, cand))
    return found


def _shown(value: object) -> str:
    """An argument as text, nodes by key, containers element by element."""
    if isinstance(value, fx.Node):
        return node_key(value)
    if isinstance(value, (tuple, list)):
        items = ", ".join(map(_shown, value))
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def arguments_text(node: fx.Node) -> str:
    """A node's arguments, nodes shown by key: ``(fc2, fc1)``, ``(x, dim=1)``.

    >>> import torch
    >>> g = torch.fx.Graph(); a = g.placeholder("a")
    >>> arguments_text(g.call_function(torch.sum, (a,), {"dim": 1}))
    '(a, dim=1)'
    >>> arguments_text(g.call_function(torch.cat, ([a, a],)))
    '([a, a],)'
    """
    parts = [_shown(arg) for arg in node.args]
    parts += [f"{name}={_shown(value)}" for name, value in node.kwargs.items()]
    return f"({', '.join(parts)}{',' if len(parts) == 1 and not node.kwargs else ''})"
