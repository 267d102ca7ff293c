"""The torch.export front end: module-path keys, captures, gradients, equivalence, dumps."""

from __future__ import annotations

import os
import re
import textwrap
import warnings

import pytest
import torch
import torchvision
from torch import nn

import fxdebug
from fxdebug.reporting.node_table import tabular_text
from folder_import import import_folder
from hooks import hook_captures
from subprocesses import outputs_under_hash_seeds



class DimBranch(nn.Module):
    """``if x.dim() == 3``: symbolic tracing cannot decide it, torch.export can."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(0)
        x = self.act(self.conv(x))
        x = self.act(x.mean((2, 3)) + 1)  # the same ReLU twice: keys act and act_1
        return self.fc(x)


class ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:  # neither fx nor torch.export can follow this
            return self.fc(x)
        return -x


class Bare(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    return model, x, fxdebug.trace(model, x, frontend="export"), fxdebug.trace(model)


def test_export_keys_equal_fx_keys_for_module_calls(resnet):
    model, x, exported, traced = resnet
    assert exported.meta["fxdebug_frontend"] == "export"
    by_export, by_fx = fxdebug.instrument(exported), fxdebug.instrument(traced)
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(by_export(x), expected)
        assert torch.equal(by_fx(x), expected)
    rec_export, rec_fx = fxdebug.records(by_export), fxdebug.records(by_fx)
    assert rec_export.keys() == rec_fx.keys()
    assert "layer1.0.relu_1" in rec_export and "layer4" in rec_export
    for key in rec_fx.keys():
        assert torch.equal(rec_export[key], rec_fx[key]), key
        assert rec_export.record(key).op == rec_fx.record(key).op, key
    truth = hook_captures(model, x)
    for key in truth:
        assert torch.equal(rec_export[key], truth[key]), key


def test_export_graph_shares_parameters_and_names(resnet):
    model, _, exported, _ = resnet
    assert exported.conv1.weight is model.conv1.weight
    assert [name for name, _ in exported.named_parameters()] == \
        [name for name, _ in model.named_parameters()]
    sources = [node.meta.get("fxdebug_source") for node in exported.graph.nodes
               if node.meta.get("fxdebug_key") == "layer1.0.conv1.conv2d"]
    assert sources and sources[0][0].endswith(os.path.join("torchvision", "models", "resnet.py"))


def test_export_gradients_equal_fx_gradients(resnet):
    model, x, exported, traced = resnet
    results = []
    for gm in (exported, traced):
        model.zero_grad()
        instrumented = fxdebug.instrument(gm, grads=True)
        instrumented(x).logsumexp(1).sum().backward()
        grads = fxdebug.records(instrumented).grads
        results.append(({key: grads[key].clone() for key in grads.keys()},
                        {name: p.grad.clone() for name, p in model.named_parameters()}))
    model.zero_grad()
    (grads_export, params_export), (grads_fx, params_fx) = results
    assert list(grads_export) == list(grads_fx)
    assert list(grads_fx)[:2] == ["fc", "avgpool"] and "layer4" in grads_fx
    for key in grads_fx:
        torch.testing.assert_close(grads_export[key], grads_fx[key])
    for name in params_fx:
        torch.testing.assert_close(params_export[name], params_fx[name])


def test_export_equivalence_table_and_dump(resnet, tmp_path):
    model, x, exported, _ = resnet
    report = fxdebug.check_equivalence(model, exported, x, localize=True)
    assert report.ok
    table = tabular_text(exported, x)
    assert "layer1.0.conv1.conv2d" in table and "aten.conv2d.default" in table
    assert not re.search(r"0x[0-9a-f]{6}", table)
    instrumented = fxdebug.instrument(exported, capture=["layer2"])
    fxdebug.dump(instrumented, x, folder=tmp_path / "resnet_export")
    loaded = import_folder(tmp_path / "resnet_export").load()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        assert torch.equal(fxdebug.records(loaded)["layer2"], hook_captures(model, x)["layer2"])


def test_auto_uses_export_when_fx_fails_and_says_why():
    model = DimBranch().eval()
    x = torch.randn(3, 9, 9)
    with pytest.raises(fxdebug.TraceFailure):
        fxdebug.trace(model)
    with pytest.warns(UserWarning, match="used torch.export for DimBranch"):
        gm = fxdebug.trace(model, x, frontend="auto")
    assert gm.meta["fxdebug_frontend"] == "export"
    notes = gm.meta["fxdebug_frontend_notes"]
    assert len(notes) == 1 and notes[0].startswith("fx: fxdebug could not trace the root module")
    instrumented = fxdebug.instrument(gm)
    with torch.no_grad():
        assert torch.equal(instrumented(x), model(x))
    rec = fxdebug.records(instrumented)
    truth = hook_captures(model, x)
    assert rec.keys() == list(truth) == ["conv", "act", "act_1", "fc"]
    for key in truth:
        assert torch.equal(rec[key], truth[key]), key


def test_auto_prefers_fx():
    gm = fxdebug.trace(torchvision.models.resnet18(), frontend="auto")
    assert gm.meta["fxdebug_frontend"] == "fx" and gm.meta["fxdebug_frontend_notes"] == []


def test_export_failures_say_what_to_do():
    with pytest.raises(fxdebug.TraceFailure, match="needs example inputs"):
        fxdebug.trace(DimBranch(), frontend="export")
    with pytest.raises(fxdebug.TraceFailure, match=r"could not export ValueBranch.*frontend='auto'"):
        fxdebug.trace(ValueBranch(), torch.ones(2), frontend="export")
    with pytest.raises(ValueError, match="frontend='exprot'"):
        fxdebug.trace(ValueBranch(), frontend="exprot")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partial = fxdebug.trace(ValueBranch(), torch.ones(2), frontend="auto")
    notes = partial.fxdebug_partial.notes
    assert [note.split(":")[0] for note in notes] == ["fx with symbolic arguments", "export"]
    with pytest.raises(fxdebug.TraceFailure, match="control flow on a traced value"):
        fxdebug.trace(Bare(), torch.ones(2), frontend="auto")  # no submodules: no parts


SCRIPT = textwrap.dedent("""
    import sys, torch, fxdebug
    from test_export import DimBranch
    torch.manual_seed(0)
    gm = fxdebug.instrument(fxdebug.trace(DimBranch().eval(), torch.randn(3, 9, 9), frontend="export"))
    gm(torch.randn(3, 9, 9))
    print(gm.code)
    fxdebug.print_tabular(gm, torch.randn(3, 9, 9))
    print(fxdebug.records(gm).table())
""")


def test_export_code_and_tables_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "act_1" in outputs[0] and not re.search(r"0x[0-9a-f]{6}", outputs[0])
