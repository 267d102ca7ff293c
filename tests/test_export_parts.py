"""Partial instrumentation tries torch.export on a part before running it eagerly.

Ground truth: the eager model (outputs, parameter gradients, the attention weights
transformers returns with ``output_attentions=True``, ``retain_grad`` on them).
"""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

import fxdebug
from fxdebug.partial.trace_parts import traced_parts
from tiny_transformers import quiet as _quiet, tiny_bert


def _bert():
    torch.manual_seed(0)
    return tiny_bert()


def _ids(length):
    return torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(length))


def test_bert_attention_runs_as_an_exported_graph_equal_to_eager():
    model = _bert()
    reference = copy.deepcopy(model)  # eager twin: its own parameters, its own gradients
    ids = _ids(8)
    expected = reference(ids, output_attentions=True)
    for weights in expected.attentions:
        weights.retain_grad()
    expected.last_hidden_state.sum().backward()

    instrumented = fxdebug.instrument(model, capture="all", grads=True)
    out = _quiet(instrumented, ids, output_attentions=True)
    out.last_hidden_state.sum().backward()

    # every BertModel call takes **kwargs, which symbolic tracing cannot fix: export ran it
    report = instrumented.fxdebug_partial
    assert report.eager == []
    (part,) = report.parts
    assert (part.path, part.frontend) == ("", "export")
    assert "**kwargs" in part.fx_reason
    gm = traced_parts(instrumented)[part.label]
    assert gm.meta["fxdebug_frontend"] == "export"
    summary = report.summary()
    assert "(root) (BertModel) [export] (int64[2, 8], output_attentions=True)" in summary
    # outputs: the same ATen ops as eager, so bitwise equal
    assert torch.equal(out.last_hidden_state, expected.last_hidden_state)
    assert torch.equal(out.pooler_output, expected.pooler_output)
    rec = fxdebug.records(instrumented)
    for layer, weights in enumerate(expected.attentions):
        assert torch.equal(out.attentions[layer], weights)
        key = f"encoder.layer.{layer}.attention.self.softmax"  # a node of the graph now
        assert rec.record(key).via == "graph"
        assert torch.equal(rec[key], weights), key
        assert torch.equal(rec.grads[key], weights.grad), key
    assert rec.record("encoder.layer.0.attention.self/0").via == "graph"  # a module output
    # parameter gradients through the exported graph (parameters shared with `model`)
    for (name, param), (_, twin) in zip(model.named_parameters(), reference.named_parameters()):
        if twin.grad is None:
            assert param.grad is None, name
            continue
        assert torch.equal(param.grad, twin.grad), name


def test_other_shapes_and_values_get_a_graph_of_their_own():
    model = _bert()
    instrumented = fxdebug.instrument(model, capture="all")
    with torch.no_grad():
        for length, attentions in ((8, True), (5, True), (8, False), (8, True)):
            ids = _ids(length)
            expected = model(ids, output_attentions=attentions)
            out = _quiet(instrumented, ids, output_attentions=attentions)
            assert torch.equal(out.last_hidden_state, expected.last_hidden_state)
            assert (out.attentions is None) == (not attentions)
            rec = fxdebug.records(instrumented)
            assert ("encoder.layer.1.attention.self.softmax" in rec) and \
                rec["encoder.layer.1.attention.self.softmax"].shape[-1] == length
    # (8, True) again reuses its graph: three exports, each specialised to its call
    calls = [(part.label, part.frontend, part.call) for part in instrumented.fxdebug_partial.parts]
    assert calls == [("", "export", "(int64[2, 8], output_attentions=True)"),
                     ("@1", "export", "(int64[2, 5], output_attentions=True)"),
                     ("@2", "export", "(int64[2, 8], output_attentions=False)")]


# -- small models: what export is specialised to; what it cannot export -----------------------
class Scaled(nn.Module):
    """Called with **options: symbolic tracing cannot fix them, torch.export can."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **options):
        y = self.fc(x) * options.get("scale", 1.0)
        if options.get("mask") is not None:
            y = y * options["mask"]
        return y


class Gate(nn.Module):
    """A branch on a value: neither symbolic tracing nor torch.export can make one graph."""

    def __init__(self):
        super().__init__()
        self.scaled = Scaled()
        self.head = nn.Linear(4, 2)

    def forward(self, x, scale=2.0, mask=None):
        y = self.scaled(x, scale=scale, mask=mask)
        if y.sum() > 0:
            y = -y
        return self.head(y)


def test_export_is_specialised_to_every_argument_and_failures_run_eagerly():
    torch.manual_seed(0)
    model = Gate().eval()
    instrumented = fxdebug.instrument(model, capture="all")
    x = torch.randn(3, 4)
    mask = (torch.randn(3, 4) > 0).float()
    with torch.no_grad():
        for scale, m in ((2.0, None), (3.0, None), (3.0, mask), (-2.0, mask)):
            out = _quiet(instrumented, x, scale=scale, mask=m)
            assert torch.equal(out, model(x, scale=scale, mask=m)), (scale, m is None)
            rec = fxdebug.records(instrumented)
            assert torch.equal(rec["scaled"], model.scaled(x, scale=scale, mask=m))
            assert rec.record("scaled.mul").via == "graph"
    report = instrumented.fxdebug_partial
    assert [(p.label, p.frontend) for p in report.parts] == [
        ("scaled", "export"), ("scaled@1", "export"), ("scaled@2", "export"),
        ("scaled@3", "export")]
    assert report.parts[2].call == "(float32[3, 4], scale=3.0, mask=float32[3, 4])"
    # the root: fx fails on the branch, export fails on it too; both reasons are given
    (root,) = report.eager
    assert root.path == "" and root.kind == "control flow on a traced value"
    assert "test_export_parts.py" in root.location
    assert root.export_reason.startswith("torch.export failed at tests/test_export_parts.py:")
    assert "data-dependent" in root.export_reason
    summary = report.summary()
    assert "  (root) (Gate) [eager]: fxdebug could not trace the root module (Gate)" in summary
    assert "    export: torch.export failed at tests/test_export_parts.py:" in summary
    assert "  scaled (Scaled) [export] (float32[3, 4], scale=2.0, mask=None)" in summary
    assert "traced 4 part(s) (4 by torch.export), ran 1 module(s) eagerly" in report.warning_text()


def test_exported_parts_rerun_alone_and_survive_deepcopy_and_pickle():
    torch.manual_seed(0)
    model = Gate().eval()
    instrumented = fxdebug.instrument(model, capture="all")
    x = torch.randn(3, 4)
    with torch.no_grad():
        _quiet(instrumented, x, scale=3.0)
        arguments = _quiet(fxdebug.part_inputs, instrumented, x, scale=3.0)["scaled"]
        part = traced_parts(instrumented)["scaled"]
        assert arguments[1:] == (3.0, None)  # the call's own order: x, then its keywords
        assert torch.equal(part(*arguments), model.scaled(x, scale=3.0, mask=None))
        twin = copy.deepcopy(instrumented)
        for clone in (twin, pickle.loads(pickle.dumps(twin))):
            assert torch.equal(_quiet(clone, x, scale=3.0), model(x, scale=3.0))
            assert fxdebug.records(clone).record("scaled.mul").via == "graph"


# -- train mode: running statistics and random draws -----------------------------------------
class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, **options):
        return self.bn(self.fc(x)) * options.get("scale", 1.0)


class NormedGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.normed = Normed()

    def forward(self, x):
        y = self.normed(x, scale=2.0)
        return y if y.sum() > 0 else -y


def test_train_mode_batchnorm_statistics_equal_eager_in_an_exported_part():
    torch.manual_seed(0)
    model = NormedGate().train()
    twin = copy.deepcopy(model)
    instrumented = fxdebug.instrument(model)
    x = torch.randn(8, 4)
    for _ in range(2):  # exporting runs nothing that updates the model's statistics
        assert torch.equal(_quiet(instrumented, x), twin(x))
        assert int(model.normed.bn.num_batches_tracked) == int(twin.normed.bn.num_batches_tracked)
        assert torch.equal(model.normed.bn.running_mean, twin.normed.bn.running_mean)
        assert torch.equal(model.normed.bn.running_var, twin.normed.bn.running_var)
    assert [(p.label, p.frontend) for p in instrumented.fxdebug_partial.parts] == [
        ("normed", "export")]


def test_train_mode_dropout_is_not_exported_and_equals_a_seeded_eager_run():
    model = _bert().train()
    instrumented = fxdebug.instrument(model)
    ids = _ids(8)
    torch.manual_seed(1)
    out = _quiet(instrumented, ids).last_hidden_state
    torch.manual_seed(1)
    assert torch.equal(out, model(ids).last_hidden_state)
    report = instrumented.fxdebug_partial
    assert all(part.frontend == "fx" for part in report.parts)
    # the root is traced with fx for the call (random ops as nodes), never exported
    assert [part.path for part in report.parts][:1] == [""]
