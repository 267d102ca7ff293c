"""What ``instrument`` and ``diff`` cost on a large graph, counted (lints, objects kept), not timed.

On a 10k-node chain the front end (trace + instrument + diff + tabular) was 3.2x
``torch.fx.symbolic_trace``: ``graph.lint()`` ran after every pass, also after a built-in pass
that changed nothing, and a diff kept 12 objects the garbage collector tracks per node (its
argument pieces as ``NodeRef`` strings in tuples), which set off full collections of the heap.
"""

from __future__ import annotations

import gc

import pytest
import torch.fx as fx
from torch import nn

import fxdebug
from fxdebug.passes import Capture


def _chain(pairs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(pairs):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    return nn.Sequential(*layers)


@pytest.fixture
def lints(monkeypatch):
    """How many times ``Graph.lint`` runs."""
    calls: list[int] = []
    original = fx.Graph.lint

    def counted(graph):
        calls.append(len(graph.nodes))
        return original(graph)

    monkeypatch.setattr(fx.Graph, "lint", counted)
    return calls


def test_instrument_lints_once_when_only_the_capture_pass_changes_the_graph(lints):
    gm = fxdebug.trace(_chain(3))
    lints.clear()
    fxdebug.instrument(gm)  # capture (changed: linted), eager_regions (nothing to do: not)
    assert len(lints) == 1


def test_a_pass_that_may_misreport_is_linted_even_when_it_says_it_changed_nothing(lints):
    class Quiet(Capture):  # a user's subclass: its run() is its own, so its word is not taken
        def run(self, gm):
            super().run(gm)
            return False

    gm = fxdebug.trace(_chain(2))
    lints.clear()
    fxdebug.passes.base.run_passes(gm, [Capture(), Quiet(capture="all"), lambda g: None])
    assert len(lints) == 3


def test_a_broken_graph_is_still_named_at_its_pass():
    def unlink(gm):  # leaves a node using a value defined after it
        nodes = list(gm.graph.nodes)
        nodes[1].args = (nodes[2],)

    gm = fxdebug.trace(_chain(2))
    with pytest.raises(RuntimeError) as caught:
        fxdebug.passes.base.run_passes(gm, [Capture(), unlink])
    assert any("pass 'unlink' failed" in note for note in caught.value.__notes__)


def test_a_diff_keeps_few_tracked_objects_per_node():
    model = _chain(500)
    before = fxdebug.trace(model)
    after = fxdebug.instrument(before)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        count = len(gc.get_objects())
        graph_diff = fxdebug.diff(before, after)
        gc.collect()  # what is left is what the diff keeps (plain tuples of text untracked)
        kept = len(gc.get_objects()) - count
    finally:
        if enabled:
            gc.enable()
    nodes = len(before.graph.nodes) + len(after.graph.nodes)
    assert graph_diff.summary() == f"+{len(after.graph.nodes) - len(before.graph.nodes)} -0 ~0"
    assert kept <= 2 * nodes, (kept, nodes)  # a view per node, a row per node after (was 4x)
