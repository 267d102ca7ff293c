"""Nothing fxdebug attaches leaks out of the run it belongs to; messages that lead somewhere.

Ground truth is computed without fxdebug: eager gradients in a child process
that never imports it (or on an untouched copy of the model), forward hooks,
tracemalloc over 200 runs.
"""

from __future__ import annotations

import copy
import gc
import json
import shutil
import sys
import textwrap
import threading
import tracemalloc
import weakref

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.cli import main
from fxdebug.passes import GradTransform
from fxdebug.tracing.locations import is_user_file
from hooks import hook_captures
from subprocesses import run_python


# Defined as source, so a child process that never imports fxdebug builds the same model.
_CONVNET = textwrap.dedent('''\
    import torch

    class ConvNet(torch.nn.Module):
        """Parameters used inside leaf modules (conv, linear) and directly by the graph (scale)."""

        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4 * 8 * 8, 5)
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))

        def forward(self, x):
            h = torch.relu(self.conv(x))
            return (torch.nn.functional.linear(h.flatten(1), self.fc.weight, self.fc.bias) * self.scale
                    + self.fc(h.flatten(1)))
    ''')
_namespace: dict = {}
exec(compile(_CONVNET, "<ConvNet>", "exec"), _namespace)
ConvNet = _namespace["ConvNet"]

_EAGER_GRADS = _CONVNET + textwrap.dedent('''\
    import json, sys
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    assert "fxdebug" not in sys.modules
    print(json.dumps({name: p.grad.flatten().tolist() for name, p in model.named_parameters()}))
    ''')


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _zero_grads(model):
    for p in model.parameters():
        p.grad = None


# -- 5: gradient edits never leak into the user's model ----------------------------------

def test_gradient_edit_on_parameters_stays_inside_the_instrumented_module():
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    edited = ["conv.weight", "fc.bias", "scale"]
    gm = fxdebug.instrument(model, passes=[GradTransform.zero(include=edited)])
    gm(x)  # a forward of gm and no backward
    model(x).square().sum().backward()  # the user's own eager backward
    child = run_python(_EAGER_GRADS)
    assert child.returncode == 0, child.stderr
    eager = {name: torch.tensor(values) for name, values in json.loads(child.stdout).items()}
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad.flatten(), eager[name], msg=name)
        assert grad.abs().sum() > 0, name
    assert all(not p._backward_hooks for p in model.parameters())

    # every backward through gm is edited: retain_graph twice, autograd.grad then backward
    reference = copy.deepcopy(model)
    _zero_grads(model)
    out = gm(x).square().sum()
    out.backward(retain_graph=True)
    first = _grads(model)
    _zero_grads(model)
    out.backward()
    assert _grads(model).keys() == first.keys()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, first[name]), name
        assert (grad.abs().sum() == 0) == (name in edited), name
    out = gm(x).square().sum()
    by_autograd = dict(zip(edited, torch.autograd.grad(out, [model.get_parameter(n) for n in edited],
                                                        retain_graph=True)))
    assert all(g.abs().sum() == 0 for g in by_autograd.values())
    _zero_grads(model)
    out.backward()
    assert all(model.get_parameter(n).grad.abs().sum() == 0 for n in edited)
    # the unedited gradients equal eager ones on an untouched copy
    reference(x).square().sum().backward()
    for name, p in reference.named_parameters():
        if name not in edited:
            torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=name)


def test_gradient_edit_of_an_input_never_hooks_the_callers_tensor():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    gm = fxdebug.instrument(model, capture=[], passes=[GradTransform.zero(include=["input"])])
    x = torch.randn(4, 3, requires_grad=True)
    gm(x)  # a forward of gm and no backward
    model(x).sum().backward()  # the user's own backward: not edited
    reference = x.detach().clone().requires_grad_(True)
    model(reference).sum().backward()
    assert torch.equal(x.grad, reference.grad) and x.grad.abs().sum() > 0
    x.grad = None
    out = gm(x).sum()
    out.backward(retain_graph=True)
    out.backward()  # every backward through gm is edited
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert not x._backward_hooks


# -- 6: no hooks or memory pile up on the user's tensors ---------------------------------

def test_two_hundred_saliency_runs_leave_no_hook_and_no_memory_behind():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2), torch.nn.Identity())
    gm = fxdebug.instrument(model, capture="all", grads=True)
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    model(reference)[0, 1].backward()

    def saliency():
        x.grad = None
        gm(x)[0, 1].backward()

    for _ in range(20):
        saliency()
    first = weakref.ref(fxdebug.records(gm))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            saliency()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert first() is None, "the Records of an earlier run are still alive"
    assert not x._backward_hooks and x.grad_fn is None
    assert grown < 100_000, f"{grown} bytes more after 200 runs"
    assert torch.equal(x.grad, reference.grad)
    rec = fxdebug.records(gm)
    assert sorted(rec.grads.keys()) == ["0", "1", "2", "3", "4", "input"]
    assert torch.equal(rec.grads["input"], reference.grad)


# -- 7: threads ---------------------------------------------------------------------------

def test_each_thread_reads_the_whole_records_of_its_own_run():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(6) for layer in (
        torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU())]).eval()
    with torch.no_grad():
        model[0].weight[:, 1:] = 0  # channel 0 only: batch size shows in every capture
    gm = fxdebug.instrument(model)
    inputs = {batch: torch.randn(batch, 4, 16, 16) for batch in (1, 3)}
    expected = {batch: hook_captures(model, x) for batch, x in inputs.items()}
    failures: list[str] = []
    barrier = threading.Barrier(2)

    def worker(batch):
        try:
            run_trials(batch)
        except Exception as error:  # noqa: BLE001 - a failure, not a hang of the other thread
            failures.append(f"batch {batch}: {type(error).__name__}: {error}")
            barrier.abort()

    def run_trials(batch):
        for trial in range(60):
            barrier.wait(timeout=120)
            gm(inputs[batch])
            rec = fxdebug.records(gm)
            if rec.keys() != list(expected[batch]):
                failures.append(f"batch {batch} trial {trial}: keys {rec.keys()}")
                continue
            for key, value in expected[batch].items():
                if rec[key].shape != value.shape or not torch.allclose(rec[key], value):
                    failures.append(f"batch {batch} trial {trial}: {key} is another run's")
                    break

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(batch,)) for batch in inputs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[:5]


# -- 8: messages that lead somewhere ------------------------------------------------------

def test_records_of_an_empty_selection_say_what_was_selected():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.warns(UserWarning, match=r"exclude=\['\*'\] selects no value"):
        gm = fxdebug.instrument(model, exclude=["*"])
    gm(torch.ones(1, 2))
    rec = fxdebug.records(gm)
    assert rec.keys() == []
    with pytest.raises(KeyError, match=r"exclude=\['\*'\] selects no value.*print_tabular"):
        rec["0"]
    nothing = fxdebug.instrument(model, capture=[])  # no capture pass at all
    nothing(torch.ones(1, 2))
    with pytest.raises(fxdebug.FxdebugError, match=r"capture=\[\]\) selected no node") as info:
        fxdebug.records(nothing)
    assert "2 module call(s) (0, 1)" in str(info.value)
    identity = fxdebug.instrument(torch.nn.Identity())  # a bare model: its output is captured
    x = torch.ones(1)
    identity(x)
    assert torch.equal(fxdebug.records(identity)["output"], x)


def test_records_name_accepted_keys_and_grads_true():
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    gm(torch.ones(1, 2)).sum().backward()
    rec = fxdebug.records(gm)
    with pytest.raises(TypeError, match=r"keys are strings, got int 0.*rec.keys\(\)"):
        rec[0]
    with pytest.raises(KeyError, match=r"grads=True"):
        rec.grads["0"]
    with_grads = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)), grads=True)
    with_grads(torch.ones(1, 2))
    with pytest.raises(KeyError, match=r"no backward has run"):
        fxdebug.records(with_grads).grads["0"]


_FACTORIES = textwrap.dedent("""\
    import torch

    def _settings():
        raise ValueError("no such width: 7")

    def broken():
        return torch.nn.Linear(_settings(), 2)

    def stack():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    """)


def test_cli_factory_error_names_the_users_frames(tmp_path, monkeypatch, capsys):
    (tmp_path / "models.py").write_text(_FACTORIES)
    monkeypatch.chdir(tmp_path)
    assert main(["summary", "models.py:broken", "--input", "1,4"]) == 2
    err = capsys.readouterr().err
    assert "ValueError: no such width: 7" in err and "(raised at models.py:4)" in err
    assert 'models.py", line 7, in broken' in err and 'line 4, in _settings' in err
    assert "fxdebug/cli" not in err.replace("\\", "/")
    assert main(["--traceback", "summary", "models.py:broken", "--input", "1,4"]) == 2
    assert "fxdebug/cli/model_spec.py" in capsys.readouterr().err.replace("\\", "/")


def test_console_scripts_are_never_a_source_location(tmp_path):
    script = shutil.which("fxdebug")
    if script is None:
        pytest.skip("no fxdebug console script installed")
    assert not is_user_file(script)
    assert is_user_file(str(tmp_path / "models.py"))


def test_wrong_input_size_says_which_input_and_which_size():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1,
                                                 num_heads=2, hidden_dim=32, mlp_dim=64)
    gm = fxdebug.instrument(model)
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(AssertionError) as eager:
        model(x)
    with pytest.raises(AssertionError) as traced:
        gm(x)
    assert str(traced.value) == str(eager.value) == "Wrong image height! Expected 32 but got 64!"
    note = " ".join(traced.value.__notes__)
    assert "vision_transformer.py:" in note and "called with x: 1x3x64x64 float32" in note
    assert gm(torch.randn(2, 3, 32, 32)).shape == (2, 1000)
