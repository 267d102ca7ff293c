"""fxdebug pauses Python's garbage collector while it builds graphs, and puts it back as it was."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.runtime.gc_pause import collection_paused


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


class Cycle:
    def __init__(self):
        self.me = self


def test_nested_pauses_restore_the_collector_once(gc_enabled):
    with collection_paused():
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(gc_enabled):
    gc.disable()
    with collection_paused():
        pass
    fxdebug.tabular(fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU())))
    assert not gc.isenabled()


def test_an_error_inside_restores_the_collector(gc_enabled):
    with pytest.raises(ValueError):
        with collection_paused():
            raise ValueError("inside")
    assert gc.isenabled()
    with pytest.raises(TypeError):
        fxdebug.instrument("not a module")
    assert gc.isenabled()


def test_cycles_made_during_a_pause_are_freed_by_the_next_collection(gc_enabled):
    with collection_paused():
        ref = weakref.ref(Cycle())
        assert ref() is not None
    gc.collect()
    assert ref() is None


def test_front_end_runs_with_the_collector_paused_and_gives_it_back(gc_enabled):
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(gc.isenabled())  # runs while fxdebug.trace traces the model
            return x + 1

    model = torch.nn.Sequential(torchvision.models.resnet18(num_classes=4).layer1, Probe())
    gm = fxdebug.instrument(model)
    fxdebug.diff(fxdebug.trace(model), gm)
    fxdebug.tabular(gm)
    assert seen and not any(seen)
    assert gc.isenabled()
    x = torch.randn(1, 64, 8, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_warnings_still_point_at_the_callers_line(gc_enabled):
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Branchy())
    with pytest.warns(UserWarning, match="as leaves") as caught:
        fxdebug.instrument(model)
    assert [w.filename for w in caught if "as leaves" in str(w.message)] == [__file__]
