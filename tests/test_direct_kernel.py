"""The stats kernel called without dynamo's guard check: same values, only where that is safe.

Ground truth: torch's own reductions in float64 on the same values.
"""

from __future__ import annotations

import pytest
import torch

from fxdebug.runtime import direct_kernel, stats_kernel
from fxdebug.runtime.direct_kernel import DirectKernel


def truth(values: torch.Tensor) -> list[float]:
    v = values.double().reshape(-1)
    return [v.sum().item(), (v * v).sum().item(), v.min().item(), v.max().item(),
            float((v == 0).sum())]


def assert_sums_equal(sums: torch.Tensor, values: torch.Tensor) -> None:
    expected = truth(values)
    got = sums.tolist()
    assert got[2:] == expected[2:]  # min, max, zero count: exact
    for g, e, scale in zip(got[:2], expected[:2], (values.abs().double().sum().item(),
                                                    (values.double() ** 2).sum().item())):
        assert abs(g - e) <= 1e-5 * scale


def sample(rows: int, extra: int = 0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows * stats_kernel.ROW + extra, generator=g)
    values[::7] = 0.0
    return values


def narrow_kernel() -> DirectKernel:
    return stats_kernel._kernel("cpu", False, torch.float32)


@pytest.mark.parametrize("rows,extra", [
    (stats_kernel.MIN_ROWS, 0),                      # smallest direct call
    (1000, 5),                                       # whole rows plus a tail
    (stats_kernel.MAX_ROWS, 0),                      # largest direct call
    (stats_kernel.MAX_ROWS + 900, 3),                # two calls, then a tail
    (stats_kernel.MAX_ROWS + 3, 0),                  # a last chunk too short for the kernel
])
def test_one_pass_sums_equal_torch_at_every_size(rows, extra):
    values = sample(rows, extra)
    assert_sums_equal(stats_kernel.one_pass_sums(values), values)
    assert torch.get_num_threads() in narrow_kernel()._direct  # the direct call was taken


def test_direct_call_equals_torch_compile_bitwise():
    kernel = narrow_kernel()
    values = sample(300).view(300, stats_kernel.ROW)
    stats_kernel.one_pass_sums(values)
    direct = kernel._direct[torch.get_num_threads()]
    through_dynamo = kernel._compiled(values)
    assert torch.equal(direct(values), through_dynamo)


def test_another_thread_count_never_takes_a_direct_call_made_for_this_one():
    # Inductor bakes the thread count into its code: a call with other threads must compile anew.
    values = sample(64)
    stats_kernel.one_pass_sums(values)
    kernel, threads = narrow_kernel(), torch.get_num_threads()
    other = 1 if threads > 1 else 2
    torch.set_num_threads(other)
    try:
        compiled = len(kernel._graphs)
        assert_sums_equal(stats_kernel.one_pass_sums(values), values)
        assert len(kernel._graphs) == compiled + 1 or other in kernel._direct
        assert other in kernel._direct or other in kernel._refused
    finally:
        torch.set_num_threads(threads)


def test_a_graph_that_compiles_again_within_the_range_is_not_called_directly():
    # torch.compile specialises size 1, so the range (1, 64) needs two graphs.
    kernel = DirectKernel(lambda v: v.sum(1).amax(), rows=(1, 64))
    values = torch.randn(8, 4)
    assert kernel(values).item() == values.sum(1).amax().item()
    assert kernel._direct == {} and "compiled again" in kernel._refused[torch.get_num_threads()]
    assert kernel(values).item() == values.sum(1).amax().item()


def test_a_direct_call_that_fails_its_check_is_refused(monkeypatch):
    # Arguments in the wrong order: the direct call raises, torch.compile's call stays.
    original = direct_kernel._argument_recipe
    monkeypatch.setattr(direct_kernel, "_argument_recipe", lambda gm: tuple(reversed(original(gm))))
    kernel = DirectKernel(lambda v: v.sum(1).amax(), rows=(2, 64))
    values = torch.randn(8, 4)
    assert kernel(values).item() == values.sum(1).amax().item()
    assert kernel._direct == {} and "failed" in kernel._refused[torch.get_num_threads()]


def test_no_direct_calls_without_a_range():
    kernel = DirectKernel(lambda v: v.sum(1).amax(), rows=None)
    values = torch.randn(8, 4)
    for _ in range(2):
        assert kernel(values).item() == values.sum(1).amax().item()
    assert kernel._direct == {} and kernel._refused == {}
