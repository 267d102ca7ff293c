"""fxdebug on a CUDA GPU, each capability against ground truth taken on the same device.

Captures against forward hooks, statistics against float64, gradients against
``retain_grad``, the NaN finder and watch against a planted NaN, saved GPU runs
against a CPU run, the dump's ``run.py``, and what reads numbers back to the
host (counted with ``torch.cuda.set_sync_debug_mode``). Every test skips
without a GPU; ``FXDEBUG_TEST_DEVICE=cpu`` runs the same checks on the CPU (to
check the checks themselves where no GPU is lent).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.runtime import stats_from_summary, summarize
from subprocesses import run_python
from test_stats import ADVERSARIAL, adversarial, assert_stats_equal, truth

DEVICE = os.environ.get("FXDEBUG_TEST_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"

pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_kernels():
    """Deterministic cuDNN and no TF32, restored afterwards, so eager is a bitwise reference."""
    if not ON_GPU:
        yield
        return
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = before


@contextlib.contextmanager
def count_host_syncs():
    """A list that ends up holding one entry per synchronising CUDA call inside the block."""
    found: list[str] = []
    if not ON_GPU:
        yield found
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (torch also warns once that the debug mode is a prototype: not a synchronisation)
    found.extend(str(w.message) for w in caught if "called a synchronizing" in str(w.message))


def resnet(inplace_relu: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    for module in model.modules():
        if isinstance(module, torch.nn.ReLU):
            module.inplace = inplace_relu
    return model.to(DEVICE)


def hooked_outputs(model: torch.nn.Module, x: torch.Tensor, retain_grad: bool = False):
    """Every module call's output, keyed per call like fxdebug (``relu``, ``relu_1``), and the output."""
    seen: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def hook(name):
        def record(module, args, output):
            n = calls.get(name, 0)
            calls[name] = n + 1
            if retain_grad:
                output.retain_grad()
                seen[name if n == 0 else f"{name}_{n}"] = output
            else:
                seen[name if n == 0 else f"{name}_{n}"] = output.detach().clone()
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        out = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out


def test_captures_on_the_gpu_are_what_forward_hooks_see():
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    with torch.no_grad():
        expected, eager = hooked_outputs(model, x)
        gm = fxdebug.instrument(model)
        out = gm(x)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    rec = fxdebug.records(gm)
    assert [k for k in expected if k not in rec] == []
    for key, value in expected.items():
        assert rec[key].device == value.device, key
        torch.testing.assert_close(rec[key], value, rtol=0, atol=0, msg=key)
    # resnet's ReLU(inplace=True) overwrites bn1's output: the capture still holds bn1's
    assert rec.record("bn1").copied and (rec["bn1"] < 0).any()


def test_captures_under_autocast_have_the_dtypes_and_values_eager_has():
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    dtype = torch.float16 if ON_GPU else torch.bfloat16
    gm = fxdebug.instrument(model)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=dtype):
        expected, eager = hooked_outputs(model, x)
        out = gm(x)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    rec = fxdebug.records(gm)
    assert rec["conv1"].dtype == dtype
    for key, value in expected.items():
        assert rec[key].dtype == value.dtype, key
        torch.testing.assert_close(rec[key], value, rtol=0, atol=0, msg=key)


def test_statistics_on_the_gpu_match_float64_and_read_nothing_back_during_forward():
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    tensors = fxdebug.instrument(model, capture="all")
    stats = fxdebug.instrument(model, capture="all", mode="stats")
    with torch.no_grad():
        tensors(x)
        stats(x)  # the first large tensor compiles the statistics kernel
        with count_host_syncs() as syncs:
            stats(x)
    assert syncs == [], f"stats mode synchronised {len(syncs)} time(s) in a forward: {syncs[:3]}"
    captured, summaries = fxdebug.records(tensors), fxdebug.records(stats)
    checked = 0
    for key in captured.keys():
        value = captured[key]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert_stats_equal(summaries[key], truth(value.cpu()), value.dtype)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_statistics_kernel_on_the_gpu_matches_float64(case):
    x = adversarial(case)
    on_device = x.to(DEVICE)
    for one_pass in (True, False):
        summary = summarize(on_device, sync_free=True, one_pass=one_pass)
        assert summary.device == on_device.device
        assert_stats_equal(stats_from_summary(summary), truth(x), x.dtype)


def test_activation_gradients_on_the_gpu_match_retain_grad():
    model = resnet(inplace_relu=False).train()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    gm = fxdebug.instrument(model, grads=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # BatchNorm's running stats
    gm(x).square().sum().backward()
    rec = fxdebug.records(gm)
    grads = {k: rec.grads[k] for k in rec.grads.keys()}
    param_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.load_state_dict(state)
    expected, out = hooked_outputs(model, x, retain_grad=True)
    out.square().sum().backward()
    assert len(expected) > 50 and [k for k in expected if k not in grads] == []
    for key, value in expected.items():
        assert grads[key].device == value.grad.device, key
        torch.testing.assert_close(grads[key], value.grad, msg=key)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param_grads[name], param.grad, msg=name)


class SqrtNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.fc(x).sqrt())  # NaN where fc's output is negative


def test_find_nonfinite_on_the_gpu_names_the_op_that_made_the_nan():
    torch.manual_seed(0)
    model = SqrtNet().to(DEVICE)
    report = fxdebug.find_nonfinite(model, torch.randn(16, 8, device=DEVICE))
    assert report.forward.key == "sqrt" and report.forward.created
    assert all(p.grad is None for p in model.parameters())


def test_watch_on_the_gpu_reads_back_once_per_step_and_replays_the_bad_step():
    torch.manual_seed(0)
    model = SqrtNet().to(DEVICE)
    with torch.no_grad():
        model.fc.bias.fill_(50.0)  # fc's outputs positive: finite steps
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = fxdebug.watch_nonfinite(model)
    x = torch.randn(16, 8, device=DEVICE)
    for step in range(3):
        optimizer.zero_grad()
        with count_host_syncs() as step_syncs:
            watch(x).sum().backward()
        with count_host_syncs() as check_syncs:
            report = watch.check()
        assert report is None, step
        assert step_syncs == [], f"the watched step synchronised: {step_syncs[:3]}"
        assert len(check_syncs) <= 1, f"check() synchronised {len(check_syncs)} times"
        optimizer.step()
    with torch.no_grad():
        model.fc.bias.fill_(-50.0)  # now every output of fc is negative: sqrt makes NaN
    optimizer.zero_grad()
    watch(x).sum().backward()
    report = watch.check()
    assert report is not None and report.forward.key == "sqrt" and report.forward.created


def test_traced_model_on_the_gpu_is_equivalent_and_a_broken_pass_is_localised():
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    traced = fxdebug.trace(model)
    assert fxdebug.check_equivalence(model, traced, x, grads=True).ok
    for node in traced.graph.nodes:  # a wrong pass: layer2.0's first ReLU becomes a sigmoid
        if node.op == "call_module" and node.target == "layer2.0.relu":
            node.op, node.target = "call_function", torch.sigmoid
            break
    traced.recompile()
    report = fxdebug.check_equivalence(model, traced, x)
    assert not report.ok and report.first_divergence.key.startswith("layer2.0")


def test_a_saved_gpu_run_compares_with_a_cpu_run_and_finds_a_changed_weight(tmp_path):
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    cpu_model = resnet().eval().cpu()
    with torch.no_grad():
        gm = fxdebug.instrument(model, folder=str(tmp_path / "gpu"))
        gm(x)
        fxdebug.records(gm)
        cpu_gm = fxdebug.instrument(cpu_model)
        cpu_gm(x.cpu())
    saved = fxdebug.load_records(str(tmp_path / "gpu"))
    assert saved.keys() == fxdebug.records(cpu_gm).keys()
    torch.testing.assert_close(saved["layer1.0.conv1"],
                               fxdebug.records(gm)["layer1.0.conv1"].cpu(), rtol=0, atol=0)
    same = fxdebug.compare_runs(fxdebug.records(cpu_gm), str(tmp_path / "gpu"), rtol=1e-3, atol=1e-4)
    assert same.ok, same.table()
    with torch.no_grad():
        cpu_model.layer3[0].conv1.weight[0] += 0.05
        cpu_gm(x.cpu())
    changed = fxdebug.compare_runs(fxdebug.records(cpu_gm), str(tmp_path / "gpu"), rtol=1e-3,
                                   atol=1e-4)
    assert not changed.ok and changed.first_divergence.key == "layer3.0.conv1"


def _run_py(folder: str, cwd) -> "subprocess.CompletedProcess":
    """``python FOLDER/run.py --backward`` in a fresh process (torch's default settings)."""
    return run_python("import runpy, sys; path = sys.argv[1]; sys.argv = ['run.py', '--backward']; "
                      "runpy.run_path(path, run_name='__main__')", os.path.join(folder, "run.py"),
                      cwd=str(cwd))


def _changed_copy(folder: str, to, name: str) -> str:
    """The dump with the weight ``name`` 1% larger: a real difference run.py must report."""
    shutil.copytree(folder, to)
    weights = torch.load(os.path.join(to, "weights.pt"), weights_only=True)
    weights[name] *= 1.01
    torch.save(weights, os.path.join(to, "weights.pt"))
    return str(to)


def test_a_dumped_gpu_model_runs_and_round_trips(tmp_path):
    # dumped under the fixture's settings (no TF32, deterministic cuDNN), run where they are
    # torch's defaults: run.py sets them again (with TF32 on, conv1's gradient moved by 0.1)
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    folder = fxdebug.dump(fxdebug.instrument(model), x, folder=str(tmp_path / "repro"))
    proc = _run_py(folder, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: same results as when dumped" in proc.stdout, proc.stdout
    first = proc.stdout.splitlines()[0]
    if ON_GPU:
        assert first.startswith("settings applied as when dumped: ") and all(
            s in first for s in ("torch.backends.cudnn.allow_tf32 = False",
                                 "torch.backends.cudnn.deterministic = True")), first
        assert "nondeterministic: the dump ran on CUDA without torch.use_deterministic_algorithms" \
            in proc.stdout, proc.stdout
    changed = _run_py(_changed_copy(folder, tmp_path / "changed", "conv1.weight"), tmp_path)
    assert changed.returncode == 1 and "FAILED" in changed.stdout, changed.stdout + changed.stderr
    assert "conv1.weight: DIFFERENT" in changed.stdout, changed.stdout


def test_a_gpu_dump_with_tf32_on_round_trips_and_a_changed_weight_fails(tmp_path):
    # TF32 for matmuls too (torch's default: off), nondeterministic algorithms allowed
    model = resnet().eval()
    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.fp32_precision)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.deterministic = False
        folder = fxdebug.dump(fxdebug.instrument(model), x, folder=str(tmp_path / "tf32"))
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic) = before[:3]
        torch.backends.cuda.matmul.fp32_precision = before[3]
    proc = _run_py(folder, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: same results as when dumped" in proc.stdout, proc.stdout
    if ON_GPU:
        assert "torch.set_float32_matmul_precision('high')" in proc.stdout.splitlines()[0], proc.stdout
    changed = _run_py(_changed_copy(folder, tmp_path / "changed", "layer4.1.conv2.weight"), tmp_path)
    assert changed.returncode == 1 and "FAILED" in changed.stdout, changed.stdout + changed.stderr
    assert ": DIFFERENT (max abs diff" in changed.stdout, changed.stdout


def test_a_gpu_dump_with_deterministic_algorithms_reproduces_without_widened_tolerances(tmp_path):
    # deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG: run.py sets it too, before CUDA starts
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 12 * 12, 10)).to(DEVICE)
    x = torch.randn(2, 3, 16, 16, device=DEVICE)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        folder = fxdebug.dump(fxdebug.trace(model), x, folder=str(tmp_path / "deterministic"))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if before[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[2]
    proc = _run_py(folder, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "torch.use_deterministic_algorithms(True)" in first, first
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in first, first
    assert "nondeterministic" not in proc.stdout and "DIFFERENT" not in proc.stdout, proc.stdout
    assert "ok: same results as when dumped" in proc.stdout, proc.stdout
