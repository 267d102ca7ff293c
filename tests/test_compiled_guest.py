"""fxdebug and torch.compile in the user's process: captures inside compiled graphs, no reset.

Ground truth is computed another way: forward hooks (and tensor hooks) on the
plain eager model, and a counting backend that shows when dynamo compiles.
Every compile here is small (tiny models, resnet18 at 64x64 with
``aot_eager``); one test compiles with inductor.
"""

from __future__ import annotations

import ast
import os
import pathlib
import warnings

import pytest
import torch
import torchvision

import fxdebug

PACKAGE = pathlib.Path(fxdebug.__file__).resolve().parent


class Counting:
    """A dynamo backend that counts the graphs it compiles, then runs them as captured."""

    def __init__(self, inner=None):
        self.graphs = 0
        self.inner = inner

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.inner is None:
            return gm.forward
        return self.inner(gm, example_inputs)


class Printing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = self.a(x)
        print("halfway")  # PRINT_LINE
        return self.b(torch.relu(x))


class SmallCNN(torch.nn.Module):
    """conv -> bn -> in-place relu (a capture before an in-place op), a residual add, a head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))
        h = self.relu(self.conv2(h) + h)
        return self.head(h.mean((2, 3)))


def _line(marker: str) -> int:
    with open(__file__) as handle:
        return next(i for i, line in enumerate(handle, 1) if line.rstrip().endswith(marker)
                    and "def _line" not in line and "marker" not in line)


# -- A: check_compiled leaves the user's compiled functions compiled -----------------------

def test_check_compiled_does_not_recompile_what_the_user_compiled(capsys):
    torch.manual_seed(0)
    model, x = Printing().eval(), torch.randn(3, 4)
    users = Counting()
    compiled = torch.compile(model, backend=users)
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(compiled(x), expected)
    compiled_graphs = users.graphs
    assert compiled_graphs == 2  # before and after the print

    under_test = Counting()
    report = fxdebug.check_compiled(model, x, backend=under_test)
    assert report.ok and report.graphs == 2, report.table()
    (brk,) = report.graph_breaks
    assert brk.source == (os.path.abspath(__file__), _line("# PRINT_LINE"))
    assert "print" in brk.reason
    assert under_test.graphs == 2  # its own graphs: the user's compiled code was not reused

    with torch.no_grad():  # the user's function: still compiled, never compiled again
        assert torch.equal(compiled(x), expected)
    assert users.graphs == compiled_graphs

    # a second check with the same backend reuses what the first compiled inside the model
    again = fxdebug.check_compiled(model, x, backend=under_test)
    assert again.ok and again.graphs == 2 and again.graph_breaks == report.graph_breaks
    assert under_test.graphs == 2
    with torch.no_grad():
        assert torch.equal(compiled(x), expected)
    assert users.graphs == compiled_graphs
    capsys.readouterr()


def test_check_compiled_uses_the_backend_under_test_not_the_users_earlier_compile():
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), torch.randn(2, 4)
    users = Counting()
    torch.compile(model, backend=users)(x)  # compiled before, by a correct backend

    def relu_to_sigmoid(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target in (torch.relu, torch.nn.functional.relu):
                node.target, node.kwargs = torch.sigmoid, {}
        gm.recompile()
        return gm.forward

    report = fxdebug.check_compiled(model, x, backend=relu_to_sigmoid)
    assert not report.ok and report.first_divergence.key == "1", report.table()
    assert users.graphs == 1


def test_package_calls_no_dynamo_reset():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "reset":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


COMPILED_MODULES = ["compiled/check.py", "compiled/instrumenting_backend.py",
                    "compiled/localize.py", "compiled/watched_runs.py",
                    "compiled/dynamo_graphs.py", "instrumenting.py", "runtime/nodes.py",
                    "runtime/compiled_ops.py", "runtime/compiled_grads.py", "runtime/records.py",
                    "runtime/gradients.py", "frontend.py"]


@pytest.mark.parametrize("module", COMPILED_MODULES)
def test_compiled_model_code_names_no_private_torch_name(module):
    """Private torch names live in the runtime/torch_compat package only."""
    tree = ast.parse((PACKAGE / module).read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            private.append(f"from {node.module} ({node.lineno})")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch":
                private.append(f"torch.{'.'.join(reversed(chain))} ({node.lineno})")
    assert private == []


# -- B: instrument / trace of a torch.compile'd module --------------------------------------

def test_instrument_of_a_compiled_module_instruments_the_module_inside(hooks):
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(2, 3, 8, 8)
    expected = hooks(model, x)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = fxdebug.instrument(compiled)
    assert len(caught) == 1
    warning = caught[0]
    assert issubclass(warning.category, fxdebug.EagerFallbackWarning)
    assert issubclass(warning.category, fxdebug.FxdebugWarning)
    text = str(warning.message)
    assert "\n" not in text and "fxdebug.backend" in text and "_orig_mod" in text
    assert warning.filename == __file__  # points at the call
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    assert rec.keys() == list(expected)
    for key, value in expected.items():
        assert torch.equal(rec[key], value), key

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = fxdebug.trace(compiled)
    assert [w.category for w in caught] == [fxdebug.EagerFallbackWarning]
    assert isinstance(traced, torch.fx.GraphModule)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))


# -- C: torch.compile(instrument(model)) records what eager computes ------------------------

def _no_graph_break_output(text: str) -> None:
    for marker in ("Graph break", "graph break", "recompile_limit", "Recompiling"):
        assert marker not in text, text[:2000]


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_compiled_instrumented_resnet18_records_equal_forward_hooks(mode, hooks, capfd):
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)
    expected = hooks(model, x)
    gm = fxdebug.instrument(model, mode=mode)
    counting = Counting(_aot_eager())
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(gm, backend=counting)
        with torch.no_grad():
            out = compiled(x)
            out = compiled(x)  # a second run replaces the first one's records
    assert caught == []
    _no_graph_break_output(capfd.readouterr().err)
    assert counting.graphs == 1  # every capture is inside the one graph
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    rec = fxdebug.records(compiled)
    assert rec.keys() == list(expected)
    for key, value in expected.items():
        if mode == "tensor":
            torch.testing.assert_close(rec[key], value, msg=key)
            assert rec.record(key).copied  # compiled buffers may be reused: always a copy
        else:
            stats = rec[key]
            assert stats.min == pytest.approx(value.min().item(), abs=1e-5), key
            assert stats.max == pytest.approx(value.max().item(), abs=1e-5), key
            assert stats.mean == pytest.approx(value.mean().item(), abs=1e-5), key
    # the two keys an in-place ReLU wrote into: eager's values, not the values before it
    for key in ("relu", "layer1.0.relu"):
        low = rec[key].min() if mode == "tensor" else rec[key].min
        assert float(low) == 0.0


def _aot_eager():
    return torch._dynamo.lookup_backend("aot_eager")


def test_inductor_keeps_every_capture_in_order_and_copies_reused_buffers(hooks, capfd):
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(2, 3, 32, 32)
    expected = hooks(model, x)
    for mode in ("tensor", "stats"):
        gm = fxdebug.instrument(model, capture="all", mode=mode)
        with torch.no_grad():
            gm(x)
        eager = fxdebug.records(gm)
        eager_values = {k: (eager[k].clone() if mode == "tensor" else eager[k])
                        for k in eager.keys() if not eager.record(k).stale}
        compiled = torch.compile(gm)  # inductor: fused kernels, reused buffers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                compiled(x)
        assert [w for w in caught if "fxdebug" in str(w.filename) or
                issubclass(w.category, fxdebug.FxdebugWarning)] == []
        rec = fxdebug.records(compiled)
        assert rec.keys() == eager.keys()  # no capture removed as dead code, in program order
        for key, value in eager_values.items():
            if mode == "tensor":
                torch.testing.assert_close(rec[key], value, msg=key)
            else:
                assert rec[key].min == pytest.approx(value.min, abs=1e-4), key
                assert rec[key].max == pytest.approx(value.max, abs=1e-4), key
                assert rec[key].mean == pytest.approx(value.mean, abs=1e-4), key
        for key, value in expected.items():  # and forward hooks agree
            if mode == "tensor":
                torch.testing.assert_close(rec[key], value, msg=key)
            else:
                assert rec[key].max == pytest.approx(value.max().item(), abs=1e-4), key
    _no_graph_break_output(capfd.readouterr().err)


def _grad_hooks(model, x):
    """Gradients of every module output, by tensor hooks registered from forward hooks."""
    grads, calls, handles = {}, {}, []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, _inputs, output, name=name):
            count = calls.get(name, 0)
            calls[name] = count + 1
            key = name if count == 0 else f"{name}_{count}"
            output.register_hook(lambda grad, key=key: grads.__setitem__(key, grad.clone()))

        handles.append(module.register_forward_hook(hook))
    try:
        model(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad()
    return grads


def test_compiled_grads_equal_eager_gradients(capfd):
    torch.manual_seed(0)
    model, x = SmallCNN().eval(), torch.randn(2, 3, 8, 8)
    expected = _grad_hooks(model, x)
    gm = fxdebug.instrument(model, grads=True)
    compiled = torch.compile(gm, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x).sum().backward()
    assert caught == []
    rec = fxdebug.records(compiled)
    assert sorted(rec.grads.keys()) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(rec.grads[key], value, msg=key)
    _no_graph_break_output(capfd.readouterr().err)


def test_compiled_grads_at_new_shapes_compile_no_frame_of_the_hook_registration():
    """After each graph break, the compiled code calls record_grads on the real tensors: it runs
    eagerly, so dynamo keeps no compiled frame of it (one per activation shape before: five
    for resnet18), and gradients equal tensor hooks' at every input size."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from fxdebug.runtime.gradients import record_grads
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallCNN().eval()
    gm = fxdebug.instrument(model, grads=True)
    compiled = torch.compile(gm, backend="eager")
    for batch, size in ((2, 8), (3, 6), (1, 10)):
        x = torch.randn(batch, 3, size, size)
        expected = _grad_hooks(model, x)
        compiled(x).sum().backward()
        rec = fxdebug.records(compiled)
        assert sorted(rec.grads.keys()) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(rec.grads[key], value, msg=key)
    assert _debug_get_cache_entry_list(record_grads.__code__) == []


def test_compiled_grads_with_fullgraph_are_refused_saying_why():
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)), grads=True)
    with pytest.raises(Exception, match="fxdebug registers the gradient hooks") as failure:
        torch.compile(gm, backend="eager", fullgraph=True)(torch.ones(1, 2))
    assert "fullgraph=True" in str(failure.value)
