"""Moment summaries (count, mean, M2, min, max, zeros, non-finite, numel, M3, M4): what the
training monitor records, against float64 sums of the finite values computed here.

The CPU's C kernel (one read of the memory) and torch's reductions (``FXDEBUG_STATS_KERNEL=0``)
must both give float64's answer: float64 to rounding up to ``WIDE_MOMENTS_NUMEL`` values, M2,
M3 and M4 within 1e-6 of ``n * sigma**k`` beyond (torch's reductions: M2 within 3e-5); the same bits on any number of threads; pooled
summaries equal to the summary of the values together.
"""

import math

import pytest
import torch

from fxdebug.stats import native as stats_native
from fxdebug.stats.moments import combine_moments, pool_moments, summarize_many, summarize_moments
from fxdebug.stats.native import WIDE_MOMENTS_NUMEL
from test_stats import ADVERSARIAL, adversarial

needs_compiler = pytest.mark.skipif(stats_native._compiler() is None, reason="no C compiler here")


def truth(x: torch.Tensor) -> list[float]:
    d = x.detach().double().reshape(-1)
    finite = d[torch.isfinite(d)]
    mean = finite.mean()
    dev = finite - mean
    return [finite.numel(), mean.item(), dev.square().sum().item(), finite.min().item(),
            finite.max().item(), int((d == 0).sum()), d.numel() - finite.numel(), d.numel(),
            dev.pow(3).sum().item(), dev.pow(4).sum().item()]


def assert_moments(summary: torch.Tensor, x: torch.Tensor, rtol: float) -> None:
    got, want = summary.tolist(), truth(x)
    assert got[0] == want[0] and got[3:8] == want[3:8], (got, want)
    n, sigma = want[0], math.sqrt(want[2] / want[0])
    assert math.isclose(got[1], want[1], rel_tol=rtol, abs_tol=rtol * sigma), ("mean", got, want)
    for column, power in ((2, 2), (8, 3), (9, 4)):
        scale = n * sigma ** power  # M3 cancels: its error is measured against the spread
        assert math.isclose(got[column], want[column], rel_tol=rtol, abs_tol=rtol * scale), (
            column, got, want)


def _cases():
    g = torch.Generator().manual_seed(11)
    yield "normal", torch.randn(300_001, generator=g), 1e-6
    yield "shifted", 1e3 + torch.randn(70_001, generator=g), 1e-6
    yield "log-normal", (3 * torch.randn(200_003, generator=g)).exp(), 1e-6
    yield "bfloat16", (5 + torch.randn(90_000, generator=g)).bfloat16(), 1e-6
    yield "float16", torch.randn(4099, generator=g).half(), 1e-12
    yield "small", torch.tensor([1.0, 2.0, 3.0, 10.0]), 1e-12
    yield "one value", torch.tensor([7.0]), 1e-12
    yield "constant", torch.full((5000,), 3.0), 1e-12
    yield "zeros and outliers", torch.cat([torch.zeros(9000), torch.tensor([1e6, -3e5])]), 1e-12
    yield "at the wide limit", torch.randn(WIDE_MOMENTS_NUMEL, generator=g) * 1e-20, 1e-12
    yield "tiny spread, large mean", 1e4 + 1e-3 * torch.randn(WIDE_MOMENTS_NUMEL + 1, generator=g), 1e-6
    yield "huge values", 1e30 * torch.randn(100_000, generator=g), 1e-6
    yield "float64", torch.randn(5000, generator=g, dtype=torch.float64), 1e-12
    yield "integers", torch.randint(-5, 5, (7000,), generator=g), 1e-12
    for case in ADVERSARIAL:
        yield case, adversarial(case), 1e-6


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize("name,x,rtol", list(_cases()), ids=[c[0] for c in _cases()])
def test_moment_summaries_equal_float64s(name, x, rtol, kernel, monkeypatch):
    monkeypatch.setenv("FXDEBUG_STATS_KERNEL", kernel)
    # without the kernel, M2 is stats mode's (torch's float32 reductions, checked against a
    # bound: within 3e-5 of float64)
    assert_moments(summarize_moments(x), x, rtol if kernel == "1" else max(rtol, 3e-5))


@needs_compiler
def test_the_kernel_applies_to_dense_floats_and_declines_a_nan():
    x = torch.randn(10_000)
    assert stats_native.moments(x) is not None  # the kernel builds here
    assert stats_native.moments(x.bfloat16()) is not None
    assert stats_native.moments(x[::2]) is None and stats_native.moments(x.double()) is None
    x[1234] = float("nan")
    assert stats_native.moments(x) is None  # the exact path takes it (checked above)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [WIDE_MOMENTS_NUMEL - 5, 400 * 2048 + 77])
def test_same_bits_on_any_number_of_threads(dtype, numel):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(2)) * 3 + 7).to(dtype)
    threads = torch.get_num_threads()
    try:
        found = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            found.append(stats_native.moments(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(found[0], other) for other in found[1:]), found


def test_pooled_summaries_equal_the_summary_of_the_values_together():
    g = torch.Generator().manual_seed(4)
    pieces = [torch.randn(3000, generator=g) * 2 + 1, torch.randn(7, generator=g) - 40,
              torch.full((5,), float("nan")), torch.randn(100_000, generator=g),
              torch.tensor([2.5]), torch.randn(64, 64, generator=g)]
    lengths = [3, 2, 1]
    rows = torch.stack([summarize_moments(p) for p in pieces])
    pooled = pool_moments(rows, lengths)
    begin = 0
    for index, length in enumerate(lengths):
        together = torch.cat([p.reshape(-1) for p in pieces[begin:begin + length]])
        assert_moments(pooled[index], together, 1e-6)
        begin += length
    assert torch.equal(pooled[2], rows[5])  # a group of one: that row, bit for bit
    # the same as merging them one by one
    chained = combine_moments(combine_moments(rows[0], rows[1]), rows[2])
    assert torch.allclose(pooled[0], chained, rtol=1e-12, equal_nan=True)
    assert torch.equal(pool_moments(rows, [1] * 6), rows)


def test_many_summaries_from_one_call_equal_each_ones():
    g = torch.Generator().manual_seed(9)
    nan = torch.randn(3000, generator=g)
    nan[7] = float("nan")
    tensors = [torch.randn(5, generator=g), torch.randn(200_000, generator=g).bfloat16(),
               torch.randn(64, 64, generator=g).t(), nan, torch.arange(10), torch.zeros(0),
               torch.randn(70_000, generator=g, dtype=torch.float64), torch.randn(3, 7, generator=g)]
    rows = summarize_many(tensors)
    assert len(rows) == len(tensors)
    for row, tensor in zip(rows, tensors):
        assert torch.equal(row, summarize_moments(tensor)) or (
            torch.isnan(row).any() and torch.allclose(row, summarize_moments(tensor), equal_nan=True))
        if tensor.numel():
            assert_moments(row, tensor, 1e-6)
    if stats_native._compiler() is not None:  # the one call took the dense floats, no other
        found = stats_native.moments_many(tensors)
        assert [f is not None for f in found] == [True, True, False, False, False, False, False,
                                                  True]


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_summaries_of_differences_and_copies_made_while_reading(kernel, monkeypatch):
    """What the monitor's update takes: summarize_many(after, minus=before) is the summary of
    ``after - before`` (the float32 subtraction's values, against float64 sums of them) and
    copy_to= leaves each tensor's values, bit for bit, whatever path summarized it."""
    monkeypatch.setenv("FXDEBUG_STATS_KERNEL", kernel)
    g = torch.Generator().manual_seed(13)
    before = [torch.randn(300_001, generator=g), torch.randn(64, 64, generator=g),
              torch.randn(4099, generator=g), torch.randn(2, 3, 8, 8, generator=g),
              torch.randn(5000, generator=g).bfloat16(), torch.randn(10, generator=g).double()]
    before[3] = before[3].to(memory_format=torch.channels_last)
    after = [b + 1e-3 * torch.randn(b.shape, generator=g).to(b.dtype) for b in before]
    after[2][17] = float("nan")  # the kernel declines: the difference is made, then summarized
    after[1] = after[1].t().contiguous().t()  # other strides than its copy: torch's path
    differences = [a - b for a, b in zip(after, before)]
    rows = summarize_many(after, minus=[b.clone() for b in before])
    for row, difference in zip(rows, differences):  # torch's reductions: M2 within 3e-5
        assert_moments(row, difference, 1e-6 if kernel == "1" else 3e-5)
    kept = [torch.empty_like(t) for t in after]
    rows = summarize_many(after, copy_to=kept)
    for row, tensor, copy in zip(rows, after, kept):
        assert torch.equal(copy.isnan(), tensor.isnan())
        assert torch.equal(torch.nan_to_num(copy), torch.nan_to_num(tensor))
        assert copy.stride() == tensor.stride()
        assert torch.equal(row, summarize_moments(tensor)) or torch.allclose(
            row, summarize_moments(tensor), equal_nan=True)
    if kernel == "1" and stats_native._compiler() is not None:  # which ones the C call took
        found = stats_native.moments_many(after, minus=before)
        assert [f is not None for f in found] == [True, False, False, True, False, False]


@needs_compiler
def test_many_tensors_give_the_same_bits_on_any_number_of_threads():
    """moments_many shares small tensors among the threads and splits the rows of large ones:
    each tensor's summary is the same bits either way."""
    g = torch.Generator().manual_seed(21)
    tensors = [torch.randn(n, generator=g) * 3 + 1 for n in (5, 3000, 70_000, 200_000, 40_000)]
    tensors += [torch.randn(300 * 2048 + 9, generator=g), torch.randn(9000, generator=g).half()]
    threads = torch.get_num_threads()
    try:
        found = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            found.append(torch.stack(stats_native.moments_many(tensors)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(found[0], other) for other in found[1:])
    assert torch.equal(found[0][3], stats_native.moments(tensors[3]))
