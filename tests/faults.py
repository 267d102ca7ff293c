"""Shared setups of the equivalence and NaN tests: resnet18 on a small image, faults put into its graph."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torchvision

from fxdebug.tracing.keys import assign_missing_keys


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine it is faster than two fighting for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.fixture(scope="module")
def image():
    return torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def node(gm: fx.GraphModule, key: str) -> fx.Node:
    """The one node of ``gm`` keyed ``key``."""
    found = [n for n in gm.graph.nodes if n.meta.get("fxdebug_key") == key]
    assert len(found) == 1, (key, [n.meta.get("fxdebug_key") for n in gm.graph.nodes])
    return found[0]


def insert_after(gm: fx.GraphModule, key: str, fn, *extra, keyed: bool = False) -> fx.Node:
    """Insert ``fn(node, *extra)`` after node ``key`` and make its users read it.

    The new node has no key (a pass that forgot ``inherit_key``) unless ``keyed``.
    """
    target = node(gm, key)
    with gm.graph.inserting_after(target):
        new = gm.graph.call_function(fn, (target, *extra))
    target.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    gm.recompile()
    if keyed:
        assign_missing_keys(gm.graph)
    return new
