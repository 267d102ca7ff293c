"""fxdebug leaves the user's process as it found it: threads, collector, plots, global state, files.

Ground truth is the same code run without fxdebug: another thread's torch calls
give what they give with no trace in progress, the collector state a forward
sees is the one the user set, and every public entry point leaves RNG state,
default dtype, grad mode, thread count, the collector, warning filters,
torch's own functions and the temporary folder exactly as they were.
"""

from __future__ import annotations

import gc
import io
import os
import sys
import tempfile
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fxdebug


def _torch_work_elsewhere() -> dict:
    """What another thread does (a DataLoader worker, a logger): deterministic torch code."""
    out = {}
    generator = torch.Generator().manual_seed(7)
    out["ones"] = torch.ones(2)
    out["rand"] = torch.rand(3, generator=generator)
    out["arange"] = torch.arange(4) * 2
    out["from_numpy"] = torch.from_numpy(np.arange(3.0))
    torch.manual_seed(3)
    linear = nn.Linear(2, 2)  # nn.init draws random numbers and sets attributes
    out["init"] = linear.weight.detach().clone()
    with torch.no_grad():
        out["no_grad"] = (torch.is_grad_enabled(), linear(torch.ones(1, 2)).requires_grad)
    out["grad_after"] = torch.is_grad_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["autocast"] = linear(torch.ones(1, 2)).dtype
    with torch.inference_mode():
        out["inference"] = torch.ones(1).is_inference()
    out["uniform"] = torch.empty(3).uniform_(generator=torch.Generator().manual_seed(1))
    holder = nn.Module()
    holder.value = torch.zeros(1)  # nn.Module.__setattr__
    out["setattr"] = holder.value
    out["gc"] = gc.isenabled()
    return out


class _WaitsForTheOtherThread(nn.Module):
    """Its forward holds the trace open until the other thread has done its work."""

    def __init__(self, started: threading.Event, done: threading.Event) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.started, self.done = started, done

    def forward(self, x):
        self.started.set()
        self.done.wait(60)
        return self.linear(x) + torch.ones(4)


def _node_names(gm) -> list[str]:
    return [node.name for node in gm.graph.nodes]


def test_another_threads_torch_code_runs_as_without_fxdebug_while_a_trace_runs():
    expected = _torch_work_elsewhere()  # ground truth: no trace anywhere
    alone = fxdebug.trace(_WaitsForTheOtherThread(*(threading.Event(),) * 2))
    started, done = threading.Event(), threading.Event()
    seen, errors = {}, []

    def elsewhere():
        started.wait(60)
        try:
            seen.update(_torch_work_elsewhere())
        except BaseException as error:  # noqa: BLE001 - reported by the test, not lost
            errors.append(error)
        finally:
            done.set()

    worker = threading.Thread(target=elsewhere)
    worker.start()
    gm = fxdebug.trace(_WaitsForTheOtherThread(started, done))
    worker.join(60)
    assert not errors, errors
    assert seen.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert type(seen[name]) is torch.Tensor, name
            assert torch.equal(seen[name], value), name
        else:
            assert seen[name] == value, name
    assert _node_names(gm) == _node_names(alone)  # nothing of the other thread's in the graph


def test_two_threads_trace_at_once_and_torch_is_restored_after():
    originals = (nn.Module.__call__, nn.Module.__getattr__, nn.Module.__setattr__, torch.rand,
                 torch.from_numpy, torch.no_grad.__enter__, torch.autocast.__enter__)

    arrived, both_inside = [], threading.Event()

    class Noisy(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            if rendezvous:  # give the other thread's trace a second to be in progress too
                arrived.append(1)
                if len(arrived) >= 2:
                    both_inside.set()
                both_inside.wait(1.0)
            with torch.no_grad():
                noise = torch.randn(x.shape[-1])
            return self.linear(x) + noise

    rendezvous = False
    expected = {width: _node_names(fxdebug.trace(Noisy(width))) for width in (3, 5)}
    rendezvous = True
    barrier, graphs, errors = threading.Barrier(2), {}, []

    def trace(width):
        try:
            barrier.wait(60)
            for _ in range(5):
                graphs.setdefault(width, []).append(_node_names(fxdebug.trace(Noisy(width))))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
            barrier.abort()

    workers = [threading.Thread(target=trace, args=(width,)) for width in (3, 5)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert not errors, errors
    for width, names in graphs.items():
        assert names == [expected[width]] * 5
    assert (nn.Module.__call__, nn.Module.__getattr__, nn.Module.__setattr__, torch.rand,
            torch.from_numpy, torch.no_grad.__enter__, torch.autocast.__enter__) == originals


class _Probe(nn.Module):
    """Notes the collector's state whenever its forward or backward runs."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen = seen

    def forward(self, x):
        self.seen.append(("forward", gc.isenabled()))
        y = self.linear(x)
        if y.requires_grad and not isinstance(y, torch.fx.Proxy):
            y.register_hook(lambda grad: self.seen.append(("backward", gc.isenabled())))
        return y


@pytest.mark.parametrize("enabled", [True, False])
def test_user_code_runs_with_the_collector_as_the_user_left_it(enabled, tmp_path):
    seen: list = []
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        model = nn.Sequential(_Probe(seen), nn.ReLU())
        x = torch.randn(2, 4)
        gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[_Probe]))

        def user_pass(graph_module):
            seen.append(("pass", gc.isenabled()))
            return graph_module

        warnings.simplefilter("ignore", fxdebug.FidelityWarning)  # "changed nothing": true
        fxdebug.PassManager([user_pass], check_inputs=(x,)).run(gm)
        gm(x).sum().backward()
        fxdebug.diff(fxdebug.trace(model, leaf_modules=[_Probe]), gm)
        fxdebug.print_tabular(gm, file=io.StringIO())
        fxdebug.dump(gm, x, folder=tmp_path / "dump")  # runs forward and backward of the model
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    kinds = {kind for kind, _ in seen}
    assert kinds == {"forward", "backward", "pass"}
    assert all(state == enabled for _, state in seen), seen


def test_plotting_keeps_the_matplotlib_backend_and_pyplot_state(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from fxdebug.reporting.plots import plot_norms

    before = matplotlib.get_backend()
    figures = plt.get_fignums()
    matplotlib.use("svg")  # the user's backend; not Agg, so a switch to Agg would show
    try:
        gm = fxdebug.instrument(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), grads=True)
        gm(torch.ones(1, 2)).sum().backward()
        path = plot_norms(fxdebug.records(gm), str(tmp_path / "norms.png"))
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == figures
    finally:
        matplotlib.use(before)
    assert open(path, "rb").read(4) == b"\x89PNG"


# -- every public entry point leaves the process state as it found it ----------------------

def _function_modes() -> int:
    return len(torch.overrides._get_current_function_mode_stack())


def _state() -> dict:
    return {
        "rng": torch.get_rng_state(),
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "gc": gc.isenabled(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warning filters": list(warnings.filters),
        "sys.path": list(sys.path),
        "cwd": os.getcwd(),
        # (the tests' own temporary folder, see conftest.py: only this test writes there now)
        "temporary files": sorted(os.listdir(tempfile.gettempdir())),
        "function modes": _function_modes(),
        "torch functions": (nn.Module.__call__, nn.Module.__getattr__, nn.Module.__setattr__,
                            torch.rand, torch.from_numpy, torch.is_grad_enabled,
                            torch.no_grad.__enter__, torch.set_grad_enabled.__init__,
                            torch.autocast.__enter__, torch.inference_mode.__enter__),
    }


def _assert_unchanged(before: dict, after: dict, entry_point: str) -> None:
    for name, value in before.items():
        now = after[name]
        same = torch.equal(value, now) if isinstance(value, torch.Tensor) else value == now
        assert same, f"{entry_point} changed the {name}: {value!r} -> {now!r}"


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(y.mean((2, 3)))


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Small()

    def forward(self, x):
        if x.sum() > -1e9:  # control flow on a value: the root runs eagerly, the body is a part
            return self.body(x)
        return self.body(-x)


def _entry_points(tmp_path):
    torch.manual_seed(0)
    model = _Small().eval()
    x = torch.randn(1, 3, 8, 8)
    instrumented = fxdebug.instrument(model, grads=True)
    instrumented(x).sum().backward()
    stats = fxdebug.instrument(model, mode="stats", capture="all")

    def watch():
        watcher = fxdebug.watch_nonfinite(model)
        watcher(x).sum().backward()
        watcher.check()

    def accumulate():
        gm = fxdebug.instrument(model, mode="stats")
        fxdebug.accumulate_stats(gm)
        gm(x)
        gm(x)
        fxdebug.records(gm).table()

    untraceable = _Untraceable().eval()

    def partial():
        gm = fxdebug.instrument(untraceable)
        gm(x)
        fxdebug.traced_parts(gm)
        fxdebug.part_inputs(gm, x)

    def compiled_records():
        compiled = torch.compile(model, backend=fxdebug.backend(inner="eager"))
        compiled(x)

    def ranks():  # a world of one rank, started and ended around the calls
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            fxdebug.compare_ranks(model)
            fxdebug.compare_ranks(fxdebug.records(instrumented))
            watch()  # a collective check() under torch.distributed
        finally:
            dist.destroy_process_group()

    def plot():
        pytest.importorskip("matplotlib")
        fxdebug.plots.plot_norms(fxdebug.records(instrumented), str(tmp_path / "n.png"))

    return {
        "trace": lambda: fxdebug.trace(model),
        "trace(frontend='export')": lambda: fxdebug.trace(model, x, frontend="export"),
        "instrument + run + backward": lambda: fxdebug.instrument(model, grads=True)(x).sum().backward(),
        "instrument(mode='stats') run": lambda: stats(x),
        "records().table()": lambda: fxdebug.records(instrumented).table(),
        "print_tabular": lambda: fxdebug.print_tabular(instrumented, file=io.StringIO()),
        "diff": lambda: fxdebug.diff(fxdebug.trace(model), instrumented).table(),
        "PassManager": lambda: fxdebug.PassManager([fxdebug.passes.Capture()],
                                                   check_inputs=(x,)).run(model),
        "check_equivalence": lambda: fxdebug.check_equivalence(model, instrumented, x, grads=True),
        "testing.assert_equivalent": lambda: fxdebug.testing.assert_equivalent(model, instrumented, x),
        "find_nonfinite": lambda: fxdebug.find_nonfinite(model, x),
        "jacobian_norms": lambda: fxdebug.jacobian_norms(model, x, samples=2),
        "lint_inplace": lambda: fxdebug.lint_inplace(model, x),
        "vjp": lambda: fxdebug.vjp(model, x, output="head", wrt="conv"),
        "dump": lambda: fxdebug.dump(instrumented, x, folder=tmp_path / "dump", overwrite=True),
        "report": lambda: fxdebug.report(instrumented, tmp_path / "report.html"),
        "watch_nonfinite": watch,
        "compare_ranks, watch_nonfinite under torch.distributed": ranks,
        "accumulate_stats": accumulate,
        "partial instrumentation": partial,
        "check_compiled": lambda: fxdebug.check_compiled(model, x, backend="eager"),
        "backend": compiled_records,
        "plots.plot_norms": plot,
    }


def test_every_public_entry_point_leaves_the_process_state_unchanged(tmp_path):
    # torch's own first-use side effects are torch's, not fxdebug's: importing sympy adds a
    # warning filter, and torch 2.9's first export puts a temporary folder on sys.path
    torch.export.export(nn.Linear(1, 1), (torch.zeros(1, 1),))
    was_gc = gc.isenabled()
    threads = torch.get_num_threads()
    gc.disable()  # a user's settings, other than the defaults: each must stay as set
    torch.set_num_threads(2 if threads == 1 else 1)
    torch.manual_seed(1234)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxdebug.FxdebugWarning)
            for name, call in _entry_points(tmp_path).items():
                for grad_mode in (True, False):
                    if not grad_mode and name in ("instrument + run + backward", "watch_nonfinite",
                                                  "compare_ranks, watch_nonfinite under "
                                                  "torch.distributed"):
                        continue  # they call backward: the user's code needs grad mode
                    with torch.set_grad_enabled(grad_mode):
                        before = _state()
                        call()
                        _assert_unchanged(before, _state(), name)
    finally:
        torch.set_num_threads(threads)
        (gc.enable if was_gc else gc.disable)()


def test_no_function_mode_or_patch_is_left_after_a_failed_trace():
    class Fails(nn.Module):
        def forward(self, x):
            torch.rand(2)
            raise ValueError("the user's own error")

    before = _state()
    with pytest.raises(Exception):
        fxdebug.trace(Fails(), auto_leaf=False)
    _assert_unchanged(before, _state(), "a failed fxdebug.trace")


class _CountsCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_users_own_function_mode_keeps_working_around_a_trace():
    model = nn.Sequential(nn.Linear(2, 2))
    with _CountsCalls() as mode:
        gm = fxdebug.trace(model)
        calls = mode.calls
        torch.ones(1)
        assert mode.calls == calls + 1  # still the user's innermost mode
    x = torch.randn(1, 2)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
