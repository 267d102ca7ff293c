"""Find the first node of a dynamo graph that a backend computes differently from eager.

Call tree::

    capture_graphs(model, runs)        torch.compile with a backend that keeps each graph
                                       dynamo captured and the real inputs of its first call
                                       (watched_runs.py: the user's dynamo caches untouched)
    localize(graph, compile_piece)
      ├─ eager values                  keyed copy + Capture("all"): fxdebug's captures of
      │                                every node; an Interpreter for the inputs of pieces
      ├─ prefix(k) diverges?           nodes[0..k] compiled alone on the eager inputs, its
      │                                live tensors at the cut compared with eager
      ├─ bisection over k              the first cut where a value differs: that node
      └─ shrink the start              the latest start s whose piece nodes[s..k] still
                                       differs: the smallest divergent subgraph (the repro)

As torch's accuracy minifier (dynamo's ``repro.after_dynamo``), bisection
assumes a value that differs makes the values computed from it differ too;
unlike the minifier it compares every piece with fxdebug's captures of the
same nodes and reports fxdebug keys and source lines.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx

from ..passes import Capture
from ..passes.aliasing import AliasAnalysis
from ..runtime import RECORDER_ATTR, clone_inputs
from ..tracing import keyed_copy
from ..tracing.keys import META_KEY, META_SOURCE, node_key
from ..equivalence.compare import Comparison, compare_tensors
from .watched_runs import keeping, watched_run
from ..equivalence.controlled_run import ControlledRuns

__all__ = ["CapturedGraph", "Piece", "PieceResult", "capture_graphs", "localize", "build_piece"]

_COMPUTE = ("call_function", "call_method", "call_module")


@dataclasses.dataclass
class CapturedGraph:
    """One graph dynamo captured (keyed), in the order dynamo compiled them, and its inputs."""

    index: int
    gm: fx.GraphModule
    inputs: tuple | None  # real values of its first call in the run


def capture_graphs(model: torch.nn.Module, runs: ControlledRuns) -> list[CapturedGraph]:
    """Run ``torch.compile(model)`` once with a backend that keeps the graphs (run eagerly)."""
    _, ran = watched_run(model, runs, keeping(), keep_inputs=True)
    return [CapturedGraph(index, graph.gm, graph.inputs) for index, graph in enumerate(ran)
            if graph.gm is not None]  # keeping(): every graph has its module


@dataclasses.dataclass
class Piece:
    """``nodes[start..stop]`` of a graph as a GraphModule of its own, and what feeds it."""

    gm: fx.GraphModule
    inputs: tuple
    outputs: list[fx.Node]  # the original nodes whose values it returns


@dataclasses.dataclass
class PieceResult:
    """The outputs of a compiled piece compared with eager (``error``: compiling or running failed)."""

    piece: Piece
    rows: list[tuple[fx.Node, Comparison]]
    compiled: list
    error: str = ""

    @property
    def diverges(self) -> bool:
        return bool(self.error) or any(not c.ok for _, c in self.rows)


def build_piece(gm: fx.GraphModule, nodes: list[fx.Node], start: int, stop: int,
                outputs: list[fx.Node], env: dict) -> Piece:
    """``nodes[start..stop]`` with every value read from outside as an input (fed from ``env``)."""
    inside = dict.fromkeys(nodes[start:stop + 1])
    external: dict[fx.Node, None] = {}
    for node in inside:
        for arg in node.all_input_nodes:
            if arg not in inside:
                external[arg] = None
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    feeds = []
    for arg in external:
        if arg.op == "get_attr":
            mapping[arg] = graph.get_attr(str(arg.target))
        else:
            mapping[arg] = graph.placeholder(arg.name)
            feeds.append(env[arg])
        mapping[arg].meta.update({k: v for k, v in arg.meta.items()
                                  if k in (META_KEY, META_SOURCE, "example_value", "val")})
    for node in inside:
        mapping[node] = graph.node_copy(node, mapping.__getitem__)
    graph.output(tuple(mapping[node] for node in outputs))
    graph.lint()
    piece = fx.GraphModule(gm, graph, class_name="DivergentPiece")
    return Piece(piece, tuple(feeds), list(outputs))


class _Values(fx.Interpreter):
    """Every node's eager value, copied when made (later in-place ops cannot change it)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}

    def run_node(self, node):
        result = super().run_node(node)
        self.values[node] = clone_inputs(result)
        return result


def _eager_captures(gm: fx.GraphModule, inputs: tuple) -> dict[str, torch.Tensor]:
    """fxdebug's captures of every node of ``gm`` (keyed copy + Capture("all")), by key."""
    keyed = keyed_copy(gm)
    Capture("all")(keyed)
    with torch.no_grad():
        keyed(*clone_inputs(inputs))
    return {record.key: record.value for record in getattr(keyed, RECORDER_ATTR).latest.records()
            if record.value is not None}


class _Localizer:
    def __init__(self, graph: CapturedGraph, compile_piece: Callable, rtol, atol) -> None:
        self.graph = graph
        self.gm = graph.gm
        self.compile_piece = compile_piece
        self.rtol, self.atol = rtol, atol
        interpreter = _Values(self.gm)
        with torch.no_grad():
            interpreter.run(*clone_inputs(graph.inputs))
        self.env = interpreter.values
        self.captured = _eager_captures(self.gm, graph.inputs or ())
        self.nodes = [node for node in self.gm.graph.nodes if node.op in _COMPUTE]
        self.position = {node: index for index, node in enumerate(self.gm.graph.nodes)}
        self.alias = AliasAnalysis(self.gm)
        self.compiles = 0

    def comparable(self, node: fx.Node, cut: fx.Node) -> bool:
        value = self.captured.get(node_key(node))
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point()
                                                       or value.is_complex()):
            return False
        members = dict.fromkeys(self.alias.members(node))  # written in place before the cut?
        return not any(self.position[node] < self.position[writer] <= self.position[cut]
                       and written in members for writer, written in self.alias.writes())

    def live_at(self, stop: int) -> list[fx.Node]:
        """Tensor values of ``nodes[0..stop]`` that later nodes or the graph output read."""
        later = dict.fromkeys(self.nodes[stop + 1:])
        cut = self.nodes[stop]
        found = []
        for node in self.nodes[:stop + 1]:
            if any(user in later or user.op == "output" for user in node.users) or node is cut:
                if self.comparable(node, cut):
                    found.append(node)
        return found

    def run(self, start: int, stop: int, outputs: list[fx.Node]) -> PieceResult:
        piece = build_piece(self.gm, self.nodes, start, stop, outputs, self.env)
        self.compiles += 1
        try:
            # a copy: a backend may edit the graph it is given
            compiled = self.compile_piece(copy.deepcopy(piece.gm),
                                          list(clone_inputs(piece.inputs)))
            with torch.no_grad():
                got = list(compiled(*clone_inputs(piece.inputs)))
        except Exception as exc:  # the backend failed on this piece: that is a difference too
            return PieceResult(piece, [], [], f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        rows = []
        for node, value in zip(outputs, got):
            ref = self.captured[node_key(node)]
            if not isinstance(value, torch.Tensor):
                rows.append((node, Comparison(node_key(node), False, math.inf, math.inf,
                                              detail=f"compiled gave {type(value).__name__}")))
            else:
                rows.append((node, compare_tensors(ref, value, node_key(node), self.rtol,
                                                   self.atol)))
        return PieceResult(piece, rows, got)

    def prefix(self, stop: int) -> PieceResult | None:
        outputs = self.live_at(stop)
        return self.run(0, stop, outputs) if outputs else None


@dataclasses.dataclass
class Localized:
    """The first divergent node of a graph and the smallest piece that still shows it."""

    graph: CapturedGraph
    node: fx.Node
    comparison: Comparison
    piece: PieceResult
    compiles: int
    note: str = ""


def localize(graph: CapturedGraph, compile_piece: Callable, rtol=None, atol=None
             ) -> Localized | None:
    """The first node of ``graph`` whose compiled value differs, or None if the graph agrees."""
    if graph.inputs is None:
        return None
    work = _Localizer(graph, compile_piece, rtol, atol)
    if not work.nodes:
        return None
    last = len(work.nodes) - 1
    whole = work.prefix(last)
    if whole is None or not whole.diverges:
        return None
    results = {last: whole}
    low, high = -1, last  # prefix(low) agrees (empty when -1), prefix(high) differs
    while high - low > 1:
        middle = (low + high) // 2
        result = work.prefix(middle)
        if result is not None and result.diverges:
            high = middle
            results[middle] = result
        else:
            low = middle
    found = results[high]
    stop_node = work.nodes[high]
    if found.error:
        target, comparison = stop_node, Comparison(node_key(stop_node), False, math.inf,
                                                   math.inf, detail=found.error)
    else:
        bad = [(node, c) for node, c in found.rows if not c.ok]
        target, comparison = next(((n, c) for n, c in bad if n is stop_node), bad[0])
    stop = work.nodes.index(target)
    smallest = _smallest_piece(work, stop, target)
    return Localized(graph, target, comparison, smallest or found, work.compiles)


def _smallest_piece(work: _Localizer, stop: int, target: fx.Node) -> PieceResult | None:
    """The piece ``nodes[s..stop]`` with the latest start ``s`` that still differs at ``target``."""
    alone = work.run(stop, stop, [target])
    if alone.diverges:
        return alone
    low, high = 0, stop  # piece from low differs (assumed, checked), from high agrees
    first = work.run(0, stop, [target])
    if not first.diverges:
        return None  # only visible together with other outputs: the prefix is the repro
    best = first
    while high - low > 1:
        middle = (low + high) // 2
        result = work.run(middle, stop, [target])
        if result.diverges:
            low, best = middle, result
        else:
            high = middle
    return best

