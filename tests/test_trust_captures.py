"""Captures that can be trusted: every capture equals a forward hook's ``output.clone()``.

Ground truth is eager PyTorch: forward hooks (``tests/hooks.py``), the eager
outputs and parameter gradients. One small model per class of model:

* writes fx cannot see (a user leaf module, an auto-leaf, a ``torch.fx.wrap``'d
  function, a forward hook, the user's code after the forward);
* one key scheme in every front end (fx, export, part by part), equal to the
  per-call numbering of forward hooks;
* a model without submodules;
* a pass written for plain torch.fx that finds nothing;
* ``Functionalize`` after ``Capture``.
"""

from __future__ import annotations

import contextlib
import io
import operator
import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxdebug
from fxdebug.errors import StaleCaptureError
from fxdebug.passes import Capture, Functionalize
from hooks import hook_captures
from inplace_models import DataZeroed, HarmlessInplaceRelu, ReluThenInplaceAdd


def _assert_captures_equal_hooks(gm, model, x, keys=None):
    """Run ``gm``; outputs equal eager bitwise, every hooked key's capture equals the hook's clone."""
    truth = hook_captures(model, x)
    out = gm(x)
    assert torch.equal(out, model(x))
    rec = fxdebug.records(gm)
    for key in keys or truth:
        assert torch.equal(rec[key], truth[key]), key
    return rec


def _assert_grads_equal_eager(gm, model, x):
    model.zero_grad()
    model(x).sum().backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    gm(x).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, eager[name]), name


# -- item 3: writes fx cannot see ------------------------------------------------------------
class Doubler(torch.nn.Module):
    """Writes its input in place; as a leaf its body is not in the graph."""

    def forward(self, x):
        x.mul_(2)
        return x + 1


class Branchy(torch.nn.Module):
    """A branch on values makes it an auto-leaf; it writes its input in place."""

    def forward(self, x):
        if x.sum() > -1e9:
            x.clamp_(min=0)
        return x * 3


def scale_inplace(x):
    x.mul_(3)
    return x


torch.fx.wrap("scale_inplace")


class Writer(torch.nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.middle = middle
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.middle(self.lin(x)))


class WrappedWriter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return self.out(scale_inplace(h) - 1)


def test_user_leaf_module_writing_its_input_keeps_the_capture_before_the_write():
    model, x = Writer(Doubler()), torch.randn(3, 4)
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[Doubler]))
    rec = _assert_captures_equal_hooks(gm, model, x)
    assert rec.record("lin").copied  # the leaf receives it: a copy
    _assert_grads_equal_eager(gm, model, x)


def test_auto_leaf_writing_its_input_keeps_the_capture_before_the_write():
    model, x = Writer(Branchy()), torch.randn(3, 4)
    with pytest.warns(UserWarning, match="as leaves"):
        gm = fxdebug.instrument(model)
    rec = _assert_captures_equal_hooks(gm, model, x)
    assert rec.record("lin").copied


def test_wrapped_function_writing_its_input_keeps_the_capture_before_the_write():
    model, x = WrappedWriter(), torch.randn(3, 4)
    expected_lin = model.lin(x).detach().clone()
    gm = fxdebug.instrument(model, capture="all")
    assert any(n.target is scale_inplace for n in gm.graph.nodes)
    rec = _assert_captures_equal_hooks(gm, model, x)
    assert torch.equal(rec["lin"], expected_lin)


def test_forward_pre_hook_that_writes_makes_the_call_opaque():
    model, x = Writer(torch.nn.Identity()), torch.randn(3, 4)

    def scale_input(module, args):
        args[0].mul_(5)

    model.out.register_forward_pre_hook(scale_input)
    gm = fxdebug.instrument(model)
    _assert_captures_equal_hooks(gm, model, x, keys=["lin", "middle", "out"])


def test_write_after_the_capture_marks_the_record_stale_and_reading_it_raises():
    model, x = Writer(torch.nn.Identity()), torch.randn(3, 4)
    gm = fxdebug.instrument(model)
    out = gm(x)
    rec = fxdebug.records(gm)
    assert not rec.record("out").stale
    out.detach().add_(1)  # the user's code writes the output after the forward
    assert rec.record("out").stale
    with pytest.raises(StaleCaptureError, match="'out'.*written in place after it was captured"):
        rec["out"]
    assert "stale (written in place after capture, not shown): out" in rec.table()
    assert torch.equal(rec["lin"], model.lin(x))  # the others still read


# -- item 6: one key scheme ------------------------------------------------------------------
class ReluThrice(torch.nn.Module):
    """self.relu, then F.relu, then self.relu twice: module calls relu, relu_1, relu_2."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        x = self.relu(self.lin(x))
        x = F.relu(x - 1)
        x = self.relu(x + 1)
        return self.relu(x * 2)


class ReluThriceBranchy(ReluThrice):
    """The same, with a branch on values in the root: instrumented part by part."""

    def forward(self, x):
        if x.sum() > 1e9:
            return x
        return super().forward(x)


def test_module_call_keys_equal_forward_hook_numbering_in_every_front_end():
    model, x = ReluThrice(), torch.randn(2, 4)
    truth = hook_captures(model, x)
    assert list(truth) == ["lin", "relu", "relu_1", "relu_2"]
    for traced in (fxdebug.trace(model), fxdebug.trace(model, x, frontend="export")):
        gm = fxdebug.instrument(traced)
        rec = _assert_captures_equal_hooks(gm, model, x)
        assert rec.keys() == list(truth), traced.meta.get("fxdebug_frontend")
    partial_model = ReluThriceBranchy()
    partial_model.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note on what ran eagerly
        gm = fxdebug.instrument(partial_model)
        rec = _assert_captures_equal_hooks(gm, partial_model, x)
    assert rec.keys() == list(truth)


def test_a_function_never_takes_a_module_calls_key():
    gm = fxdebug.trace(ReluThrice())
    keys = {n.meta["fxdebug_key"]: n for n in gm.graph.nodes}
    function = [k for k, n in keys.items() if n.target is F.relu]
    assert function == ["relu_fn"]
    assert [k for k, n in keys.items() if n.op == "call_module"] == ["lin", "relu", "relu_1",
                                                                     "relu_2"]


# -- item 7: no submodules -------------------------------------------------------------------
class OnlyFunctions(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2, {"shifted": x + 1}


def test_model_without_submodules_captures_its_output():
    x = torch.randn(3)
    gm = fxdebug.instrument(torch.nn.Identity())
    assert torch.equal(gm(x), x)
    assert fxdebug.records(gm).keys() == ["output"]
    assert torch.equal(fxdebug.records(gm)["output"], x)

    model, x = OnlyFunctions(), torch.randn(3, requires_grad=True)
    gm = fxdebug.instrument(model, grads=True)
    out = gm(x)
    (out[0].sum() + out[1]["shifted"].sum()).backward()
    rec = fxdebug.records(gm)
    eager = model(x)
    assert torch.equal(rec["output/0"], eager[0]) and torch.equal(rec["output/1/shifted"],
                                                                  eager[1]["shifted"])
    assert torch.equal(rec.grads["output/0"], torch.ones(3))


def test_empty_selection_says_so_in_a_warning_and_in_records():
    with pytest.warns(UserWarning, match="selects no value of Identity"):
        gm = fxdebug.instrument(torch.nn.Identity(), exclude=["output"])
    gm(torch.ones(2))
    rec = fxdebug.records(gm)
    assert rec.keys() == []
    with pytest.raises(KeyError, match="selects no value"):
        rec["output"]


# -- item 8: a pass for plain torch.fx that finds nothing ------------------------------------
class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y += x  # RESIDUAL
        return y


def _residual_line() -> int:
    import inspect
    lines, start = inspect.getsourcelines(Residual.forward)
    return start + next(i for i, line in enumerate(lines) if "# RESIDUAL" in line)


def add_to_sub(gm):
    """A pass written against symbolic_trace: it only looks for operator.add."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.add:
            node.target = operator.sub
    return gm


def test_pass_manager_warns_when_a_pass_changed_nothing_and_names_the_iadd_line():
    where = f"test_trust_captures.py:{_residual_line()}"
    with pytest.warns(UserWarning, match=rf"'add_to_sub' changed nothing.*{where}"):
        fxdebug.PassManager([add_to_sub]).run(Residual())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # after Functionalize the pass finds its add
        report = fxdebug.PassManager([Functionalize(), add_to_sub]).run(Residual()).report
    assert report.stages[-1].diff


def test_fxdebug_check_prints_the_warning():
    from fxdebug.cli import main
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["check", f"{__file__}:Residual", "--input", "2x4",
                       "--pass", f"{__file__}:add_to_sub"])
    assert status == 0
    assert "warning: pass 'add_to_sub' changed nothing" in stdout.getvalue()
    assert f"test_trust_captures.py:{_residual_line()}" in stdout.getvalue()


# -- item 9: Functionalize after Capture -----------------------------------------------------
@pytest.mark.parametrize("cls", [HarmlessInplaceRelu, ReluThenInplaceAdd, DataZeroed])
def test_functionalize_after_capture_rewrites_what_it_rewrites_alone(cls):
    model = cls()
    x = torch.randn(2, 3, 8, 8) if cls is HarmlessInplaceRelu else torch.randn(3, 4)
    results = []
    for before in ([], [Capture("modules")], [Capture("all")]):
        gm = fxdebug.trace(model)
        for step in before:
            step(gm)
        functionalize = Functionalize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            functionalize(gm)
        results.append((functionalize.rewritten, [str(u) for u in functionalize.not_rewritten]))
        for warning in caught:  # one line per op left as it is, after the heading
            lines = str(warning.message).splitlines()
            assert len(lines) == 1 + len(functionalize.not_rewritten)
    assert results[0] == results[1] == results[2]
    if cls is not DataZeroed:  # instrument's order: Capture, then the user's Functionalize
        gm = fxdebug.instrument(model, passes=[Functionalize()])
        truth = hook_captures(model, x)
        out = gm(x)
        with torch.no_grad():
            assert torch.equal(out, model(x))
        rec = fxdebug.records(gm)
        for key in truth:
            assert torch.equal(rec[key], truth[key]), key
