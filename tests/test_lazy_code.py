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
    """The code is generated once while the other thread's first call waits for it: the
    thread generating it sees the other one inside ``_realize``, blocked on the lock."""
    for _ in range(3):
        race = _first_calls(overlap=True, patience=10.0)
        assert len(race["generated_by"]) == 1, "the code was generated more than once"
        assert race["waiting_in"] == ["_realize"], (
            "the other thread's first call was never seen waiting while the code was generated: "
            "the threads did not interleave")
        assert not race["errors"] and len(race["results"]) == 2, race["errors"]
        assert all(torch.equal(out, race["eager"]) for out in race["results"])


def test_the_race_check_sees_no_overlap_when_the_calls_run_one_after_the_other():
    race = _first_calls(overlap=False, patience=0.2)
    assert race["waiting_in"] == [] and len(race["results"]) == 2


def _first_calls(overlap: bool, patience: float) -> dict:
    """First calls of a lazily generated module from two threads, released together by a
    barrier (``overlap``) or the second only after the first returned. While one thread
    generates the code (in its module class's ``recompile``), it looks at the other thread's
    stack for up to ``patience`` seconds: ``waiting_in`` lists ``_realize`` if the other was
    seen inside it."""
    import sys
    import threading
    import time
    model = torch.nn.Sequential(*[layer for _ in range(20) for layer in (
        torch.nn.Linear(4, 4), torch.nn.ReLU())])
    gm = fxdebug.instrument(model)
    x = torch.randn(3, 4)
    race: dict = {"generated_by": [], "waiting_in": [], "results": [], "errors": [],
                  "eager": model(x)}
    idents: list[int] = []
    barrier = threading.Barrier(2) if overlap else None
    cls = type(gm)  # this module's own class: patching it touches no other module
    original = cls.recompile

    def recompile(self):
        me = threading.get_ident()
        race["generated_by"].append(me)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline and not race["waiting_in"]:
            for other in idents:
                frame = sys._current_frames().get(other) if other != me else None
                while frame is not None:
                    if frame.f_code.co_name == "_realize":
                        race["waiting_in"].append("_realize")
                        break
                    frame = frame.f_back
            time.sleep(0.001)
        return original(self)

    def first_call():
        idents.append(threading.get_ident())
        if barrier is not None:
            barrier.wait()
        try:
            race["results"].append(gm(x))
        except Exception as error:  # noqa: BLE001 - reported by the caller's assert
            race["errors"].append(error)

    cls.recompile = recompile
    try:
        threads = [threading.Thread(target=first_call) for _ in range(2)]
        for thread in threads:
            thread.start()
            if barrier is None:
                thread.join(timeout=60)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        del cls.recompile
    assert cls.recompile is original
    return race
