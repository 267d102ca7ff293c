"""Tracing never shows a wrong value: each model class torch.fx gets silently wrong is traced
faithfully (outputs, captures and gradients equal eager) or runs eagerly / fails naming the line.

Models: tests/trust_models.py. Ground truth: the eager model under the same seed, forward
hooks (``hooks`` fixture), eager ``backward``.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import os
import re
import warnings

import pytest
import torch

import fxdebug
import trust_models as tm

TRACING_GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "tracing.md")


def _line_of(cls, marker: str) -> str:
    """``trust_models.py:N`` of the line of ``cls`` holding ``marker``."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"trust_models.py:{start + offset}"


def _seeded(fn, *args, seed=7):
    torch.manual_seed(seed)
    return fn(*args)


def _instrument_quietly(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = fxdebug.instrument(model, **kwargs)
    return gm, [str(w.message) for w in caught]


def _grads(model, out):
    model.zero_grad(set_to_none=True)
    out.float().sum().backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _assert_same_grads(expected, actual):
    assert expected.keys() == actual.keys()
    for name in expected:
        if expected[name] is None or actual[name] is None:
            assert expected[name] is None and actual[name] is None, name
        else:
            assert torch.equal(expected[name], actual[name]), name


# -- 1. random ops and constructors stay calls ----------------------------------------------
@pytest.mark.parametrize("cls", [tm.RandomOps, tm.ConstructedTensors])
def test_random_ops_and_constructors_equal_eager_on_every_call(cls):
    model = cls()
    x = torch.randn(2, 4)
    gm = fxdebug.trace(model)
    for seed in (1, 2, 2):  # a new seed gives new numbers; the same seed the same; no state kept
        expected = _seeded(model, x, seed=seed)
        assert torch.equal(_seeded(gm, x, seed=seed), expected)
    frozen = [n.target for n in gm.graph.nodes if n.op == "get_attr" and "_tensor_constant" in n.target
              and any(user.target != "numpy" for user in n.users)]  # a numpy array stays an array
    assert frozen == [], f"constructors frozen into constants: {frozen}"


def test_python_values_of_constant_tensors_are_computed_but_random_ones_are_not():
    model = tm.ConstantBranches()
    x = torch.randn(2, 4)
    assert torch.equal(fxdebug.trace(model)(x), model(x))
    with pytest.raises(fxdebug.TraceFailure, match=re.escape(
            _line_of(tm.RandomBranch, "RANDOM BRANCH LINE"))):
        fxdebug.trace(tm.RandomBranch())  # a branch on a random value is never frozen


def test_random_op_in_a_submodule_captured_as_eager_computed_it(hooks):
    model = tm.RandomInside()
    x = torch.randn(3, 4)
    gm = fxdebug.instrument(model)
    for seed in (3, 4):
        out = _seeded(gm, x, seed=seed)
        torch.manual_seed(seed)
        expected = hooks(model, x)
        assert torch.equal(out, _seeded(model, x, seed=seed))
        records = fxdebug.records(gm)
        for key in ("fc", "noise", "out"):
            assert torch.equal(records[key], expected[key]), key


# -- 2. context managers are honoured ----------------------------------------------------------
@pytest.mark.parametrize("cls", [tm.GradModes, tm.NoGradDecorated])
def test_grad_mode_blocks_give_eager_gradients(cls):
    model = cls()
    x = torch.randn(3, 4)
    eager_out = model(x)
    expected = _grads(model, eager_out)
    assert any(g is None for g in expected.values())  # the block really froze something
    for gm in (fxdebug.trace(model), _instrument_quietly(model, grads=True)[0]):
        out = gm(x)
        assert torch.equal(out, eager_out)
        _assert_same_grads(expected, _grads(model, out))
        assert torch.is_grad_enabled()
        with torch.no_grad():  # the block restores the mode it found, not the one at trace time
            assert not gm(x).requires_grad


def test_grad_mode_and_autocast_nodes_survive_save_load_and_retracing():
    for cls, x in ((tm.GradModes, torch.randn(3, 4)), (tm.Autocast, torch.randn(2, 8))):
        model = cls()
        eager_out = model(x)
        expected = _grads(model, eager_out)
        buffer = io.BytesIO()
        torch.save(fxdebug.instrument(model, grads=True), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for gm in (loaded, fxdebug.trace(fxdebug.trace(model))):
            out = gm(x)
            assert torch.equal(out, eager_out)
            _assert_same_grads(expected, _grads(gm, out))


def test_grad_mode_is_restored_when_the_graph_raises():
    model = tm.GradModes()
    gm = fxdebug.trace(model)
    with pytest.raises(RuntimeError):
        gm(torch.randn(3, 5))  # fails inside the no_grad block
    assert torch.is_grad_enabled()
    x = torch.randn(3, 4)
    _assert_same_grads(_grads(model, model(x)), _grads(model, gm(x)))


def test_autocast_block_runs_in_bfloat16_as_in_eager(hooks):
    model = tm.Autocast()
    x = torch.randn(2, 8)
    eager_out = model(x)
    expected = _grads(model, eager_out)
    gm = fxdebug.instrument(model, grads=True)
    out = gm(x)
    assert torch.equal(out, eager_out)
    assert fxdebug.records(gm)["fc"].dtype == torch.bfloat16
    assert torch.equal(fxdebug.records(gm)["fc"], hooks(model, x)["fc"])
    _assert_same_grads(expected, _grads(model, out))


def test_inference_mode_runs_eagerly_with_a_warning_naming_the_line(hooks):
    model = tm.HoldsInference()
    x = torch.randn(2, 4)
    gm, messages = _instrument_quietly(model)
    line = _line_of(tm.InferenceBlock, "INFERENCE LINE")
    assert any("block (torch.inference_mode()" in m and line in m for m in messages), messages
    assert torch.equal(gm(x), model(x))
    assert torch.equal(fxdebug.records(gm)["block"], hooks(model, x)["block"])
    with pytest.raises(fxdebug.TraceFailure, match=re.escape(line)):
        fxdebug.trace(tm.InferenceBlock())


def test_custom_autograd_function_runs_eagerly_so_its_backward_is_kept(hooks):
    """torch.fx would inline a custom Function's forward and drop its backward: the gradients
    of everything before it would silently differ from eager's."""
    model = tm.HoldsCustomFunction()
    x = torch.randn(3, 4)
    expected = _grads(model, _seeded(model, x))
    gm, messages = _instrument_quietly(model, grads=True)
    line = _line_of(tm.ReversesGradient, "FUNCTION LINE")
    assert any("reverse (a custom torch.autograd.Function" in m and line in m for m in messages), \
        messages
    out = _seeded(gm, x)
    assert torch.equal(out, model(x))
    _assert_same_grads(expected, _grads(model, out))
    for key, value in hooks(model, x).items():
        assert torch.equal(fxdebug.records(gm)[key], value), key


def test_custom_autograd_function_in_the_root_forward_names_the_line():
    """Neither fx nor torch.export keeps a custom Function's backward: the root forward runs
    eagerly, and torch's ``Function.apply`` is torch's own again afterwards."""
    apply = vars(torch.autograd.Function)["apply"]
    model = tm.CustomFunctionAtRoot()
    line = _line_of(tm.CustomFunctionAtRoot, "ROOT FUNCTION LINE")
    with pytest.raises(fxdebug.TraceFailure, match=re.escape(line) + ".*custom torch.autograd"):
        fxdebug.trace(model)
    x = torch.randn(3, 4)
    with pytest.raises(fxdebug.TraceFailure, match=re.escape(line) + ".*drops its backward"):
        fxdebug.trace(model, x, frontend="export")
    expected = _grads(model, model(x))
    gm, _ = _instrument_quietly(model)  # the root forward runs eagerly, its modules traced
    out = gm(x)
    assert torch.equal(out, model(x))
    _assert_same_grads(expected, _grads(model, out))
    assert vars(torch.autograd.Function)["apply"] is apply


# -- 4. static forwards and *args ----------------------------------------------------------
def test_static_and_star_args_forwards_trace():
    x = torch.randn(2, 4)
    static = tm.StaticForward()
    assert torch.equal(fxdebug.trace(static)(x), static(x))
    star = tm.StarArgs()
    assert torch.equal(fxdebug.trace(star)(x, x), star(x, x))


def test_partial_instrumentation_runs_static_and_star_args_forwards(hooks):
    model = tm.HoldsOddForwards()
    x = torch.randn(2, 4).abs()
    gm, _ = _instrument_quietly(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = gm(x)
    assert torch.equal(out, model(x))
    assert {"static", "star"} <= set(fxdebug.traced_parts(gm))  # traced, not eager
    records, expected = fxdebug.records(gm), hooks(model, x)
    assert set(expected) <= set(records.keys())
    for key in expected:
        assert torch.equal(records[key], expected[key]), key


# -- 5. attribute writes in forward ------------------------------------------------------
def test_attribute_write_fails_naming_the_line_and_leaves_no_proxy():
    model = tm.CachesSquare()
    line = _line_of(tm.CachesSquare, "CACHE LINE")
    with pytest.raises(fxdebug.TraceFailure, match=re.escape(line)) as info:
        fxdebug.trace(model)
    assert "stored on the module" in str(info.value) and "self.cache = x ** 2" in str(info.value)
    assert "cache" not in vars(model)


def test_attribute_write_in_a_submodule_runs_it_eagerly(hooks):
    model = tm.HoldsCache()
    x = torch.randn(2, 4)
    gm, messages = _instrument_quietly(model)
    assert any("cached (a traced value stored on the module" in m
               and _line_of(tm.CachesSquare, "CACHE LINE") in m for m in messages), messages
    out = gm(x)
    assert isinstance(model.cached.cache, torch.Tensor)  # eager forward stored a real tensor
    assert torch.equal(model.cached.cache, model.pre(x) ** 2)
    assert torch.equal(out, model(x))
    assert torch.equal(fxdebug.records(gm)["cached"], hooks(model, x)["cached"])


def test_traced_value_kept_in_module_state_runs_that_module_eagerly(hooks):
    model = tm.HoldsHistory()
    x = torch.randn(2, 4)
    gm, messages = _instrument_quietly(model)
    assert model.keeps.history == []  # the Proxy fx appended was taken out again
    assert any("keeps (a traced value stored on the module" in m
               and _line_of(tm.KeepsHistory, "HISTORY LINE") in m for m in messages), messages
    out = gm(x)
    assert len(model.keeps.history) == 1 and isinstance(model.keeps.history[0], torch.Tensor)
    assert torch.equal(out, model(x))
    assert torch.equal(fxdebug.records(gm)["keeps"], hooks(model, x)["keeps"])


# -- 10. advice that is right -----------------------------------------------------------
@pytest.mark.parametrize("cls", [tm.Branchy, tm.ShapeBranch])
def test_branch_on_tensor_values_is_never_advised_concrete_args(cls):
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(cls())
    assert "concrete_args" not in str(info.value)
    assert "torch.fx.wrap" in info.value.fix and "submodule" in info.value.fix


def test_branch_on_values_in_a_model_with_submodules_advises_partial_instrumentation(hooks):
    model = tm.Branchy()
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(model)
    assert "fxdebug.instrument(model)" in info.value.fix
    gm, _ = _instrument_quietly(model)  # the advice works: same outputs for every input
    for x in (torch.randn(2, 4), -torch.randn(2, 4)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(gm(x), model(x))
        assert torch.equal(fxdebug.records(gm)["fc"], hooks(model, x)["fc"])


def test_flag_branch_advice_works():
    with pytest.raises(fxdebug.TraceFailure, match=re.escape("concrete_args={'normalize': True}")):
        fxdebug.trace(tm.FlagBranch())
    gm = fxdebug.trace(tm.FlagBranch(), concrete_args={"normalize": True})
    x = torch.randn(3)
    assert torch.equal(gm(x), tm.FlagBranch()(x))


def test_tracing_guide_sample_failure_is_what_fxdebug_prints(tmp_path, monkeypatch):
    text = open(TRACING_GUIDE, encoding="utf-8").read()
    match = re.search(r"```python\n(# branchy\.py\n.*?)```\n.*?```text\n(.*?)```", text, re.S)
    assert match, "docs/tracing.md: the branchy.py sample and its message were not found"
    source, message = match.groups()
    (tmp_path / "branchy.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("branchy", tmp_path / "branchy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(fxdebug.TraceFailure) as info:
        fxdebug.trace(module.Branchy())
    assert " ".join(str(info.value).split()) == " ".join(message.split())


def test_function_apply_is_torchs_again_when_an_export_watch_ends_during_a_trace():
    """One thread watches Function.apply for torch.export; another thread's fx trace starts
    while it does and ends after it: torch's apply is back at the end (no patch left)."""
    import threading

    from fxdebug.tracing.function_watch import custom_functions_applied

    apply = vars(torch.autograd.Function)["apply"]
    started, release = threading.Event(), threading.Event()

    class Blocks(torch.nn.Module):
        def forward(self, x):
            started.set()
            release.wait(10)  # the trace is open until the watch below has ended
            return x * 2

    traced: list = []
    thread = threading.Thread(target=lambda: traced.append(fxdebug.trace(Blocks())))
    with custom_functions_applied() as applied:
        thread.start()
        assert started.wait(10)
    release.set()
    thread.join(10)
    assert applied == [] and len(traced) == 1
    assert vars(torch.autograd.Function)["apply"] is apply
