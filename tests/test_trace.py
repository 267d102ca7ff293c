"""trace(): faithful graphs, stable keys, user source lines, explained failures."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
import torchvision
from torchvision.models.feature_extraction import get_graph_node_names

import fxdebug
from models import ViewAugAssign


def _line_of(function, text: str) -> str:
    """``file.py:LINE`` of the first line of ``function`` containing ``text``."""
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.basename(inspect.getsourcefile(function))}:{start + offset}"


def test_augmented_assignment_on_a_view_stays_in_place():
    model = ViewAugAssign().eval()
    x = torch.randn(3, 4)
    eager = model(x)
    plain = torch.fx.symbolic_trace(model)(x)
    assert not torch.allclose(plain, eager), "plain fx drops the write through the view"
    gm = fxdebug.trace(model)
    assert torch.equal(gm(x), eager)
    assert "+= 100" in gm.code
    assert "*= 2" in gm.code


def test_item_assignment_is_traced():
    class SetItem(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            y[:, 0] = 0.0
            return y

    x = torch.randn(2, 3)
    gm = fxdebug.trace(SetItem())
    assert torch.equal(gm(x), SetItem()(x))
    assert "] = 0.0" in gm.code


def test_keys_are_module_paths_with_local_counters():
    model = torchvision.models.resnet18()
    gm = fxdebug.trace(model)
    keys = [node.meta["fxdebug_key"] for node in gm.graph.nodes]
    assert len(keys) == len(set(keys))
    module_calls = [n.meta["fxdebug_key"] for n in gm.graph.nodes if n.op == "call_module"]
    assert module_calls[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert "layer1.0.relu_1" in module_calls and "layer4.1.relu_1" in module_calls
    # torchvision's feature extraction names the same module calls the same way
    torchvision_names = set(get_graph_node_names(model)[1])
    assert set(module_calls) <= torchvision_names
    assert "flatten" in keys and "layer1.0.iadd" in keys


def test_source_lines_point_at_user_code_not_torch():
    gm = fxdebug.trace(torchvision.models.resnet18())
    sources = {n.meta["fxdebug_key"]: n.meta["fxdebug_source"] for n in gm.graph.nodes}
    resnet_file = inspect.getsourcefile(torchvision.models.resnet.BasicBlock)
    filename, line = sources["layer1.0.conv1"]
    assert filename == resnet_file
    forward_lines, start = inspect.getsourcelines(torchvision.models.resnet.BasicBlock.forward)
    assert forward_lines[line - start].strip() == "out = self.conv1(x)"
    for key, source in sources.items():
        if source is not None:
            assert "torch/fx" not in source[0] and "fxdebug" not in source[0], key


class _RootBranch(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class _IntUse(torch.nn.Module):
    def forward(self, x):
        total = x
        for _ in range(x.shape[0]):
            total = total + 1
        return total


class _LenUse(torch.nn.Module):
    def forward(self, x):
        return x * len(x)


def _helper_with_branch(x):
    if x.max() > 1:
        return x / x.max()
    return x


class _HelperUse(torch.nn.Module):
    def forward(self, x):
        return _helper_with_branch(x) + 1


@pytest.mark.parametrize("model, text, kind, fix", [
    (_RootBranch(), "if x.sum() > 0", "control flow on a traced value", "torch.where"),
    (_IntUse(), "range(x.shape[0])", "a traced value used as a Python number", "submodule"),
    (_LenUse(), "len(x)", "an untraceable builtin", "torch.fx.wrap('len')"),
])
def test_trace_failure_names_line_kind_and_fix(model, text, kind, fix):
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(model)
    failure = info.value
    expected = _line_of(type(model).forward, text)
    assert failure.location.endswith(expected)
    assert failure.kind.startswith(kind)
    assert failure.module_path == ""
    message = str(failure)
    assert expected in message and text in message and fix in message
    assert isinstance(failure.__cause__, Exception)


def test_trace_failure_in_a_helper_function_suggests_fx_wrap():
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(_HelperUse())
    assert info.value.location.endswith(_line_of(_helper_with_branch, "if x.max() > 1"))
    assert "torch.fx.wrap('_helper_with_branch')" in str(info.value)


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.mean() > 0:
            return y
        return -y


class _WithGate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.body = torch.nn.Sequential(torch.nn.ReLU(), _Gate())
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def test_auto_leaf_makes_the_failing_submodule_a_leaf_and_says_so():
    model = _WithGate().eval()
    with pytest.warns(UserWarning, match=r"body\.1 \(control flow on a traced value at .*"
                                         r"test_trace\.py:\d+\)"):
        gm = fxdebug.trace(model)
    assert [path for path, _ in gm.meta["fxdebug_auto_leaves"]] == ["body.1"]
    assert _line_of(_Gate.forward, "if y.mean() > 0") in gm.meta["fxdebug_auto_leaves"][0][1]
    for sign in (1.0, -1.0):  # both branches agree with eager
        with torch.no_grad():
            model.stem.bias.fill_(sign * 10)
            x = torch.randn(5, 4)
            assert torch.equal(gm(x), model(x))
    with pytest.warns(UserWarning, match="body.1"):
        instrumented = fxdebug.instrument(model)
    with torch.no_grad():
        instrumented(x)
    assert "body.1" in fxdebug.records(instrumented)


def test_auto_leaf_off_raises_with_the_leaf_fix():
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(_WithGate(), auto_leaf=False)
    assert info.value.module_path == "body.1"
    assert "leaf_modules=['body.1']" in str(info.value)
    assert info.value.location.endswith(_line_of(_Gate.forward, "if y.mean() > 0"))


def test_leaf_modules_by_path_and_type():
    model = torchvision.models.resnet18()
    gm = fxdebug.trace(model, leaf_modules=["layer1"])
    assert "layer1" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
    gm = fxdebug.trace(model, leaf_modules=[torchvision.models.resnet.BasicBlock])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "layer2.1" in targets and "layer2.1.conv1" not in targets
    with pytest.raises(ValueError, match="Did you mean 'layer1'"):
        fxdebug.trace(model, leaf_modules=["layer01"])


def test_flag_argument_gets_a_concrete_args_fix():
    class Flag(torch.nn.Module):
        def forward(self, x, normalize=True):
            if normalize:
                return x / x.norm()
            return x

    with pytest.raises(fxdebug.TraceFailure, match=r"concrete_args=\{'normalize': True\}"):
        fxdebug.trace(Flag())
    x = torch.randn(3)
    assert torch.equal(fxdebug.trace(Flag(), concrete_args={"normalize": True})(x), Flag()(x))


def test_counter_keys_never_take_a_real_module_name():
    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = torch.nn.ReLU()
            self.relu_1 = torch.nn.Tanh()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.relu_1(self.relu(self.fc(self.relu(x))))

    gm = fxdebug.trace(Named())
    calls = {n.meta["fxdebug_key"]: n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert calls == {"relu": "relu", "fc": "fc", "relu_2": "relu", "relu_1": "relu_1"}


def test_trace_rejects_non_modules():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fxdebug.trace(lambda x: x)


def test_no_warning_when_nothing_became_a_leaf():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = fxdebug.trace(torchvision.models.mobilenet_v3_small())
    assert gm.meta["fxdebug_auto_leaves"] == []


def test_locations_prefer_site_packages_over_the_working_directory(tmp_path, monkeypatch):
    from fxdebug.base.formatting import format_location
    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "pkg").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    assert format_location((str(site / "pkg" / "model.py"), 3)) == "pkg/model.py:3"
    assert format_location((str(tmp_path / "mine.py"), 5)) == "mine.py:5"


class KeywordsFromAValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def call(self, **kwargs):
        return self.fc(kwargs["x"])

    def forward(self, options):
        return self.call(**options)  # `**` on a traced value: fx asks the tracer for keys()


def test_double_star_on_a_traced_value_names_the_real_failure():
    # DistributedDataParallel.forward does `self.module(*inputs, **kwargs)` on what
    # _pre_forward returned; the tracer's own attributes must not shadow Tracer.keys
    with pytest.raises(fxdebug.TraceFailure) as failure:
        fxdebug.trace(KeywordsFromAValue())
    assert "KeyAllocator" not in str(failure.value)
    assert "iteration over a traced value" in str(failure.value)
    lines, start = inspect.getsourcelines(KeywordsFromAValue.forward)
    line = start + next(i for i, text in enumerate(lines) if "**options" in text)
    assert failure.value.location.endswith(f"test_trace.py:{line}")
