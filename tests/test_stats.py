"""Stats mode: every statistic equals the one computed directly, in every dtype, with NaN and Inf.

Ground truth is computed another way: ``torch.mean / std / amin / amax`` over the
finite values in float64, ``(t == 0).sum()`` and ``(~torch.isfinite(t)).sum()``.
"""

import json
import math
import textwrap

import pytest
import torch

import fxdebug
from subprocesses import run_python
from fxdebug.runtime import stats_from_summary, summarize
from fxdebug.stats import kernel as stats_kernel
from fxdebug.stats.kernel import MIN_NUMEL, one_pass_sums


class Copy(torch.nn.Module):
    def forward(self, x):
        return x.clone()


class AddOneInPlace(torch.nn.Module):
    def forward(self, x):
        return x.add_(1)


def truth(t: torch.Tensor) -> dict:
    finite = t[torch.isfinite(t)].double()
    return dict(mean=torch.mean(finite).item(), std=torch.std(finite).item(),
                min=torch.amin(finite).item(), max=torch.amax(finite).item(),
                zeros_pct=100.0 * int((t == 0).sum()) / t.numel(),
                nonfinite=int((~torch.isfinite(t)).sum()), numel=t.numel())


def assert_stats_equal(stats, expected, dtype, may_decline=False):
    """``stats`` equal float64's ``expected``; with ``may_decline``, a mean or std may be NaN
    instead (a path that declines to give an imprecise number)."""
    rtol = 1e-5
    scale = max(abs(expected["mean"]), 0.0 if math.isnan(expected["std"]) else expected["std"],
                1e-30)
    if not (may_decline and math.isnan(stats.mean)):
        assert math.isclose(stats.mean, expected["mean"], rel_tol=rtol, abs_tol=rtol * scale), \
            stats
    if math.isnan(expected["std"]):  # one finite value: torch.std says NaN, and so do we
        assert math.isnan(stats.std), stats
    elif not (may_decline and math.isnan(stats.std)):
        assert math.isclose(stats.std, expected["std"], rel_tol=1e-4), stats
    assert stats.min == expected["min"] and stats.max == expected["max"], stats
    assert stats.zeros_pct == expected["zeros_pct"], stats
    assert stats.nonfinite == expected["nonfinite"] and stats.numel == expected["numel"], stats


def sample(dtype, shape=(4, 8, 16, 16), mean=0.5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=generator) * 3 + mean).to(dtype)
    flat = t.view(-1)
    flat[::17] = 0
    flat[5], flat[100], flat[200] = float("nan"), float("inf"), float("-inf")
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 8, 16, 16), (4, 8, 64, 64)], ids=["small", "one-pass"])
def test_stats_mode_matches_direct_computation(dtype, shape):
    x = sample(dtype, shape)
    gm = fxdebug.instrument(torch.nn.Sequential(Copy()), mode="stats")
    gm(x)
    stats = fxdebug.records(gm)["0"]
    assert_stats_equal(stats, truth(x), dtype)
    assert stats.nonfinite == 3


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_both_paths_match(dtype, sync_free, nonfinite):
    x = sample(dtype, mean=2.0)
    if not nonfinite:
        x = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)
    assert_stats_equal(stats_from_summary(summarize(x, sync_free=sync_free)), truth(x), dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_one_pass_kernel_matches_direct_computation(sync_free, layout):
    """Tensors of MIN_NUMEL values and more take the compiled one-pass kernel."""
    x = sample(torch.float32, (4, 8, 64, 64), mean=2.0)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(1, 3)
    assert x.numel() >= MIN_NUMEL and one_pass_sums(x) is not None  # the kernel builds here
    assert_stats_equal(stats_from_summary(summarize(x, sync_free=sync_free)), truth(x), x.dtype)


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("sync_free", [False, True])
def test_std_is_what_tensor_std_says(sync_free, one_pass):
    """std is Bessel-corrected, as tensor.std(): 80 values (not 0.63% lower), and a kernel-sized tensor."""
    for x in (torch.randn(80, generator=torch.Generator().manual_seed(3)),
              torch.randn(2 * MIN_NUMEL, generator=torch.Generator().manual_seed(4))):
        stats = stats_from_summary(summarize(x, sync_free=sync_free, one_pass=one_pass))
        assert math.isclose(stats.std, x.double().std().item(), rel_tol=1e-6), (stats, x.std())
    assert math.isnan(stats_from_summary(summarize(torch.tensor([2.0]))).std)  # as torch.std
    gm = fxdebug.instrument(torch.nn.Sequential(Copy()))
    gm(x := torch.randn(4, 20, generator=torch.Generator().manual_seed(5)))
    row = fxdebug.records(gm).table(wide=True).splitlines()[2].split()
    assert float(row[5]) == pytest.approx(x.std().item(), rel=1e-3)  # the table's std column


@pytest.mark.parametrize("size", [10_000, 2 * MIN_NUMEL])
@pytest.mark.parametrize("sync_free", [False, True])
def test_large_mean_small_spread_does_not_cancel(sync_free, size):
    x = 1000.0 + 1e-3 * torch.randn(size, generator=torch.Generator().manual_seed(1))
    stats = stats_from_summary(summarize(x, sync_free=sync_free))
    assert math.isclose(stats.std, torch.std(x.double()).item(), rel_tol=1e-3)


@pytest.mark.parametrize("repeat", [1, MIN_NUMEL])
def test_huge_finite_values_do_not_overflow(repeat):
    x = torch.tensor([3e38, -3e38, 1e38], dtype=torch.float32).repeat(repeat)
    for sync_free in (False, True):
        stats = stats_from_summary(summarize(x, sync_free=sync_free))
        assert math.isclose(stats.std, torch.std(x.double()).item(), rel_tol=1e-5)
        assert stats.nonfinite == 0


def test_all_nonfinite_and_integer_tensors():
    stats = stats_from_summary(summarize(torch.full((3,), float("nan"))))
    assert stats.nonfinite == 3 and math.isnan(stats.mean)
    ints = torch.tensor([0, 2, 4, 0])
    assert_stats_equal(stats_from_summary(summarize(ints)), truth(ints.double()), torch.int64)


def test_same_tensor_rewritten_in_place_is_summarized_again(hooks):
    # "1" returns the very tensor "0" returned, after an in-place write: its version differs,
    # so its statistics must not be reused from "0".
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), AddOneInPlace())
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = hooks(model, x)
        gm = fxdebug.instrument(model, mode="stats")
        gm(x)
    rec = fxdebug.records(gm)
    for key in ("0", "1"):
        assert_stats_equal(rec[key], truth(expected[key]), torch.float32)
    assert rec["0"].mean != rec["1"].mean


def test_container_output_equals_last_child():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    gm = fxdebug.instrument(model, mode="stats")
    x = torch.randn(5, 4)
    gm(x)
    rec = fxdebug.records(gm)
    assert rec["0"] == rec["0.1"]
    assert_stats_equal(rec["0"], truth(model(x).detach()), torch.float32)


def test_accumulated_statistics_equal_those_of_all_runs_together():
    gm = fxdebug.instrument(torch.nn.Sequential(Copy()), mode="stats")
    fxdebug.accumulate_stats(gm)
    runs = [sample(torch.float32, shape=(3, 80), mean=m, seed=m) for m in (0, 5, -2)]
    for x in runs:
        gm(x)
    rec = fxdebug.records(gm)
    assert rec.runs == 3
    assert_stats_equal(rec["0"], truth(torch.cat(runs)), torch.float32)
    assert rec.table().splitlines()[2].startswith("0 ")


@pytest.mark.parametrize("sync_free", [False, True])
def test_one_pass_kernel_in_chunks(monkeypatch, sync_free):
    """Tensors longer than a chunk are summarized per chunk, the chunks merged (Chan's formula)."""
    monkeypatch.setattr(stats_kernel, "_CHUNK", MIN_NUMEL)
    monkeypatch.setattr(stats_kernel, "MAX_ROWS", stats_kernel.MIN_ROWS + 1)
    x = sample(torch.float32, (5, 8, 64, 64), mean=2.0)
    if not sync_free:
        x = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)
    assert_stats_equal(stats_from_summary(summarize(x, sync_free=sync_free)), truth(x), x.dtype)


def adversarial(case: str) -> torch.Tensor:
    """Inputs that break a naive variance: each a few ROWs long, none a multiple of a vector width."""
    g = torch.Generator().manual_seed(3)
    n = 2 * MIN_NUMEL + 13
    near = 1000.0 + 1e-3 * torch.randn(n, generator=g)  # mean 1e6 times the spread
    if case == "large-mean-small-spread":
        return near
    if case == "large-mean-eager-sized":
        return near[:10_007]
    if case == "negative-large-mean":
        return -3e4 + 0.05 * torch.randn(n, generator=g)
    if case == "bfloat16":
        return (100.0 + torch.randn(n, generator=g)).bfloat16()
    if case == "float16":
        return (300.0 + 0.1 * torch.randn(n, generator=g)).half()
    if case == "transposed":
        return (1000.0 + 1e-3 * torch.randn(97, 701, generator=g)).t()
    if case == "strided":
        return near[::3]
    if case == "nonfinite":
        x = near.clone()
        x[[0, 1, 5000, n - 1]] = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")])
        return x
    if case == "shifts-far-from-values":  # each row's first value (the kernel's shift) an outlier
        x = torch.ones(n)
        x[::stats_kernel.ROW] = 1e4
        x[stats_kernel.ROW // 2::stats_kernel.ROW] = 1e4
        return x
    if case == "near-overflow":
        return 3e38 - 1e33 * torch.rand(n, generator=g)
    raise ValueError(case)


ADVERSARIAL = ["large-mean-small-spread", "large-mean-eager-sized", "negative-large-mean", "bfloat16",
               "float16", "transposed", "strided", "nonfinite", "shifts-far-from-values",
               "near-overflow"]


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial_inputs_match_float64_on_every_path(case):
    """Compiled kernel and torch's reductions, read at once or on the device: float64's answer."""
    x = adversarial(case)
    expected = truth(x)
    for one_pass in (True, False):
        for sync_free in (False, True):
            stats = stats_from_summary(summarize(x, sync_free=sync_free, one_pass=one_pass))
            assert_stats_equal(stats, expected, x.dtype)


@pytest.mark.parametrize("wide", [False, True])
def test_compiled_kernel_keeps_a_large_mean_small_spread_exact(wide):
    """The kernel's own M2, with no fallback: within 1e-5 of float64 whatever the reduction order."""
    x = adversarial("large-mean-small-spread")
    part = one_pass_sums(x, wide=wide)
    assert part is not None  # the kernel builds here
    count, mean, m2, low, high, zeros, bound = part.tolist()
    d = x.double()
    assert count == x.numel() and low == d.min().item() and high == d.max().item() and zeros == 0
    assert math.isclose(mean, d.mean().item(), rel_tol=1e-9)
    assert math.isclose(m2, (d - d.mean()).square().sum().item(), rel_tol=1e-5)
    assert bound <= stats_kernel.BOUND_RATIO * m2  # stats mode takes it as it is


def test_compiled_kernel_gives_the_same_bits_on_any_number_of_threads():
    """The CPU kernel's rows are summed in a fixed order whatever the thread count (only the pass
    over the values is split among threads, by whole rows), and equal float64's statistics."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1000 * stats_kernel.ROW + 77, generator=generator) * 0.25 + 40.0
    x[::13] = 0
    threads = torch.get_num_threads()
    try:
        parts = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            parts.append(one_pass_sums(x))
    finally:
        torch.set_num_threads(threads)
    assert parts[0] is not None  # the kernel builds here
    assert all(torch.equal(parts[0], part) for part in parts[1:]), parts
    assert_stats_equal(stats_from_summary(summarize(x)), truth(x), x.dtype)


_TRITON_CASES = textwrap.dedent("""
    import os, sys
    import torch
    from fxdebug.runtime import stats_from_summary
    from fxdebug.stats.triton_kernel import gpu_summary
    from test_stats import ADVERSARIAL, adversarial, assert_stats_equal, sample, truth
    cases = [(case, adversarial(case)) for case in ADVERSARIAL]
    cases += [("nan-inf-zeros " + str(dtype), sample(dtype)) for dtype in
              (torch.float32, torch.float16, torch.bfloat16, torch.float64)]
    cases += [("all NaN", torch.full((7,), float("nan"))), ("one value", torch.tensor([2.5]))]
    for name, x in cases:
        summary = gpu_summary(x)
        assert summary is not None, "gpu_summary did not run under TRITON_INTERPRET=1"
        stats = stats_from_summary(summary)
        if name == "all NaN":
            assert stats.nonfinite == 7 and stats.numel == 7, stats
        else:
            assert_stats_equal(stats, truth(x), x.dtype)
        again = gpu_summary(x)
        assert torch.equal(summary, again) or summary.isnan().equal(again.isnan()), name  # fixed order
        print("ok", name)
""")


def test_triton_kernels_match_float64_under_the_interpreter():
    """The CUDA path's two Triton kernels, run on the CPU by Triton's interpreter."""
    pytest.importorskip("triton")
    proc = run_python(_TRITON_CASES, TRITON_INTERPRET="1")  # read as triton is imported
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == len(ADVERSARIAL) + 6, proc.stdout


_STATS_WITH_WARNINGS_AS_ERRORS = """\
import json, sys, warnings
warnings.simplefilter("error")  # every warning an error, as under python -W error
import torch, fxdebug
from fxdebug.stats import native as stats_native
if sys.argv[1] == "compiled":  # as where no C compiler builds the CPU kernel
    stats_native._library.append(None)
x = torch.linspace(-3.0, 5.0, 1 << 16).reshape(1, 1, 256, 256)
gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), mode="stats")
gm(x)
stats = fxdebug.records(gm)["0"]
print(json.dumps(dict(mean=stats.mean, min=stats.min, max=stats.max,
                      inductor="torch._inductor.compile_fx" in sys.modules,
                      native=stats_native._library[0] is not None)))
"""


@pytest.mark.parametrize("kernel", ["native", "compiled"])
def test_compiled_kernel_raises_no_warning_of_torch_on_first_use(kernel):
    # A fresh process, so the kernel's first compile imports inductor here: torch 2.11 raises
    # DeprecationWarnings about its own code on that import, which the user must not see.
    # The C kernel, where it builds, needs no inductor at all.
    child = run_python(_STATS_WITH_WARNINGS_AS_ERRORS, kernel)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout)
    native, inductor = got.pop("native"), got.pop("inductor")
    if kernel == "compiled" or not native:
        assert inductor and not native  # the compiled kernel ran, not torch's reductions
    else:
        assert not inductor  # the C kernel ran; torch.compile was never needed
    expected = truth(torch.linspace(-3.0, 5.0, 1 << 16).relu())
    assert got == pytest.approx({key: expected[key] for key in got}, abs=1e-5)
