"""Partial instrumentation: models whose root cannot be traced, captured part by part.

Ground truth: eager outputs, forward hooks on the same modules (tests/hooks.py),
``retain_grad`` on the hooked outputs.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import textwrap
import warnings

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.partial.trace_parts import is_partial, part_inputs, traced_parts
from fxdebug.reporting.node_table import tabular_text
from folder_import import import_folder
from hooks import hook_captures
from partial_models import Flow, Wrapper, flow_inputs
from subprocesses import fxdebug_cli, outputs_under_hash_seeds

ADDRESS = re.compile(r"0x[0-9a-f]{6}")  # an object address; "160x10" is a shape


def _instrument(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxdebug.instrument(model, **kwargs)


def _run(model, *inputs, grad=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if grad:
            return model(*inputs)
        with torch.no_grad():
            return model(*inputs)


def _flat(value, prefix="out"):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    found = {}
    for key, item in items:
        found.update(_flat(item, f"{prefix}/{key}"))
    return found


# -- a detector: its root iterates over a list of images -------------------------------------
@pytest.fixture(scope="module")
def detector():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None).eval()
    images = [torch.rand(3, 64, 80)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    instrumented = _instrument(model)
    out = _run(instrumented, images)
    # MultiScaleRoIAlign caches sizes on itself in forward: tracing and running the parts
    # happened on copies, so the user's module has seen nothing yet
    assert model.roi_heads.box_roi_pool.scales is None
    with torch.no_grad():
        expected = model(images)
    return model, images, state, expected, instrumented, out, fxdebug.records(instrumented)


def test_detector_outputs_equal_eager(detector):
    _, _, _, expected, _, out, _ = detector
    flat_expected, flat_out = _flat(expected), _flat(out)
    assert list(flat_expected) == list(flat_out)
    for key in flat_expected:
        assert torch.equal(flat_expected[key], flat_out[key]), key


def test_detector_backbone_and_head_captures_equal_forward_hooks(detector):
    model, images, _, _, _, _, rec = detector
    truth = hook_captures(model, images)
    for prefix in ("backbone.", "rpn.head.", "roi_heads.box_head.", "roi_heads.box_predictor."):
        keys = [key for key in truth if key.startswith(prefix)]
        assert keys, prefix
        for key in keys:
            assert key in rec, key
            assert torch.equal(rec[key], truth[key]), key
    # every call of a leaf module was captured (the RPN head's conv: once per feature level)
    leaves = [name for name, module in model.named_modules() if name and not list(module.children())]
    calls = [key for key in truth
             if key.split("/")[0] in leaves or key.split("/")[0].rsplit("_", 1)[0] in leaves]
    assert "rpn.head.conv.0.0_2" in calls
    assert [key for key in calls if key not in rec] == []


def test_detector_report_names_what_ran_eagerly_and_why(detector):
    _, _, _, _, instrumented, _, _ = detector
    report = instrumented.fxdebug_partial
    eager = {entry.path: entry for entry in report.eager}
    assert eager[""].module_type == "FasterRCNN"
    assert "generalized_rcnn.py" in eager[""].location
    assert "ImageList" in eager["rpn"].reason
    assert "not tried" in eager["rpn"].export_reason  # torch.export cannot take an ImageList
    assert "data-dependent" in eager["roi_heads"].export_reason  # the number of boxes
    # symbolic tracing fails on `if x.dim() == 4` in the box predictor; torch.export does not
    parts = {part.label: part for part in report.parts}
    assert parts["roi_heads.box_predictor"].frontend == "export"
    assert "faster_rcnn.py" in parts["roi_heads.box_predictor"].fx_reason
    # the RoI pool stores values on itself in forward: no front end is tried on it
    assert "stored on the module" in eager["roi_heads.box_roi_pool"].reason
    assert "not tried" in eager["roi_heads.box_roi_pool"].export_reason
    labels = [part.label for part in report.parts]
    assert labels[0] == "backbone" and "rpn.head" in labels and "roi_heads.box_head" in labels
    assert parts["backbone"].frontend == "fx"
    assert not ADDRESS.search(report.summary())


def test_detector_user_model_untouched(detector):
    model, images, state, expected, instrumented, _, _ = detector
    assert "forward" not in model.__dict__ and "fxdebug_partial" not in model.__dict__
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "fxdebug_recorder" not in dict(model.named_modules())
    assert list(model.state_dict()) == list(state)
    assert instrumented.backbone.body["0"][0].weight is model.backbone.body["0"][0].weight
    with torch.no_grad():
        again = model(images)
    assert torch.equal(again[0]["boxes"], expected[0]["boxes"])


def test_detector_records_restart_each_run(detector):
    _, images, _, _, instrumented, _, rec = detector
    _run(instrumented, images)
    second = fxdebug.records(instrumented)
    assert second is not rec
    assert second.keys() == rec.keys()


# -- a small model: keys, values and gradients against hooks --------------------------------
def test_keys_and_values_equal_forward_hooks():
    model = Flow().eval()
    instrumented = _instrument(model)
    out = _run(instrumented, *flow_inputs())
    assert torch.equal(out, model(*flow_inputs()))
    rec = fxdebug.records(instrumented)
    truth = hook_captures(model, *flow_inputs())
    assert rec.keys() == list(truth)  # same keys, same order: stem, stem_1, block, block_1...
    for key in truth:
        assert torch.equal(rec[key], truth[key]), key


def test_one_part_per_specialisation():
    model = Flow().eval()
    instrumented = _instrument(model)
    _run(instrumented, *flow_inputs())
    report = instrumented.fxdebug_partial
    calls = {part.label: part.call for part in report.parts}
    assert calls["block"] == "(x, mask=None)"
    assert calls["block@1"] == "(x, mask)"
    assert set(traced_parts(instrumented)) == set(calls)
    assert [entry.path for entry in report.eager] == [""]


def test_gradients_equal_retain_grad():
    torch.manual_seed(0)
    model = Flow()
    inputs = flow_inputs()
    kept, calls, handles = {}, {}, []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, _inputs, output, name=name):
            count = calls.get(name, 0)
            calls[name] = count + 1
            output.retain_grad()
            kept[name if count == 0 else f"{name}_{count}"] = output

        handles.append(module.register_forward_hook(hook))
    model(*inputs).pow(2).sum().backward()
    for handle in handles:
        handle.remove()
    truth_params = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    instrumented = _instrument(model, grads=True)
    _run(instrumented, *inputs, grad=True).pow(2).sum().backward()
    rec = fxdebug.records(instrumented)
    assert set(rec.grads.keys()) == set(kept)
    for key, value in kept.items():
        assert torch.allclose(rec.grads[key], value.grad, atol=1e-6), key
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, truth_params[name]), name
    assert "grad norm" in rec.table()


def test_selection_applies_to_parts_and_eager_modules():
    model = Flow().eval()
    only = _instrument(model, capture=["stem.0", "head"])
    _run(only, *flow_inputs())
    assert fxdebug.records(only).keys() == ["stem.0", "head", "stem.0_1", "head_1", "stem.0_2",
                                             "head_2"]
    shallow = _instrument(model, depth=0, exclude=["head"])
    _run(shallow, *flow_inputs())
    assert fxdebug.records(shallow).keys() == ["stem", "block", "stem_1", "block_1", "stem_2",
                                                "block_2"]
    stats = _instrument(model, mode="stats", include=["block"])
    _run(stats, *flow_inputs())
    rec = fxdebug.records(stats)
    assert rec.keys()[:3] == ["block.fc", "block.act", "block"]
    assert isinstance(rec["block"], fxdebug.Stats)
    typo = _instrument(model, capture=["stem.9"])
    with pytest.raises(fxdebug.SelectionError, match="stem.9"):
        _run(typo, *flow_inputs())


def test_argument_that_cannot_be_fixed_runs_eager():
    model = Wrapper().eval()
    x = torch.randn(2, 4)
    instrumented = _instrument(model)
    assert torch.equal(_run(instrumented, x), model(x))
    eager = {entry.path: entry.reason for entry in instrumented.fxdebug_partial.eager}
    assert "argument 'boxes'" in eager["inner"] and "Boxes" in eager["inner"]
    rec = fxdebug.records(instrumented)
    assert rec.keys() == ["inner.fc", "inner", "out.0", "out"]
    assert torch.equal(rec["inner.fc"], model.inner.fc(x * 2))


def test_warning_after_first_run_lists_eager_modules():
    model = Flow().eval()
    instrumented = _instrument(model)
    with pytest.warns(UserWarning, match=r"could not trace Flow as a whole.*\(root\) \(Flow\)"):
        with torch.no_grad():
            instrumented(*flow_inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        with torch.no_grad():
            instrumented(*flow_inputs())


# -- trace(frontend="auto"), the parts on their own, copies ----------------------------------
def test_trace_auto_falls_back_to_parts():
    model = Flow().eval()
    partial = fxdebug.trace(model, frontend="auto")
    assert is_partial(partial) and not hasattr(partial, "fxdebug_recorder")
    notes = partial.fxdebug_partial.notes
    assert notes[0].startswith("fx with symbolic arguments: fxdebug could not trace the root")
    assert any(note.startswith("export: not tried") for note in notes)
    assert torch.equal(_run(partial, *flow_inputs()), model(*flow_inputs()))
    instrumented = _instrument(partial)
    _run(instrumented, *flow_inputs())
    assert fxdebug.records(instrumented).keys() == list(hook_captures(model, *flow_inputs()))


def test_parts_work_alone(tmp_path):
    model = Flow().eval()
    instrumented = _instrument(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = part_inputs(instrumented, *flow_inputs())
    part = traced_parts(instrumented)["block@1"]
    args = inputs["block@1"]
    assert fxdebug.check_equivalence(model.block, part, *args).ok
    with torch.no_grad():
        alone = part(*args)
    assert fxdebug.records(part).keys() == ["block.fc", "block.act", "block"]
    assert not ADDRESS.search(tabular_text(part, *args))
    before = traced_parts(instrumented)["block"]
    assert any(row.mark == "+" and row.key == "block.mul" for row in fxdebug.diff(before, part).rows)
    folder = fxdebug.dump(part, *args, folder=tmp_path / "block_part")
    loaded = import_folder(folder).load()
    with torch.no_grad():
        assert torch.equal(loaded(*args), alone)
    assert os.path.isfile(os.path.join(folder, "run.py"))


def test_deepcopy_and_pickle_keep_working():
    model = Flow().eval()
    instrumented = _instrument(model)
    _run(instrumented, *flow_inputs())
    first = fxdebug.records(instrumented)
    twin = copy.deepcopy(instrumented)
    again = pickle.loads(pickle.dumps(twin))
    for clone in (twin, again):
        out = _run(clone, *flow_inputs())
        assert torch.equal(out, model(*flow_inputs()))
        assert fxdebug.records(clone).keys() == first.keys()
    assert fxdebug.records(instrumented) is first


SCRIPT = textwrap.dedent("""
    import sys, warnings, torch, fxdebug
    from partial_models import Flow, flow_inputs
    torch.manual_seed(0)
    warnings.simplefilter("ignore")
    model = fxdebug.instrument(Flow().eval(), capture="all", grads=True)
    model(*flow_inputs()).sum().backward()
    print(model.fxdebug_partial.summary())
    print(fxdebug.records(model).table())
    for label, part in fxdebug.partial.traced_parts(model).items():
        print(label, part.code)
""")


def test_summary_tables_and_code_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "block@1" in outputs[0] and "fxdebug_runtime_begin_part" in outputs[0]
    assert not ADDRESS.search(outputs[0])


def test_cli_summary_prints_what_ran_eagerly(tmp_path):
    factory = tmp_path / "flow_model.py"
    factory.write_text(textwrap.dedent("""
        from partial_models import Flow, flow_inputs

        def build():
            return Flow(), flow_inputs()
    """))
    result = fxdebug_cli("summary", f"{factory}:build", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "note: fxdebug could not trace Flow as a whole" in result.stdout
    assert "eager modules (run as Python" in result.stdout
    assert "block.fc_1" in result.stdout


def test_whole_model_tools_say_to_use_the_parts(tmp_path):
    model = Flow().eval()
    instrumented = _instrument(model)
    with pytest.warns(UserWarning, match="could not trace Flow as a whole"):
        report = fxdebug.check_equivalence(model, instrumented, *flow_inputs(), localize=True)
    assert report.ok
    assert any("cannot be traced as a whole" in note for note in report.notes)
    with pytest.raises(fxdebug.TraceFailure, match=r"fxdebug.traced_parts\(model\)"):
        fxdebug.dump(instrumented, *flow_inputs(), folder=tmp_path / "whole")
