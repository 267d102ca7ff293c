"""Stats mode's batched statistics: many small captures summarized together equal float64.

Ground truth is computed another way: forward hooks that clone each module's
output, then ``torch.mean / std / amin / amax`` over the finite values in float64
(``test_stats.truth``). The CUDA graph tests skip without a GPU.
"""

import math
import pickle

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.errors import StaleCaptureError
from fxdebug.runtime import stats_batch
from fxdebug.runtime.records import Records
from fxdebug.stats.kernel import MIN_NUMEL
from test_stats import ADVERSARIAL, adversarial, assert_stats_equal, truth


class Emit(torch.nn.Module):
    """Returns its tensor's values (its dtype kept), whatever the input: a model that outputs
    any values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("values", tensor)

    def forward(self, x):
        return torch.where(x.sum() == 0, self.values, self.values)


class AddOneInPlace(torch.nn.Module):
    def forward(self, x):
        return x.add_(1)


def small(case: str) -> torch.Tensor:
    """``test_stats.adversarial(case)``, cut below MIN_NUMEL values (layout kept): batched."""
    x = adversarial(case)
    x = x[:30] if x.dim() == 2 else x[:3001]
    assert x.numel() < MIN_NUMEL
    return x


def extra_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "int64": torch.randint(-1000, 1000, (5, 7), generator=g),
        "large int64": torch.tensor([2 ** 52, 2 ** 52 + 1, -3]),
        "bool": torch.rand(40, generator=g) > 0.5,
        "float64 near overflow": torch.tensor([1e300, -1e300, 5e299], dtype=torch.float64),
        "single value": torch.tensor([2.5]),
        "bfloat16 relu": torch.randn(4, 33, generator=g).relu().bfloat16(),
        "float16 with inf": torch.tensor([1.0, float("inf"), 3.0], dtype=torch.float16),
    }


class Many(torch.nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(Emit(t) for t in tensors)

    def forward(self, x):
        return [part(x) for part in self.parts]


def run_stats(tensors: list[torch.Tensor]):
    """Stats of each tensor as a module output, captured in one forward: a list of Stats."""
    gm = fxdebug.instrument(Many(tensors), mode="stats")
    gm(torch.zeros(1))
    rec = fxdebug.records(gm)
    keys = [f"parts.{i}" for i in range(len(tensors))]
    assert all(rec.record(key).summary is not None for key in keys)
    return [rec[key] for key in keys]


@pytest.mark.filterwarnings("ignore:std\\(\\):UserWarning")  # truth() of a single value
@pytest.mark.parametrize("mix", ["all cases in one batch", "finite cases only"])
def test_batched_statistics_match_float64(mix):
    cases = {case: small(case) for case in ADVERSARIAL} | extra_cases()
    if mix == "finite cases only":  # the batch takes the all-finite ops
        cases = {k: v for k, v in cases.items() if bool(torch.isfinite(v.double()).all())}
    for stats, (name, x) in zip(run_stats(list(cases.values())), cases.items()):
        assert_stats_equal(stats, truth(x), x.dtype)


def test_all_nonfinite_and_empty_tensors_in_a_batch():
    nan, empty, ones = run_stats([torch.full((3,), float("nan")), torch.zeros(0, 4),
                                  torch.ones(2)])
    assert nan.nonfinite == 3 and math.isnan(nan.mean) and nan.numel == 3
    assert empty.numel == 0 and empty.nonfinite == 0 and math.isnan(empty.mean)
    assert (ones.mean, ones.min, ones.max, ones.zeros_pct) == (1.0, 1.0, 1.0, 0.0)


def test_a_tensor_gets_the_same_summary_alone_or_in_any_batch():
    """A tensor's statistics do not depend on the other captures of the forward."""
    x = small("large-mean-small-spread")
    alone = stats_batch.batch_summaries([x])
    for others in ([torch.tensor([float("nan")])], [torch.randn(100), torch.arange(5)]):
        together = stats_batch.batch_summaries(others + [x])
        assert torch.equal(together[-1], alone[0])


def test_capture_before_an_in_place_op_keeps_what_eager_computed(hooks):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), AddOneInPlace(), torch.nn.ReLU())
    x = torch.randn(3, 4)
    expected = hooks(model, x)  # clones at each module's return
    gm = fxdebug.instrument(model, mode="stats")
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    for key in ("0", "1", "2"):
        assert_stats_equal(rec[key], truth(expected[key]), torch.float32)
    assert rec["0"].mean != rec["1"].mean


def test_a_write_fxdebug_could_not_see_makes_the_capture_stale():
    records = Records()
    seen, written = torch.ones(4), torch.zeros(4)
    records.add_stats("seen", "op", seen)
    records.add_stats("written", "op", written)
    written.add_(5)  # before the statistics were taken
    assert records["seen"].mean == 1.0
    assert records.record("written").stale
    with pytest.raises(StaleCaptureError, match="written"):
        records["written"]
    assert "stale (written in place after capture, not shown): written" in records.table()


def test_resnet_in_stats_mode_equals_forward_hooks(hooks):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = hooks(model, x)
    gm = fxdebug.instrument(model, mode="stats")
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    assert len(rec) == len(expected)
    tensor_gm = fxdebug.instrument(model)
    with torch.no_grad():
        tensor_gm(x)
    # small captures (summarized at the end) and large ones (at once) keep execution order
    assert rec.keys() == fxdebug.records(tensor_gm).keys()
    batched = 0
    for key, value in expected.items():
        batched += value.numel() < MIN_NUMEL
        assert (rec.record(key).shape, rec.record(key).dtype) == (value.shape, value.dtype), key
        stats = rec[key]
        want = truth(value)
        scale = max(abs(want["mean"]), want["std"], 1e-6)
        assert math.isclose(stats.mean, want["mean"], abs_tol=1e-5 * scale), key
        assert math.isclose(stats.std, want["std"], rel_tol=1e-4, abs_tol=1e-6), key
        assert (stats.min, stats.max, stats.zeros_pct, stats.nonfinite) == \
            (want["min"], want["max"], want["zeros_pct"], 0), key
    assert 10 < batched < len(expected) - 10  # both paths took part


@pytest.mark.parametrize("group", ["one layout", "mixed layouts"])
def test_each_batched_record_has_its_tensors_shape_dtype_and_statistics(group):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g),
               torch.randn(2, 3, 4, generator=g).permute(2, 0, 1)[:, :, :2].transpose(1, 2)]
    if group == "mixed layouts":  # several sizes beyond dim 0, 0-d, empty and integer tensors
        tensors += [torch.randn(4, generator=g), torch.tensor(2.5), torch.zeros(0, 4),
                    torch.zeros(2, 0), torch.arange(6).view(2, 3), torch.randn(7, 4, generator=g)]
    gm = fxdebug.instrument(Many(tensors), mode="stats")
    gm(torch.zeros(1))
    rec = fxdebug.records(gm)
    for i, x in enumerate(tensors):
        record = rec.record(f"parts.{i}")
        assert (record.shape, record.dtype) == (x.shape, x.dtype), i
        if x.numel():
            assert_stats_equal(rec[f"parts.{i}"], truth(x), x.dtype)
        else:
            assert rec[f"parts.{i}"].numel == 0 and math.isnan(rec[f"parts.{i}"].mean)


def test_a_capture_a_hook_later_writes_in_place_keeps_what_eager_computed():
    """A pre-hook on the instrumented module's child zeroes, in place, the output of the
    module before it, after its capture and before the summaries are taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model[0](x)
    gm = fxdebug.instrument(model, mode="stats")
    gm.get_submodule("1").register_forward_pre_hook(lambda module, inputs: inputs[0].mul_(0))
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    assert_stats_equal(rec["0"], truth(expected), torch.float32)
    assert (rec["1"].min, rec["1"].max, rec["1"].zeros_pct) == (0.0, 0.0, 100.0)


def test_captures_before_a_failing_module_are_kept_with_their_statistics():
    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad input")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), Fails())
    gm = fxdebug.instrument(model, mode="stats")
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="bad input"):
        gm(x)
    rec = fxdebug.records(gm)
    with torch.no_grad():
        expected = {"0": model[0](x), "1": model[1](model[0](x))}
    assert rec.keys() == ["0", "1"]
    for key, value in expected.items():
        assert_stats_equal(rec[key], truth(value), torch.float32)


def test_more_pending_values_than_a_batch_holds_are_summarized_in_several(hooks):
    """Past MAX_PENDING_NUMEL pending values the summaries are taken mid-forward: every
    capture still equals its float64 reference, in order."""
    size = MIN_NUMEL - 1
    layers = stats_batch.MAX_PENDING_NUMEL // size + 3
    model = torch.nn.Sequential(*[torch.nn.Tanh() if i % 2 else torch.nn.Sigmoid()
                                  for i in range(layers)])
    x = torch.randn(size, generator=torch.Generator().manual_seed(0))
    expected = hooks(model, x)
    gm = fxdebug.instrument(model, mode="stats")
    with torch.no_grad():
        gm(x)
    rec = fxdebug.records(gm)
    assert rec.keys() == list(expected)
    for key, value in expected.items():
        assert_stats_equal(rec[key], truth(value), torch.float32)


def test_repeated_calls_each_hold_their_own_values_and_reuse_the_segment_plan():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    gm = fxdebug.instrument(model, mode="stats")
    static = torch.zeros(3, 8)
    held = []
    for seed in range(3):
        static.copy_(torch.randn(3, 8, generator=torch.Generator().manual_seed(seed)))
        with torch.no_grad():
            gm(static)
            expected = [model[0](static), model[1](model[0](static)), model(static)]
        held.append((fxdebug.records(gm), expected))
    for rec, expected in held:  # earlier Records are not overwritten by later calls
        for key, value in zip(("0", "1", "2"), expected):
            assert_stats_equal(rec[key], truth(value), torch.float32)
    sizes = (24, 24, 6)
    from fxdebug.stats import batch
    lengths = batch._lengths(torch.device("cpu"), sizes)
    assert batch._lengths(torch.device("cpu"), sizes) is lengths  # kept, not rebuilt


def test_accumulated_and_pickled_batched_records():
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()), mode="stats")
    fxdebug.accumulate_stats(gm)
    runs = [torch.randn(5, 7, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for x in runs:
        gm(x)
    rec = fxdebug.records(gm)
    assert rec.runs == 3
    assert_stats_equal(rec["0"], truth(torch.cat(runs).relu()), torch.float32)
    again = pickle.loads(pickle.dumps(rec))
    assert again["1"] == rec["1"]


class FirstColumns(torch.nn.Module):
    def forward(self, x):
        return x[:, :5]


def test_accumulated_large_and_small_captures_equal_all_runs_together():
    """Large captures (summarized at once) and small ones (batched) merge over runs alike,
    in capture order."""
    model = torch.nn.Sequential(torch.nn.ReLU(), FirstColumns(), torch.nn.Tanh())
    gm = fxdebug.instrument(model, mode="stats")
    fxdebug.accumulate_stats(gm)
    runs = [torch.randn(3, MIN_NUMEL, generator=torch.Generator().manual_seed(s))
            for s in range(3)]
    for x in runs:
        gm(x)
    rec = fxdebug.records(gm)
    both = torch.cat(runs)
    assert rec.runs == 3 and rec.keys() == ["0", "1", "2"]
    assert (rec.record("0").shape, rec.record("1").shape) == ((3, MIN_NUMEL), (3, 5))
    for key, value in (("0", both.relu()), ("1", both.relu()[:, :5]),
                       ("2", both.relu()[:, :5].tanh())):
        assert_stats_equal(rec[key], truth(value), torch.float32)


def _graph_case(mode: str, graphed_callables: bool):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda().eval()
    gm = fxdebug.instrument(model, mode=mode)
    static = torch.randn(2, 3, 64, 64, device="cuda")
    if graphed_callables:
        with torch.no_grad():
            run = torch.cuda.make_graphed_callables(gm, (static,))
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm up: the segment plans are built here
                gm(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            gm(static)

        def run(x):
            graph.replay()
    return model, gm, static, run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphed_callables", [False, True], ids=["CUDAGraph", "make_graphed_callables"])
@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_cuda_graph_replays_record_that_replays_values(mode, graphed_callables, hooks):
    model, gm, static, run = _graph_case(mode, graphed_callables)
    for seed in (1, 2):
        static.copy_(torch.randn(2, 3, 64, 64, device="cuda",
                                 generator=torch.Generator("cuda").manual_seed(seed)))
        run(static)
        torch.cuda.synchronize()
        expected = hooks(model, static)
        rec = fxdebug.records(gm)
        for key, value in expected.items():
            if mode == "tensor":
                torch.testing.assert_close(rec[key], value)
            else:
                want = truth(value)
                assert math.isclose(rec[key].mean, want["mean"], rel_tol=1e-4, abs_tol=1e-5), key
                assert (rec[key].min, rec[key].max) == (want["min"], want["max"]), key
