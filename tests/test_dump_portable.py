"""Dumped folders sent to a colleague: they run where fxdebug is not installed, and a NaN repro
compares as it should.

Where fxdebug cannot be imported is simulated by a ``PYTHONPATH`` whose first entry is a
package ``fxdebug`` that raises ``ModuleNotFoundError`` on import (the installed fxdebug is
shadowed). Ground truth: the eager model run without fxdebug, ``torch.isnan`` counts, and
``torch.allclose`` / ``torch.equal`` on the values themselves.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.dumping.folder_runtime import compare_tensor, tolerance
from fxdebug.passes import Breakpoint, GradTransform
from subprocesses import fxdebug_cli


@pytest.fixture(scope="module")
def no_fxdebug(tmp_path_factory):
    """Environment for a child in which ``import fxdebug`` fails as if it were not installed."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "fxdebug").mkdir()
    (shadow / "fxdebug" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fxdebug' (shadowed)\", name='fxdebug')\n")
    return dict(os.environ, PYTHONPATH=str(shadow), PYTHONDONTWRITEBYTECODE="1")


def _run_folder(folder, env, *args):
    return subprocess.run([sys.executable, "run.py", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def _imports_fxdebug(module_py) -> bool:
    tree = ast.parse(open(module_py).read())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return any(name.split(".")[0] == "fxdebug" for name in names)


def _expected(folder):
    return torch.load(os.path.join(folder, "expected.pt"), weights_only=True)


def test_a_standalone_dump_runs_where_fxdebug_is_not_installed(tmp_path, no_fxdebug):
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    gm = fxdebug.instrument(model, capture="all", grads=True,
                            passes=[Breakpoint("layer1.0.conv2")])
    # Bit for bit needs MKL reproducible: one thread (run.py sets it again). With 2 threads and
    # no MKL_CBWR, layer4's convolution gradients take one of a few values from run to run,
    # even in one process (tests/test_dump_threads.py checks what run.py says then).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = fxdebug.dump(gm, x, folder=tmp_path / "standalone", standalone=True)
        with torch.no_grad():
            eager = model(x)  # without fxdebug, at the dump's thread count
    finally:
        torch.set_num_threads(threads)
    assert not _imports_fxdebug(os.path.join(folder, "module.py"))
    assert "fxdebug" in gm.code  # the user's module keeps its nodes
    assert torch.equal(_expected(folder)["outputs"]["output"], eager)
    run = _run_folder(folder, no_fxdebug, "--backward")
    assert run.returncode == 0, run.stderr
    assert "ok: same results as when dumped" in run.stdout and "nondeterministic" not in run.stdout
    assert "gradients: 62 equal" in run.stdout


def test_a_dump_keeping_captures_says_it_needs_fxdebug_and_how_to_do_without(tmp_path,
                                                                             no_fxdebug):
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    folder = fxdebug.dump(fxdebug.instrument(model), x, folder=tmp_path / "captures")
    assert _imports_fxdebug(os.path.join(folder, "module.py"))
    readme = open(os.path.join(folder, "README.md")).read()
    assert "install fxdebug where it runs" in readme and "--standalone" in readme
    run = _run_folder(folder, no_fxdebug)
    assert run.returncode == 1
    assert "fxdebug is not installed here" in run.stderr and "--standalone" in run.stderr


def test_the_cli_writes_a_standalone_folder(tmp_path, no_fxdebug):
    result = fxdebug_cli("dump", "torchvision.models:resnet18", "out", "--input", "1,3,32,32",
                         "--standalone", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "capture=none (standalone)" in result.stdout
    run = _run_folder(tmp_path / "out", no_fxdebug)
    assert run.returncode == 0 and "ok: same results" in run.stdout, run.stderr
    kept = fxdebug_cli("dump", "torchvision.models:resnet18", "kept", "--input", "1,3,32,32",
                       cwd=str(tmp_path))
    assert "the folder runs where fxdebug is installed; --standalone" in kept.stdout


def test_a_standalone_assertion_message_still_shows_the_runs_values(tmp_path, no_fxdebug):
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1,
                                                 num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    x, wrong = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 64, 32)
    with pytest.raises(Exception) as eager:  # ground truth: the message eager gives
        model(wrong)
    folder = fxdebug.dump(fxdebug.instrument(model), x, folder=tmp_path / "vit", standalone=True)
    assert not _imports_fxdebug(os.path.join(folder, "module.py"))
    torch.save([wrong], os.path.join(folder, "inputs.pt"))
    run = _run_folder(folder, no_fxdebug)
    assert run.returncode == 1 and str(eager.value) in run.stderr, run.stderr


def test_standalone_refuses_a_node_that_changes_values_and_names_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm = fxdebug.instrument(model, passes=[GradTransform.zero(include=["0.bias"])])
    message = (r"node '0\.bias:edit' \(inserted by pass grad-transform\) calls "
               r"fxdebug.runtime.edited_parameter.*without standalone=True")
    with pytest.raises(fxdebug.FxdebugError, match=message):
        fxdebug.dump(gm, torch.randn(2, 4), folder=tmp_path / "edit", standalone=True)
    assert not os.path.exists(tmp_path / "edit")


# -- a NaN repro: run.py --backward on gradients that hold NaN ---------------------------

def _nan_resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    with torch.no_grad():
        model.layer2[0].bn1.running_var[3] = -2.0  # what a hundred bad steps leave behind
    return model, torch.randn(1, 3, 32, 32)


def test_a_nan_repro_runs_backward_and_compares_nan_by_place(tmp_path, no_fxdebug):
    model, x = _nan_resnet()
    out = model(x)  # ground truth, without fxdebug
    out.sum().backward()
    nan_grads = {name: int(torch.isnan(p.grad).sum()) for name, p in model.named_parameters()}
    assert torch.isnan(out).any() and sum(nan_grads.values())
    model.zero_grad(set_to_none=True)
    folder = fxdebug.dump(model, x, folder=tmp_path / "nan_repro")  # traced, no fxdebug nodes
    expected = _expected(folder)
    assert {name: int(torch.isnan(g).sum()) for name, g in expected["grads"].items()} == {
        name: count for name, count in nan_grads.items()}
    run = _run_folder(folder, no_fxdebug, "--backward")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"output: equal ({int(torch.isnan(out).sum())} NaN at the same places)" in run.stdout
    assert f"fc.weight: equal ({nan_grads['fc.weight']} NaN at the same places)" in run.stdout
    assert "diff nan" not in run.stdout and "atol nan" not in run.stdout
    assert "ok: same results as when dumped" in run.stdout

    # the NaN moved: that is a different result, said as such
    moved = dict(expected, grads=dict(expected["grads"]))
    grad = moved["grads"]["fc.weight"].clone()
    where = torch.isnan(grad).nonzero()[0].tolist()
    grad[tuple(where)] = 0.0
    moved["grads"]["fc.weight"] = grad
    torch.save(moved, os.path.join(folder, "expected.pt"))
    run = _run_folder(folder, no_fxdebug, "--backward")
    assert run.returncode == 1
    assert "fc.weight: DIFFERENT" in run.stdout and "not at the same places" in run.stdout
    assert "FAILED: results differ from when dumped" in run.stdout


@pytest.mark.parametrize("scaled", [False, True])
def test_compare_tensor_agrees_with_allclose_on_the_finite_values(scaled):
    torch.manual_seed(0)
    want = torch.randn(64) * 10
    want[[3, 17]] = float("nan")
    want[5] = float("inf")
    finite = torch.isfinite(want)
    rtol, atol = tolerance(want, scaled)
    assert atol == tolerance(want[finite], scaled)[1]  # NaN and Inf never set the tolerance
    for noise in (0.0, 1e-7, 1e-6, 1e-4, 1e-2):
        have = want + noise * torch.randn(64)
        truth = torch.allclose(have, want, rtol=rtol, atol=atol, equal_nan=True)
        verdict = compare_tensor(want, have, scaled)
        assert verdict.startswith(("equal", "close")) == truth, (noise, verdict)
        assert "nan" not in verdict.split(";")[0]  # the figures are of finite values
        assert "1 Inf" in verdict and "2 NaN" in verdict
    flipped = want.clone()
    flipped[5] = -float("inf")
    assert compare_tensor(want, flipped).startswith("DIFFERENT")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.complex64, torch.complex128])
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_default_tolerances_give_assert_close_verdicts(dtype, factor):
    # the folder's compare_tensor and fxdebug's compare_tensors share one tolerance table:
    # half of it must pass torch.testing.assert_close and twice it must fail, in every dtype
    from fxdebug.equivalence.compare import compare_tensors
    from fxdebug.base.formatting import TOLERANCES
    rtol, atol = TOLERANCES[dtype]
    want = torch.tensor([1.0, 3.0, -2.0], dtype=torch.float64)
    have = want + factor * (atol + rtol * want.abs())
    want, have = want.to(dtype), have.to(dtype)
    try:
        torch.testing.assert_close(have, want)
        truth = True
    except AssertionError:
        truth = False
    assert truth is (factor < 1)  # the shift survives the rounding to dtype
    assert compare_tensor(want, have).startswith(("equal", "close")) is truth
    assert compare_tensors(want, have).ok is truth
