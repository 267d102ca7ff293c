"""Every report has one shape: a one-line repr, str() == table(), a JSON-safe to_dict(), HTML,
and a verdict that matches what is true of the model (computed another way)."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torchvision

import fxdebug
from fxdebug.base.report import REPR_LIMIT, Report


def check_shape(report, name: str) -> str:
    """The checks every report passes; returns its repr."""
    assert isinstance(report, Report)
    assert type(report).__name__ == name
    text = repr(report)
    assert "\n" not in text and len(text) <= REPR_LIMIT, text
    assert text.startswith(f"<{name}") and text.endswith(">"), text
    assert str(report) == report.table()
    assert report.table(wide=True)
    data = report.to_dict()
    assert json.loads(json.dumps(data))["kind"] == name
    assert data["ok"] == report.verdict()
    assert report._repr_html_().strip().startswith("<")
    print(text)
    return text


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)


def test_equivalence_report_on_itself_and_on_a_perturbed_copy(resnet):
    model, x = resnet
    same = fxdebug.check_equivalence(model, fxdebug.trace(model), x)
    check_shape(same, "EquivalenceReport")
    assert same.ok
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.layer2[0].conv1.weight.mul_(1.5)
        assert not torch.allclose(model(x), perturbed(x))  # ground truth: eager differs
    different = fxdebug.check_equivalence(model, perturbed, x)
    text = check_shape(different, "EquivalenceReport")
    assert not different.ok and "DIFFERENT" in text
    assert different.first_divergence.key == "layer2.0.conv1"
    assert different.to_dict()["first_divergence"]["key"] == "layer2.0.conv1"


def test_records_report_matches_forward_hooks(resnet):
    model, x = resnet
    seen = {}
    handle = model.layer1[0].conv1.register_forward_hook(
        lambda module, args, out: seen.setdefault("out", out.detach().clone()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    text = check_shape(rec, "Records")
    assert text.startswith(f"<Records {len(rec)} tensors")
    entry = rec.to_dict()["records"]["layer1.0.conv1"]
    assert entry["shape"] == list(seen["out"].shape)
    assert entry["stats"]["mean"] == pytest.approx(seen["out"].mean().item(), rel=1e-4)


def test_graph_diff_finds_the_one_node_added(resnet):
    model, _ = resnet
    before = fxdebug.trace(model)
    check_shape(fxdebug.diff(before, fxdebug.trace(model)), "GraphDiff")
    assert not fxdebug.diff(before, fxdebug.trace(model))
    after = fxdebug.trace(model)
    conv = next(node for node in after.graph.nodes if node.meta.get("fxdebug_key") == "conv1")
    with after.graph.inserting_after(conv):
        extra = after.graph.call_function(torch.neg, (conv,))
    conv.replace_all_uses_with(extra, delete_user_cb=lambda user: user is not extra)
    after.recompile()
    changed = fxdebug.diff(before, after)
    text = check_shape(changed, "GraphDiff")
    assert len(changed.added) == 1 and not changed.removed and "+1 -0" in text
    assert len(repr(changed)) < 80


def test_jacobian_norms_of_tanh_match_the_derivative():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x = torch.randn(2, 3)
    norms = fxdebug.jacobian_norms(model, x, samples=8)
    check_shape(norms, "JacobianNorms")
    with torch.no_grad():  # d tanh(z) / dz is diagonal: a ±1 probe gives its norm exactly
        expected = (1 - torch.tanh(model[0](x)) ** 2).norm().item()
    assert norms.norms["0"] == pytest.approx(expected, rel=1e-5)
    assert norms.norms["1"] == pytest.approx(math.sqrt(6), rel=1e-5)


class _WritesSavedValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))  # sigmoid's backward reads its output ...
        y += 1                         # ... which this overwrites
        return y


def test_hazards_report_is_a_sequence_with_a_verdict(resnet):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _WritesSavedValue()(torch.randn(3)).sum().backward()  # ground truth: autograd refuses
    hazards = fxdebug.lint_inplace(_WritesSavedValue(), torch.randn(3))
    text = check_shape(hazards, "Hazards")
    assert not hazards.ok and "BREAKS BACKWARD: error at iadd" in text
    assert len(hazards) == 1 and hazards[0].severity == "error" and list(hazards) == [hazards[0]]
    model, x = resnet
    clean = fxdebug.lint_inplace(model, x)  # in-place ReLUs that destroy nothing backward needs
    check_shape(clean, "Hazards")
    assert clean.ok and not clean.errors
    torch.nn.functional.cross_entropy(model(x.requires_grad_()), torch.tensor([0])).backward()


class _LogOfNegative(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.log(self.fc(x) - 10)


def test_nonfinite_reports_and_the_watch():
    torch.manual_seed(0)
    model, x = _LogOfNegative(), torch.randn(2, 3)
    assert not torch.isfinite(model(x)).all()  # ground truth: eager gives NaN
    report = fxdebug.find_nonfinite(model, x)
    text = check_shape(report, "NonfiniteReport")
    assert not report.ok and "log" in text
    fine = fxdebug.find_nonfinite(torch.nn.Linear(3, 3), x)
    check_shape(fine, "NonfiniteReport")
    assert fine.ok
    watch = fxdebug.watch_nonfinite(model)
    watch(x).sum().backward()
    assert isinstance(watch.check(), fxdebug.NonfiniteReport)
    text = repr(watch)
    print(text)
    assert text.startswith("<NonfiniteWatch _LogOfNegative, 1 step(s), NON-FINITE")
    assert "\n" not in text and len(text) <= REPR_LIMIT


def test_compiled_report_of_the_eager_backend_is_ok():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    report = fxdebug.check_compiled(model, torch.randn(2, 4), backend="eager")
    text = check_shape(report, "CompiledReport")
    assert report.ok and "EQUIVALENT" in text


def test_partial_report_names_the_eager_root():
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -x

    model = fxdebug.instrument(Branches())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.ones(1, 2))
    report = model.fxdebug_partial
    check_shape(report, "PartialReport")
    assert [eager.path for eager in report.eager] == [""]


def test_pass_report_verdict_follows_the_outputs():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.randn(2, 3)
    report = fxdebug.PassManager([fxdebug.passes.Capture()], check_inputs=(x,)).run(model).report
    check_shape(report, "PassReport")
    assert report.ok

    def relu_to_sigmoid(gm):
        for node in gm.graph.nodes:
            if node.op == "call_module" and isinstance(gm.get_submodule(node.target),
                                                       torch.nn.ReLU):
                with gm.graph.inserting_after(node):
                    new = gm.graph.call_function(torch.sigmoid, (node.args[0],))
                node.replace_all_uses_with(new)
                gm.graph.erase_node(node)
        gm.recompile()
        return gm

    assert not torch.allclose(torch.relu(x), torch.sigmoid(x))  # ground truth: they differ
    with pytest.raises(fxdebug.PassEquivalenceError) as failed:
        fxdebug.PassManager([relu_to_sigmoid], check_inputs=(x,)).run(model)
    check_shape(failed.value.report, "PassReport")
    assert failed.value.report.ok is False


@pytest.fixture
def world_of_one():
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_rank_reports_in_a_world_of_one(world_of_one):
    torch.manual_seed(0)
    report = fxdebug.compare_ranks(torch.nn.Linear(2, 2))
    check_shape(report, "RankReport")
    # one rank has no second copy: never "equal" over what was not compared
    assert not report.ok and report.verdict_text == "NOTHING TO COMPARE"
    assert "verdict: NOTHING TO COMPARE: a world of one rank" in report.table()
    model, x = _LogOfNegative(), torch.randn(2, 3)
    watch = fxdebug.watch_nonfinite(model)
    watch(x).sum().backward()
    found = watch.check()
    text = check_shape(found, "RankNonfiniteReport")
    assert not found.ok and "rank 0" in text
