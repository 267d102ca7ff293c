"""Inserted nodes survive dead-code elimination, deepcopy, save/load and re-tracing."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torchvision

import fxdebug


@pytest.fixture(scope="module")
def instrumented():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    gm = fxdebug.instrument(model)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = gm(x)
    return gm, x, expected, fxdebug.records(gm)


def _capture_count(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "__name__", "") in ("capture", "capture_stats"))


def _check(gm, instrumented):
    original, x, expected, original_records = instrumented
    assert _capture_count(gm) == _capture_count(original)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)
    rec = fxdebug.records(gm)
    assert rec.keys() == original_records.keys()
    for key in rec:
        assert torch.equal(rec[key], original_records[key]), key


def test_survives_eliminate_dead_code(instrumented):
    gm = copy.deepcopy(instrumented[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _check(gm, instrumented)


def test_survives_deepcopy_with_fresh_records(instrumented):
    gm = copy.deepcopy(instrumented[0])
    assert len(fxdebug.records(gm)) == 0, "a copy starts with empty Records"
    assert gm.code == instrumented[0].code
    _check(gm, instrumented)


def test_survives_torch_save_and_load_with_keys(instrumented):
    buffer = io.BytesIO()
    torch.save(instrumented[0], buffer)
    buffer.seek(0)
    gm = torch.load(buffer, weights_only=False)
    assert gm.code == instrumented[0].code
    keys = [n.meta.get("fxdebug_key") for n in gm.graph.nodes]
    assert keys == [n.meta.get("fxdebug_key") for n in instrumented[0].graph.nodes]
    _check(gm, instrumented)


def test_survives_retracing_with_plain_fx(instrumented):
    gm = torch.fx.symbolic_trace(instrumented[0])
    _check(gm, instrumented)


def test_survives_retracing_with_fxdebug(instrumented):
    gm = fxdebug.trace(instrumented[0])
    assert gm.code.count("self.fxdebug_recorder") == 1
    _check(gm, instrumented)


def test_inplace_ops_survive_save_and_load():
    from models import ViewAugAssign
    model = ViewAugAssign().eval()
    gm = fxdebug.instrument(model)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), model(x))
