"""Code generated on first use: traced and instrumented modules, and the code of a diff.

Generating and compiling the code of a 10k-node graph takes longer than tracing
it, so fxdebug leaves it to the first use. Every way of using the module must
still see the right code: a call, ``gm.forward`` called directly, ``gm.code``,
``print(gm)``, pickling, deep copies; and a diff's code must never show a graph
that changed after the diff compared it.
"""

import copy
import difflib
import io
import operator

import pytest
import torch

import fxdebug
from fxdebug.reporting import diff
from fxdebug.reporting.diff import GraphChangedError


def small_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def eager_code(gm) -> str:
    return gm.graph.python_code(root_module="self").src


@pytest.mark.parametrize("use", ["call", "forward", "code", "print", "pickle", "deepcopy"])
def test_first_use_generates_the_code_of_the_graph(use):
    torch.manual_seed(0)
    model, x = small_model(), torch.randn(3, 4)
    gm = fxdebug.instrument(model)
    if use == "call":
        out = gm(x)
    elif use == "forward":
        out = gm.forward(x)
    elif use == "code":
        assert gm.code == eager_code(gm)
        out = gm(x)
    elif use == "print":
        assert "fxdebug_runtime_capture" in str(gm)
        out = gm(x)
    elif use == "pickle":
        buffer = io.BytesIO()
        torch.save(gm, buffer)
        buffer.seek(0)
        gm = torch.load(buffer, weights_only=False)
        out = gm(x)
    else:
        gm = copy.deepcopy(gm)
        out = gm(x)
    assert torch.equal(out, model(x))
    assert torch.equal(fxdebug.records(gm)["1"], torch.relu(model[0](x)))
    assert type(gm).forward.__code__.co_filename.startswith("/fxdebug-generated/")
    assert gm.code == eager_code(gm)


def test_graph_edited_before_first_use_runs_as_edited():
    """An edit after instrument() and before the first call is in the code that runs."""
    gm = fxdebug.trace(small_model())
    relu = next(n for n in gm.graph.nodes if n.target == "1")
    with gm.graph.inserting_after(relu):
        doubled = gm.graph.call_function(operator.mul, (relu, 2.0))
    relu.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    gm.recompile()
    x = torch.randn(3, 4)
    model = gm.get_submodule("0"), gm.get_submodule("2")
    assert torch.equal(gm(x), model[1](2.0 * torch.relu(model[0](x))))


def test_diff_code_is_the_code_of_both_graphs():
    before = fxdebug.trace(small_model())
    after = fxdebug.instrument(before)
    d = diff(before, after)
    expected = "".join(difflib.unified_diff(eager_code(before).splitlines(keepends=True),
                                            eager_code(after).splitlines(keepends=True),
                                            fromfile="before", tofile="after", n=3))
    assert d.code_diff() == expected and "fxdebug_runtime_capture" in expected


def test_diff_code_refuses_a_graph_changed_after_the_diff():
    before = fxdebug.trace(small_model())
    after = fxdebug.trace(small_model())
    d = diff(before, after)
    relu = next(n for n in after.graph.nodes if n.target == "1")
    relu.target = "0"  # now calls the first Linear: the diff's rows no longer describe it
    with pytest.raises(GraphChangedError, match="changed after fxdebug.diff"):
        d.code_diff()
    code_when_frozen = eager_code(after)
    frozen = diff(fxdebug.reporting.snapshot(before), fxdebug.reporting.snapshot(after))
    relu.target = "1"
    assert frozen.after_code == code_when_frozen != eager_code(after)


class DictInput(torch.nn.Module):
    def forward(self, d):
        return d["a"] * 2 + d["b"]


def test_pytree_specs_exist_before_first_use():
    """A module whose forward flattens its inputs keeps their specs, as torch's recompile sets them."""
    gm = fxdebug.instrument(fxdebug.trace(DictInput(), concrete_args={
        "d": {"a": torch.fx.PH, "b": torch.fx.PH}}))
    spec = gm._in_spec  # read before any use: dump and torch.export read it this way
    d = {"a": torch.randn(2), "b": torch.randn(2)}
    assert torch.equal(gm(d), d["a"] * 2 + d["b"])
    assert gm._in_spec == spec == gm.graph._codegen.pytree_info.in_spec


def test_first_calls_from_two_threads_both_run_the_generated_code():
    """The code is generated once while the other thread's first call waits for it."""
    import sys
    import threading
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: inside the code generation too
    try:
        _two_threads_first_calls()
    finally:
        sys.setswitchinterval(interval)


def _two_threads_first_calls():
    import threading
    for _ in range(5):
        model = torch.nn.Sequential(*[layer for _ in range(50) for layer in (
            torch.nn.Linear(4, 4), torch.nn.ReLU())])
        gm = fxdebug.instrument(model)
        x = torch.randn(3, 4)
        barrier, results, errors = threading.Barrier(2), [], []

        def first_call():
            barrier.wait()
            try:
                results.append(gm(x))
            except Exception as error:  # noqa: BLE001 - reported by the assert below
                errors.append(error)
        threads = [threading.Thread(target=first_call) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors and len(results) == 2, errors
        assert all(torch.equal(out, model(x)) for out in results)
