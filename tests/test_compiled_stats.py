"""Stats mode under torch.compile: statistics computed by graph ops, equal to float64's answer.

Ground truth: eager forward hooks clone every module's output, and its statistics are
taken in float64 over the finite values (tests/test_stats.py's ``truth``). Private torch
names (dynamo's compile counter) only count graphs here.
"""

import math
import warnings

import pytest
import torch
import torch._dynamo.testing

import fxdebug
from fxdebug.runtime import stats_from_summary
from fxdebug.runtime.compiled_stats import FLOAT32_MIN_NUMEL, graph_summary
from test_stats import ADVERSARIAL, adversarial, assert_stats_equal, truth


class LargeMean(torch.nn.Module):  # a mean a million times the spread
    def forward(self, x):
        return 1000.0 + 1e-3 * x


class NearOverflow(torch.nn.Module):  # float32 values near 3e38: their squares overflow float32
    def forward(self, x):
        return 3e38 - 1e33 * torch.sigmoid(x)


class NonFinite(torch.nn.Module):  # NaN (log of a negative), -Inf (log 0), Inf (1 / 0)
    def forward(self, x):
        return torch.log(x) + 1.0 / (x > -0.5).float()


class HalfPrecision(torch.nn.Module):
    def forward(self, x):
        return (100.0 + x).to(torch.bfloat16)


class Indices(torch.nn.Module):
    def forward(self, x):
        return x.argmax(-1)


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.relu = torch.nn.ReLU(inplace=True)
        self.large = LargeMean()
        self.over = NearOverflow()
        self.bad = NonFinite()
        self.bf16 = HalfPrecision()
        self.indices = Indices()

    def forward(self, x):
        y = self.conv(x)
        z = self.relu(self.bn(y))
        return (self.large(y), self.over(y), self.bad(y), self.bf16(y), self.indices(y),
                z.mean((2, 3)))


def hooked_truth(model, x):
    """Every module's output, cloned by a forward hook in an eager run: its float64 statistics."""
    return {name: truth(value) for name, value in hooked_outputs(model, x).items()}


def hooked_outputs(model, x):
    """Every module's output, cloned by a forward hook in an eager run."""
    outputs = {}
    handles = [m.register_forward_hook(lambda m, a, o, name=name: outputs.update({name: o.clone()}))
               for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def assert_records_match(records, expected):
    assert set(expected) <= set(records.keys()), (records.keys(), list(expected))
    for key, want in expected.items():
        record = records.record(key)
        assert_stats_equal(record.stats, want, record.dtype)


def inputs(seed):  # activations of 2 * 8 * 22 * 22 values: the float32 sums, and their fallback
    return torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(seed))


def test_inductor_statistics_equal_float64_with_no_graph_break_and_no_python_per_capture():
    model = Branches().eval()
    gm = fxdebug.instrument(model, mode="stats")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(gm, backend=counter, fullgraph=True)
    held = []
    for seed in (1, 2):  # records after each call are that call's values
        x = inputs(seed)
        with torch.no_grad():
            compiled(x)
        held.append((fxdebug.records(gm), hooked_truth(model, x)))
    for records, expected in held:
        assert type(records).__name__ == "CompiledRecords"
        assert_records_match(records, expected)
    assert counter.frame_count == 1  # one graph, compiled once: no break, no recompile
    ops = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes}
    assert not any("fxdebug.capture" in op for op in ops), ops  # no op per capture
    eager = fxdebug.instrument(model, mode="stats")
    with torch.no_grad():
        eager(inputs(2))
    assert held[1][0].keys() == fxdebug.records(eager).keys()  # the same keys, in eager's order


def test_records_not_read_before_the_next_call_keep_their_own_call():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), LargeMean()).eval()
    gm = fxdebug.instrument(model, mode="stats")
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    first, second = torch.randn(3, 6), 5 * torch.randn(3, 6)
    compiled(first)
    unread = fxdebug.records(gm)  # not read until the next call ran
    compiled(second)
    assert_records_match(fxdebug.records(gm), hooked_truth(model, second))
    assert_records_match(unread, hooked_truth(model, first))


class Breaks(torch.nn.Module):
    def forward(self, x):
        torch._dynamo.graph_break()
        return x * 2


class Empty(torch.nn.Module):  # graph ops do not summarize an empty tensor: fxdebug::capture does
    def forward(self, x):
        return x[..., :0]


def test_graph_break_and_values_graph_ops_cannot_summarize_keep_eager_order_and_values():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Breaks(), NonFinite(), Empty(),
                                torch.nn.Flatten(0)).eval()
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[Breaks]), mode="stats")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(gm, backend=counter)
    frames = []
    torch._dynamo.reset()
    getattr(torch._dynamo.utils, "warn_once_cache", set()).clear()  # (dynamo warns once)
    for seed in (3, 4):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(x)
        # the eager module's forward is bound in a way dynamo traces (torch 2.9 warned)
        assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []
        frames.append(counter.frame_count)
        eager = fxdebug.instrument(model, mode="stats")
        eager(x)
        records = fxdebug.records(gm)
        assert records.keys() == fxdebug.records(eager).keys() == ["0", "1", "2", "3", "4"]
        outputs = hooked_outputs(model, x)
        assert_records_match(records, {key: truth(value) for key, value in outputs.items()
                                       if value.numel()})
        assert records["3"].numel == records["4"].numel == 0 == records["3"].nonfinite
    assert frames[0] == frames[1] > 1  # graphs around the break, compiled once


def test_accumulated_statistics_under_compile_equal_eager_accumulation():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    runs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (5, 6, 7)]
    gm = fxdebug.instrument(fxdebug.trace(model), mode="stats")
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    fxdebug.accumulate_stats(gm)
    for x in runs:
        compiled(x)
    records = fxdebug.records(gm)
    assert records.runs == 3
    outputs = [hooked_outputs(model, x) for x in runs]  # all runs' values together:
    assert_records_match(records, {key: truth(torch.cat([run[key] for run in outputs]))
                                   for key in outputs[0]})


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_graph_ops_match_float64_on_the_adversarial_inputs(case):
    """The ops compiled graphs run, here run eagerly (inductor runs them above): float64's answer."""
    x = adversarial(case)
    assert_stats_equal(stats_from_summary(graph_summary(x)), truth(x), x.dtype)


@pytest.mark.parametrize("numel", [1000, 10_000], ids=["float64-sums", "float32-sums"])
@pytest.mark.parametrize("mean", [0.0, 1000.0])
def test_no_finite_value_where_the_shift_is_read_gives_the_std_or_nan_never_a_wrong_one(mean, numel):
    x = mean + 1e-3 * torch.randn(numel, generator=torch.Generator().manual_seed(8))
    x[[numel * i // 8 for i in range(8)]] = float("nan")  # the places the shift is read at
    stats, expected = stats_from_summary(graph_summary(x)), truth(x)
    assert stats.nonfinite == 8 and stats.min == expected["min"] and stats.max == expected["max"]
    if mean == 0.0:  # a shift of 0 is close enough to these values
        assert_stats_equal(stats, expected, x.dtype)
    elif numel < FLOAT32_MIN_NUMEL:  # a shift of 0 is too far: no std rather than an imprecise one
        assert math.isnan(stats.std) and math.isclose(stats.mean, expected["mean"], rel_tol=1e-9)
    else:  # float32's sums: no std, and a mean only where its error bound holds
        assert math.isnan(stats.std)
        assert math.isnan(stats.mean) or math.isclose(stats.mean, expected["mean"], rel_tol=1e-6)


FLOAT32_CASES = ["large-mean-small-spread", "negative-large-mean", "nonfinite", "near-overflow",
                 "shifts-far-from-values"]


def test_float32_sums_inside_inductor_equal_float64_on_the_adversarial_inputs():
    """float32 tensors are summed in float32 inside the compiled graph: float64's answer."""
    summarize = torch.compile(graph_summary, backend="inductor", fullgraph=True, dynamic=False)
    for case in FLOAT32_CASES:
        x = adversarial(case)
        assert x.dtype == torch.float32 and x.numel() >= FLOAT32_MIN_NUMEL
        assert_stats_equal(stats_from_summary(summarize(x)), truth(x), x.dtype)


def _float64_wherever_given(got, value: torch.Tensor) -> None:
    """Each statistic in ``got`` is float64's answer, and ``got`` gives at least those the same
    ops give run eagerly: they decline (NaN) where float32 sums are not precise enough (see the
    module of graph_summary); under symbolic sizes, a value that may be small is summed in
    float64 and may give more."""
    eager = stats_from_summary(graph_summary(value))
    for field in ("mean", "std"):
        if math.isnan(getattr(got, field)):
            assert math.isnan(getattr(eager, field)), (field, got, eager)
    assert_stats_equal(got, truth(value), value.dtype, may_decline=True)


def test_symbolic_sizes_give_what_the_ops_give_eagerly_and_float64():
    """Under ``dynamic=True`` (sizes as symbols where dynamo keeps them so), at several sizes of
    one and two dimensions: float64's statistics wherever the eager ops give them, from one
    graph per number of dimensions (no guard on a size, which would compile anew as sizes
    change)."""
    torch._dynamo.reset()  # (graphs compiled for other sizes would count as compiled already)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    summarize = torch.compile(graph_summary, backend=counter, fullgraph=True, dynamic=True)
    for case in FLOAT32_CASES:
        x = adversarial(case).reshape(-1).clone()  # (fresh tensors, not views: no base guards)
        for value in (x, x[: x.numel() - 3].clone(), x[: x.numel() // 2 + 1].clone()):
            _float64_wherever_given(stats_from_summary(summarize(value)), value)
    matrix = adversarial("nonfinite").reshape(-1)
    for rows in (40, 30, 25):
        value = matrix[: rows * 200].reshape(rows, 200).clone()
        _float64_wherever_given(stats_from_summary(summarize(value)), value)
    assert counter.frame_count == 2


def test_symbolic_rows_of_many_values_are_summed_in_float32_as_eagerly():
    """Rows of 2100 values, the number of rows a symbol: at least FLOAT32_MIN_NUMEL values at
    every size, so float32's sums, the same numbers (and NaN) as the ops run eagerly (values of
    1e-30 between zeros where the shift is read: float32's squares underflow, no std, where
    float64's sums would give one)."""
    torch._dynamo.reset()  # (a graph compiled for other sizes, more general, would be reused)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    summarize = torch.compile(graph_summary, backend=counter, fullgraph=True)
    matrix = adversarial("nonfinite").reshape(-1)
    values = []
    for rows in (4, 3, 2):
        tiny = 1e-30 * torch.randn(rows * 2100, generator=torch.Generator().manual_seed(rows))
        tiny[[rows * 2100 * i // 8 for i in range(8)]] = 0.0
        values += [matrix[: rows * 2100].reshape(rows, 2100).clone(), tiny.reshape(rows, 2100)]
    assert math.isnan(stats_from_summary(graph_summary(values[1])).std)
    for value in values:
        torch._dynamo.mark_dynamic(value, 0)
        got, eager = stats_from_summary(summarize(value)), stats_from_summary(graph_summary(value))
        for field in ("mean", "std", "min", "max", "zeros_pct", "nonfinite", "numel"):
            a, b = getattr(got, field), getattr(eager, field)
            assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6), field
        _float64_wherever_given(got, value)
    assert counter.frame_count == 1


def test_new_batch_sizes_compile_no_more_often_than_the_model_itself():
    """Default ``torch.compile``: a new size compiles once more with sizes as symbols, then no
    more, as for the model without fxdebug (here its activations grow past
    ``FLOAT32_MIN_NUMEL``); each call's records are that call's values."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                LargeMean()).eval()
    gm = fxdebug.instrument(model, mode="stats")
    torch._dynamo.reset()  # (sizes other tests compiled for would count as seen already)
    plain = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    instrumented = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    run_plain = torch.compile(model, backend=plain)
    run_instrumented = torch.compile(gm, backend=instrumented)
    for batch in (2, 3, 4, 5):
        x = torch.randn(batch, 3, 14, 14, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            run_plain(x)
            run_instrumented(x)
        assert_records_match(fxdebug.records(gm), hooked_truth(model, x))
    assert instrumented.frame_count == plain.frame_count == 2


@pytest.mark.parametrize("tiny", [False, True])
def test_float32_squares_that_overflow_or_underflow_give_nan_never_a_wrong_std(tiny):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(10))
    if tiny:  # picks of 0, values of 1e-30 between them: squares below float32's normal range
        x = 1e-30 * x
        x[::1250] = 0.0  # the places the shift and scale are read at
    else:  # values of +-3e38 between the picks: their squared deviations overflow float32
        x[[13, 17]] = torch.tensor([3e38, -3e38])
    stats, expected = stats_from_summary(graph_summary(x)), truth(x)
    assert math.isnan(stats.std) and math.isfinite(expected["std"]) and expected["std"] > 0
    assert stats.min == expected["min"] and stats.max == expected["max"]
    assert stats.numel == expected["numel"] and stats.nonfinite == 0
    assert stats.zeros_pct == expected["zeros_pct"]
    assert math.isnan(stats.mean) or math.isclose(stats.mean, expected["mean"], rel_tol=1e-5)


def test_graphs_after_a_graph_break_compile_no_more_for_new_sizes():
    """The graph after a break reads the summaries filed before it: each new batch size past
    the second compiles nothing, and each call's records are that call's values."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), Breaks(), torch.nn.Tanh(), LargeMean(),
                                torch.nn.Linear(6, 3)).eval()
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[Breaks]), mode="stats")
    torch._dynamo.reset()  # (sizes other tests compiled for would count as seen already)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(gm, backend=counter)
    frames = []
    for batch in (2, 3, 4, 5, 6):
        x = torch.randn(batch, 6, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            compiled(x)
        frames.append(counter.frame_count)
        assert_records_match(fxdebug.records(gm), hooked_truth(model, x))
        assert fxdebug.records(gm).record("4").shape == (batch, 3)
    assert frames[1] == frames[-1] > frames[0], frames
