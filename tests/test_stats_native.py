"""The CPU's C statistics kernel: float64's answer on every float16 and bfloat16 value, the same
bits on any number of threads, a NaN or Inf anywhere sent to the exact path, and the
``torch.compile`` kernel taking over where no C compiler builds it.

Ground truth: the values widened by torch (``.double()``) and reduced in float64.
"""

import json
import math
import os

import pytest
import torch

import fxdebug
from fxdebug.stats import summary as stats, kernel as stats_kernel, native as stats_native
from fxdebug.runtime import stats_batch, stats_from_summary, summarize
from fxdebug.stats.kernel import MIN_NUMEL, NATIVE_MIN_NUMEL, ROW, one_pass_sums
from fxdebug.stats.native import row_sums
from subprocesses import run_python
from test_stats import ADVERSARIAL, adversarial, assert_stats_equal, truth

needs_compiler = pytest.mark.skipif(stats_native._compiler() is None, reason="no C compiler here")


def reference(x: torch.Tensor) -> dict:
    d = x.double().reshape(-1)
    return dict(count=d.numel(), mean=d.mean().item(), m2=(d - d.mean()).square().sum().item(),
                min=d.min().item(), max=d.max().item(), zeros=int((d == 0).sum()))


def assert_part_exact(part: torch.Tensor, x: torch.Tensor) -> None:
    count, mean, m2, low, high, zeros, bound = part.tolist()
    expected = reference(x)
    assert (count, low, high, zeros) == (expected["count"], expected["min"], expected["max"],
                                        expected["zeros"])
    spread = math.sqrt(expected["m2"] / count)  # float32 rows: the mean to 1e-6 of the spread
    assert math.isclose(mean, expected["mean"], rel_tol=1e-7, abs_tol=1e-6 * spread)
    assert bound <= stats_kernel.BOUND_RATIO * m2
    assert math.isclose(m2, expected["m2"], rel_tol=1e-5)


def every_finite(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float type (subnormals and both zeros included), shuffled."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]
    return values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))]


@needs_compiler
@pytest.mark.parametrize("build", ["native", "generic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_widens_exactly(dtype, build, monkeypatch):
    """Built for this CPU (float16 by its F16C instructions on x86) and built for any CPU (by
    integer operations): the same exact widening."""
    if build == "generic":
        monkeypatch.setattr(stats_native, "_FLAGS", (["-O3"],))
        monkeypatch.setattr(stats_native, "_library", [])
    x = every_finite(dtype)
    if dtype == torch.bfloat16:  # its range overflows float32's squares: a part of it
        x = x[x.abs() < 1e10]
    part = row_sums(x, ROW)
    assert part is not None  # the C kernel builds here
    assert_part_exact(part, x)


@needs_compiler
@pytest.mark.parametrize("build", ["native", "generic"])
def test_float16_subnormals_count_under_flushed_denormals(build, monkeypatch):
    """float16's subnormals widen to normal float32 numbers: a CPU set to flush denormals
    (torch.set_flush_denormal) neither zeroes nor counts them as zeros."""
    if build == "generic":
        monkeypatch.setattr(stats_native, "_FLAGS", (["-O3"],))
        monkeypatch.setattr(stats_native, "_library", [])
    x = torch.full((3 * ROW + 5,), 2.0 ** -24, dtype=torch.float16)
    x[::7] = 0
    x[1::7] = -(2.0 ** -20)
    was = torch.set_flush_denormal(True)
    try:
        part = row_sums(x, ROW)
    finally:
        if was:
            torch.set_flush_denormal(False)
    assert part is not None
    assert_part_exact(part, x)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_same_bits_on_any_number_of_threads(dtype):
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(300 * ROW + 1001, generator=generator) * 3 + 7).to(dtype)
    x[::11] = 0
    threads = torch.get_num_threads()
    try:
        parts = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            parts.append(row_sums(x, ROW))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(parts[0], part) for part in parts[1:]), parts
    assert_part_exact(parts[0], x)


def _nonfinite_cases():
    n = 2 * MIN_NUMEL + 13
    for where in (0, 1, ROW, ROW + 31, n - 1):  # a row's shift, inside a row, the last short row
        for value in (float("inf"), float("-inf"), float("nan")):
            yield n, where, value


@needs_compiler
@pytest.mark.parametrize("n,where,value", list(_nonfinite_cases()))
def test_one_nonfinite_value_anywhere_shows_in_the_sums(n, where, value):
    """min and max take the CPU's own min (a NaN may not show there): a NaN or Inf must show
    in the mean, and the summary must then come from the exact path."""
    x = torch.linspace(-2.0, 3.0, n)
    x[where] = value
    part = row_sums(x, ROW)
    assert part is not None and not math.isfinite(part[1].item()), part
    assert_stats_equal(stats_from_summary(summarize(x)), truth(x), x.dtype)


def test_non_dense_or_foreign_tensors_are_not_read():
    x = torch.randn(64, 1024)
    assert row_sums(x.t(), ROW) is None  # its values do not fill numel elements from data_ptr
    assert row_sums(x[:, :512], ROW) is None
    assert row_sums(x.double(), ROW) is None and row_sums(torch.ones(0), ROW) is None
    if stats_native._compiler() is not None:
        assert row_sums(x.to(memory_format=torch.contiguous_format), ROW) is not None
        assert row_sums(torch.randn(2, 8, 64, 64).to(memory_format=torch.channels_last), ROW) \
            is not None


def test_without_a_compiler_the_compiled_kernel_gives_the_same_statistics(monkeypatch):
    """A C compiler that fails: row_sums says why and returns None, one_pass_sums takes the
    torch.compile kernel, and both kernels agree with float64."""
    x = 1000.0 + 1e-3 * torch.randn(2 * MIN_NUMEL + 13, generator=torch.Generator().manual_seed(3))
    native = row_sums(x, ROW)
    monkeypatch.setattr(stats_native, "_library", [])
    monkeypatch.setattr(stats_native, "unavailable_reason", [])
    monkeypatch.setenv("CC", "false")  # exits 1 on every command line
    assert row_sums(x, ROW) is None
    assert stats_native.unavailable_reason and "false could not build it" in \
        stats_native.unavailable_reason[0]
    compiled = one_pass_sums(x)
    assert compiled is not None  # inductor's kernel builds here
    assert_part_exact(compiled, x)
    if native is not None:
        assert_part_exact(native, x)


_THREADS_SCRIPT = """
import json, os, torch
torch.set_num_threads(2)
x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
x.sum(), torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # torch's own OpenMP threads
from fxdebug.stats import native as stats_native
def state():
    return stats_native.openmp_runtimes(), sorted(os.listdir("/proc/self/task"))
before = state()
part = stats_native.row_sums(x)
print(json.dumps(dict(before=before, after=state(), built=part is not None,
                      threaded=getattr(stats_native._library[0], "fxdebug_threaded", None))))
"""


@needs_compiler
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="threads are read from /proc")
def test_the_kernel_runs_on_torchs_openmp_threads_and_starts_none_of_its_own():
    """In a new process: building and calling the kernel maps no second OpenMP runtime and starts
    no thread (its parallel region runs on the pool torch's own ops started)."""
    child = run_python(_THREADS_SCRIPT)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert seen["built"], child.stderr
    assert seen["after"] == seen["before"]  # the same runtimes, the same threads
    assert seen["threaded"] == stats_native.shares_openmp_runtime(seen["before"][0])


@needs_compiler
def test_beside_another_openmp_runtime_the_kernel_takes_one_thread_with_the_same_bits(monkeypatch):
    """Where the process's OpenMP runtime is not one a ``-fopenmp`` build would share (LLVM's,
    Intel's, a renamed libgomp), the kernel is built without OpenMP: the same sums, bit for bit."""
    x = torch.randn(64 * ROW + 7, generator=torch.Generator().manual_seed(4))
    threaded = row_sums(x, ROW)
    monkeypatch.setattr(stats_native, "_library", [])
    monkeypatch.setattr(stats_native, "openmp_runtimes", lambda: ["/opt/llvm/lib/libomp.so"])
    alone = row_sums(x, ROW)
    assert alone is not None and stats_native._library[0].fxdebug_threaded is False
    assert threaded is None or torch.equal(alone, threaded)
    assert_part_exact(alone, x)


@needs_compiler
@pytest.mark.parametrize("size", [NATIVE_MIN_NUMEL, 1500, 5 * ROW + 3, MIN_NUMEL - 1])
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_tensors_too_large_for_the_cpu_batch_take_the_c_kernel_exactly(case, size):
    """From NATIVE_MIN_NUMEL values on, a CPU tensor is summarized at once by the C kernel, not
    batched: float64's answer on the adversarial inputs, called directly and as a capture."""
    x = adversarial(case).reshape(-1)[:size]
    expected = truth(x)
    assert not stats_batch.batchable(x)
    assert row_sums(stats_kernel.dense_memory(x), ROW) is not None  # (a strided one: a copy)
    assert_stats_equal(stats_from_summary(summarize(x)), expected, x.dtype)
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Identity()), mode="stats")
    gm(x)
    assert_stats_equal(fxdebug.records(gm)["0"], expected, x.dtype)


@needs_compiler
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_the_one_call_summary_is_what_the_sums_and_their_checks_give(case):
    """stats_native.summary (the C kernel's sums and stats._from_sums' checks in one call): the
    same bits as row_sums then _from_sums, and None exactly where _from_sums declines."""
    x = stats_kernel.dense_memory(adversarial(case))
    part = row_sums(x, ROW)
    expected = None if part is None else stats._from_sums(part, x.numel())
    got, declined = stats_native.summary(x, stats_kernel.BOUND_RATIO, ROW)
    assert declined == (part is not None and expected is None)
    if expected is None:
        assert got is None
    else:
        assert got is not None and torch.equal(got, expected)
        assert_stats_equal(stats_from_summary(got), truth(x), x.dtype)


_KERNEL_OFF_SCRIPT = """
import torch, fxdebug
from fxdebug.stats import native as stats_native, kernel as stats_kernel
x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), mode="stats")
gm(x)
got = fxdebug.records(gm)["0"]
d = x.relu().double()
print(len(stats_native._library), len(stats_kernel._kernels),
      abs(got.mean - d.mean().item()) < 1e-6 * d.std().item(),
      abs(got.std - d.std().item()) < 1e-5 * d.std().item())
"""


def test_fxdebug_stats_kernel_0_builds_no_kernel_and_gives_the_same_statistics():
    """FXDEBUG_STATS_KERNEL=0: torch's own reductions, neither the C kernel nor the compiled one
    built (in a new process), and the statistics those of float64."""
    child = run_python(_KERNEL_OFF_SCRIPT, FXDEBUG_STATS_KERNEL="0")
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["0", "0", "True", "True"], child.stdout
