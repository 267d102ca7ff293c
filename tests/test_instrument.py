"""instrument() and records(): outputs unchanged, captures equal to forward hooks."""

from __future__ import annotations

import pytest
import torch
import torchvision

import fxdebug
from models import LaterInplace, NestedOutputs, Reuse, SeedOneNet

TORCHVISION = {
    "resnet18": (torchvision.models.resnet18, (1, 3, 64, 64)),
    "mobilenet_v3_small": (torchvision.models.mobilenet_v3_small, (1, 3, 64, 64)),
    "vgg11": (torchvision.models.vgg11, (1, 3, 64, 64)),
}
SMALL = {
    "seed001_mynet": (SeedOneNet, (1, 3, 8, 8)),
    "nested_outputs": (NestedOutputs, (2, 8)),
    "reuse": (Reuse, (3, 6)),
    "later_inplace": (LaterInplace, (2, 3, 5, 5)),
}
ALL_MODELS = {**TORCHVISION, **SMALL}


def _build(name):
    factory, shape = ALL_MODELS[name]
    return factory().eval(), torch.randn(shape)


def _flatten(value, prefix="out"):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in value.__dataclass_fields__}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    flat = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}/{key}"))
    return flat


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_outputs_bitwise_equal_to_eager(name):
    model, x = _build(name)
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        expected, got = _flatten(model(x)), _flatten(gm(x))
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_captures_equal_forward_hooks(name, hooks):
    model, x = _build(name)
    truth = hooks(model, x)
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    assert rec.keys() == list(truth), "same keys, same execution order as forward hooks"
    for key, expected in truth.items():
        assert rec[key].shape == expected.shape, key
        assert torch.equal(rec[key], expected), key


def test_reused_module_captured_per_call(hooks):
    model, x = _build("reuse")
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    for key in ("fc", "fc_1", "block", "block_1", "block.0", "block.0_1"):
        assert key in rec, key
    assert not torch.equal(rec["fc"], rec["fc_1"])


def test_nested_outputs_flattened_with_slash_keys():
    model, x = _build("nested_outputs")
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        gm(x)
    keys = fxdebug.records(gm).keys()
    for key in ("enc/0", "enc/1", "mix/value", "mix/gate", "mix/split/low", "mix/split/high"):
        assert key in keys, key


def test_capture_keeps_value_when_a_later_inplace_op_overwrites_it(hooks):
    model, x = _build("later_inplace")
    gm = fxdebug.instrument(model, capture="all")
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    conv_by_hand = torch.nn.functional.conv2d(x, model.conv.weight, model.conv.bias, padding=1)
    assert (conv_by_hand < 0).any(), "the in-place ReLU must have something to destroy"
    assert torch.equal(rec["conv"], conv_by_hand)
    assert rec.record("conv").copied
    act_by_hand = torch.relu(conv_by_hand)
    assert torch.equal(rec["act"], act_by_hand), "captured before the setitem zeroed channel 0"
    assert rec.record("act").copied


@pytest.mark.parametrize("write", [torch.relu_, torch.nn.functional.relu_, lambda h: h.relu_(),
                                   lambda h: h.clamp_(min=0), lambda h: h.data.zero_()])
def test_function_form_inplace_ops_make_the_capture_copy(write):
    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            write(h)
            return h * 1

    model = Writes()
    x = torch.randn(2, 4)
    gm = fxdebug.instrument(model, capture=["lin"])
    with torch.no_grad():
        gm(x)
        expected = model.lin(x)
    assert (expected < 0).any()
    assert torch.equal(fxdebug.records(gm)["lin"], expected)


def test_capture_is_a_view_when_nothing_writes_later():
    model, x = _build("later_inplace")
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        out = gm(x)
    record = fxdebug.records(gm).record("fc")
    assert not record.copied
    assert record.value.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def test_capture_all_matches_node_by_node_interpreter():
    model, x = _build("resnet18")
    traced = fxdebug.trace(model)
    truth = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor) and node.op not in ("get_attr", "output"):
                truth[node.meta["fxdebug_key"]] = value.detach().clone()
            return value

    with torch.no_grad():
        Recording(traced).run(x)
        gm = fxdebug.instrument(model, capture="all")
        gm(x)
    rec = fxdebug.records(gm)
    assert "layer1.0.iadd" in truth and "flatten" in truth
    for key, expected in truth.items():
        assert torch.equal(rec[key], expected), key


def test_depth_include_exclude_and_lists():
    model, x = _build("resnet18")
    with torch.no_grad():
        def keys(**kwargs):
            gm = fxdebug.instrument(model, **kwargs)
            gm(x)
            return fxdebug.records(gm).keys()

        shallow = keys(depth=0)
        assert shallow == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3",
                           "layer4", "avgpool", "fc"]
        assert all(k.count(".") <= 1 for k in keys(depth=1))
        assert keys(capture=["*.conv1"]) == [f"layer{i}.{j}.conv1" for i in range(1, 5)
                                             for j in range(2)]
        assert keys(include=["layer2.0"], capture="all")[0] == "layer2.0.conv1"
        assert "layer2.0.iadd" in keys(include=["layer2.0"], capture="all")
        assert not any(k.startswith("layer3") for k in keys(exclude=["layer3"]))


def test_capture_empty_list_inserts_nothing():
    model, x = _build("reuse")
    gm = fxdebug.instrument(model, capture=[])
    assert "capture" not in gm.code
    with pytest.raises(fxdebug.FxdebugError, match=r"capture=\[\]\) selected no node"):
        fxdebug.records(gm)


@pytest.mark.parametrize("kwargs, message", [
    ({"capture": ["layer1.0.cnv1"]}, "Close keys: 'layer1.0.conv1'"),
    ({"capture": "module"}, "use 'modules', 'all'"),
    ({"include": ["nothing*"]}, "matches no node key"),
    ({"depth": -1}, "non-negative"),
    ({"mode": "tensors"}, "'tensor'"),
])
def test_bad_selection_names_the_problem(kwargs, message):
    model, _ = _build("resnet18")
    with pytest.raises(fxdebug.SelectionError, match=message):
        fxdebug.instrument(model, **kwargs)


def test_missing_key_lookup_suggests_close_keys():
    model, x = _build("resnet18")
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        gm(x)
    with pytest.raises(KeyError, match="layer1.0.conv1"):
        fxdebug.records(gm)["layer1.0.conv"]


def test_stats_mode_matches_stats_of_tensor_mode():
    model, x = _build("mobilenet_v3_small")
    with torch.no_grad():
        tensor_gm = fxdebug.instrument(model)
        tensor_gm(x)
        stats_gm = fxdebug.instrument(model, mode="stats")
        stats_gm(x)
    values, stats = fxdebug.records(tensor_gm), fxdebug.records(stats_gm)
    assert stats.keys() == values.keys()
    assert stats.nbytes == 0 and values.nbytes > 0
    for key in values:
        t = values[key].double()
        s = stats[key]
        assert s.numel == t.numel()
        assert s.mean == pytest.approx(t.mean().item(), rel=1e-4, abs=1e-6), key
        assert s.std == pytest.approx(t.std().item(), rel=1e-4, abs=1e-6), key
        assert (s.min, s.max) == (t.min().item(), t.max().item()), key
        assert s.zeros_pct == pytest.approx(100.0 * (t == 0).double().mean().item()), key
        assert s.nonfinite == 0


def test_stats_count_nonfinite_and_skip_them():
    class Bad(torch.nn.Module):
        def forward(self, x):
            return torch.log(x)

    gm = fxdebug.instrument(Bad(), capture="all", mode="stats")
    gm(torch.tensor([-1.0, 0.0, 1.0, 4.0]))
    s = fxdebug.records(gm)["log"]
    assert s.nonfinite == 2  # log(-1) = nan, log(0) = -inf
    assert (s.min, s.max) == (0.0, pytest.approx(1.3862943611198906))


def test_records_are_of_the_latest_run_only():
    model, _ = _build("reuse")
    gm = fxdebug.instrument(model)
    first = torch.randn(3, 6)
    gm(first)
    rec_first = fxdebug.records(gm)
    gm(torch.randn(3, 6))
    assert fxdebug.records(gm) is not rec_first
    assert not torch.equal(fxdebug.records(gm)["fc"], rec_first["fc"])


def test_instrument_does_not_touch_the_model_or_a_given_graph_module():
    model, x = _build("resnet18")
    traced = fxdebug.trace(model)
    code = traced.code
    gm = fxdebug.instrument(traced)
    assert traced.code == code and "capture" in gm.code
    assert gm.conv1.weight is model.conv1.weight  # parameters are shared, not copied
    plain = torch.fx.symbolic_trace(model)
    gm2 = fxdebug.instrument(plain)
    with torch.no_grad():
        gm2(x)
    assert "layer1.0.conv1" in fxdebug.records(gm2)


def test_submodules_stay_shared_like_torch_fx():
    model = torchvision.models.resnet18()
    gm = fxdebug.instrument(model)
    for path in ("conv1", "layer1.0.conv1", "layer4.1.bn2", "fc"):  # leaf modules, as in torch.fx
        assert gm.get_submodule(path) is model.get_submodule(path), path
    model.eval()  # switching the user's model to eval switches the instrumented one too
    assert not gm.bn1.training
    seen = []
    model.fc.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        gm(torch.randn(1, 3, 64, 64))
    assert seen == [torch.Size([1, 1000])]


def test_tracing_writes_nothing_onto_the_users_model():
    class Constant(torch.nn.Module):
        def forward(self, x):
            return x + torch.tensor([1.0, 2.0])

    model = Constant()
    before = set(vars(model))
    gm = fxdebug.instrument(model)
    assert set(vars(model)) == before
    assert torch.equal(gm(torch.zeros(2)), torch.tensor([1.0, 2.0]))


def test_non_tensor_leaves_are_skipped_with_a_note():
    class SizeOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            return y, y.size(0)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = SizeOut()

        def forward(self, x):
            y, n = self.inner(x)
            return y * n

    gm = fxdebug.instrument(Outer(), capture="all")
    gm(torch.ones(3, 2))
    rec = fxdebug.records(gm)
    assert "inner/0" in rec
    assert any("inner.size" in note and "int is not a tensor" in note for note in rec.notes)
    assert "note: inner.size" in rec.table()


def test_wrong_input_shape_names_the_node():
    model, _ = _build("resnet18")
    gm = fxdebug.instrument(model)
    with pytest.raises(RuntimeError) as info:
        gm(torch.randn(1, 1, 64, 64))
    notes = "\n".join(info.value.__notes__)
    assert "failed at node 'conv1'" in notes
    assert "torchvision/models/resnet.py:" in notes and "x: 1x1x64x64 float32" in notes


def test_wrong_shape_inside_generated_code_names_the_node():
    class AddTwo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 3)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    gm = fxdebug.instrument(AddTwo())
    with pytest.raises(RuntimeError) as info:
        gm(torch.randn(2, 4))
    assert "failed at node 'add'" in "\n".join(info.value.__notes__)
    assert "a: 2x3 float32" in "\n".join(info.value.__notes__)
