"""What an older fxdebug wrote still loads, runs and gives the right values.

tests/fixtures/main_2026_11/ holds saved runs (one from 2 gloo ranks), pickled Records
(tensors and statistics), a saved instrumented module, a pickled report, a dumped folder
and a monitor series, written by tests/fixtures/make_main_2026_11.py (its docstring says
with which commit) and never rewritten. Pickles and dumped folders name fxdebug's modules
(``fxdebug.runtime.*``, the report's class): moving code must keep those paths loadable.

Ground truth is the same models run now: forward hooks and retain_grad on the eager model
(same seed, same input), statistics with float64 torch ops.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import tarfile

import pytest
import torch

import fxdebug
from folder_import import import_folder

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
OLD = os.path.join(FIXTURES, "main_2026_11")


def _maker():
    """The generator script as a module, for its model factories (not run)."""
    spec = importlib.util.spec_from_file_location("make_main_2026_11",
                                                  os.path.join(FIXTURES, "make_main_2026_11.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _maker()


def hooked(model: torch.nn.Module, x: torch.Tensor, backward: bool = True) -> tuple[dict, dict]:
    """Each submodule's output (forward hooks) and its gradient (retain_grad), the input's too."""
    outs: dict[str, torch.Tensor] = {}
    x = x.clone().requires_grad_(backward)
    outs["input"] = x
    for name, module in model.named_modules():
        if name:
            def hook(module, args, output, name=name):
                if output.requires_grad:
                    output.retain_grad()
                outs[name] = output
            module.register_forward_hook(hook)
    out = model(x)
    if backward:
        out.sum().backward()
    grads = {k: v.grad for k, v in outs.items() if backward}
    return {k: v.detach() for k, v in outs.items()}, grads


def assert_values(rec, truth: dict, grads: dict | None = None) -> None:
    assert rec.keys() == list(truth), (rec.keys(), list(truth))
    for key in truth:
        torch.testing.assert_close(rec[key], truth[key], msg=key)
    if grads is not None:  # the input did not require grad: no gradient recorded for it
        assert rec.grads.keys() == ["3", "2", "1", "0"]  # the order backward reached them
        for key in rec.grads.keys():
            torch.testing.assert_close(rec.grads[key], grads[key], msg=f"grad of {key}")


@pytest.mark.parametrize("folder", ["saved_run", "saved_records"])
def test_saved_runs_load_with_values_and_gradients(folder):
    truth, grads = hooked(MAKE.make_model(), MAKE.make_input())
    rec = fxdebug.load_records(os.path.join(OLD, folder))
    assert_values(rec, truth, grads)
    assert "LayerNorm" in rec.table()


def test_sharded_run_from_two_ranks_assembles_to_the_unsharded_values():
    truth, _ = hooked(MAKE.make_sharded_model(), MAKE.make_input(), backward=False)
    rec = fxdebug.load_records(os.path.join(OLD, "sharded_run"))
    assert rec.keys() == ["0", "1", "2"]
    for key in ("0", "2"):  # the ParallelStyle modules' outputs: placement known, assembled
        torch.testing.assert_close(rec[key], truth[key], msg=key)
    assert rec.record("0").placement.text.startswith("S(1)")
    shards = rec.shards("1")  # ReLU of a local tensor: each rank's half, not assembled
    assert sorted(shards) == [0, 1]
    for rank, piece in shards.items():
        torch.testing.assert_close(piece, truth["1"].chunk(2, dim=1)[rank])
    with pytest.raises(fxdebug.FxdebugError, match="'1' cannot be assembled"):
        rec["1"]


def test_pickled_records_load_with_values_and_gradients():
    truth, grads = hooked(MAKE.make_model(), MAKE.make_input())
    with open(os.path.join(OLD, "records.pkl"), "rb") as f:
        rec = pickle.load(f)
    assert isinstance(rec, fxdebug.Records)
    assert_values(rec, truth, grads)
    assert "GELU" in rec.table()


def test_pickled_stats_records_equal_float64_statistics_of_the_hooked_values():
    truth, _ = hooked(MAKE.make_model(), MAKE.make_input(), backward=False)
    with open(os.path.join(OLD, "stats_records.pkl"), "rb") as f:
        rec = pickle.load(f)
    assert rec.keys() == list(truth)
    for key, value in truth.items():
        stats, v = rec[key], value.double()
        assert isinstance(stats, fxdebug.Stats)
        assert stats.numel == v.numel()
        for found, expected in ((stats.mean, v.mean()), (stats.std, v.std()), (stats.min, v.min()),
                                (stats.max, v.max()), (stats.norm, v.norm())):
            assert found == pytest.approx(expected.item(), rel=1e-5, abs=1e-6), key
    assert "std" in rec.table()


def test_saved_instrumented_module_runs_and_records_again():
    model, x = MAKE.make_model(), MAKE.make_input()
    truth, grads = hooked(model, x)
    gm = torch.load(os.path.join(OLD, "instrumented.pt"), weights_only=False)
    out = gm(x.clone())
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    assert_values(fxdebug.records(gm), truth, grads)


def test_pickled_equivalence_report_reads_back():
    with open(os.path.join(OLD, "equivalence.pkl"), "rb") as f:
        report = pickle.load(f)
    assert isinstance(report, fxdebug.EquivalenceReport) and report.ok
    assert "EQUIVALENT" in repr(report) and report.table()


@pytest.fixture
def dumped(tmp_path) -> str:
    """The dumped folder, unpacked from its archive into ``tmp_path``."""
    with tarfile.open(os.path.join(OLD, "dumped.tar")) as tar:
        tar.extractall(tmp_path, filter="data")
    return str(tmp_path / "dumped")


def test_dumped_folder_loads_runs_and_records_like_the_model(dumped):
    model, x = MAKE.make_model(), MAKE.make_input()
    truth, grads = hooked(model, x)
    dumped = import_folder(dumped, "fxdebug_old_dump")
    loaded = dumped.load()
    out = loaded(x.clone())
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    assert_values(fxdebug.records(loaded), truth, grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(loaded.named_parameters())[name].grad, p.grad, msg=name)


def test_dumped_folders_run_py_passes(dumped):
    done = subprocess.run([sys.executable, "run.py", "--backward"], cwd=dumped, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: same results as when dumped" in done.stdout


def _readme_now(tmp_path, monkeypatch, threads: int, gm, x, **kwargs) -> str:
    monkeypatch.delenv("MKL_CBWR", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        folder = fxdebug.dump(gm, x, folder=tmp_path / "now", **kwargs)
    finally:
        torch.set_num_threads(before)
    with open(os.path.join(folder, "README.md")) as f:
        return f.read()


def test_a_dumps_readme_is_the_one_written_then(dumped, tmp_path, monkeypatch):
    gm = fxdebug.instrument(MAKE.make_model(), capture="all", grads=True)
    now = _readme_now(tmp_path, monkeypatch, 2, gm, MAKE.make_input())
    with open(os.path.join(dumped, "README.md")) as f:
        assert now == f.read()


def test_a_dumps_readme_with_pickles_wrapped_calls_and_hooks_is_the_one_written_then(
        tmp_path, monkeypatch):
    from dump_models import Gadgets, Opaque
    torch.manual_seed(0)
    model = Gadgets()
    model.norm.register_forward_hook(lambda module, args, output: None)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    now = _readme_now(tmp_path, monkeypatch, 1, fxdebug.trace(model, leaf_modules=[Opaque]), x,
                      allow_pickled_modules=True)
    with open(os.path.join(OLD, "gadgets_README.md")) as f:
        assert now == f.read()


def test_monitor_series_reads_back_float64_statistics_of_each_steps_outputs():
    series = fxdebug.load_series(os.path.join(OLD, "series"))
    assert series.steps == [0, 1, 2]
    assert series.keys() == ["0", "1", "2", "3", "loss"]
    model = MAKE.make_model()  # no optimizer step: the same weights at every step
    for step, batch in enumerate(MAKE.make_batches()):
        truth, grads = hooked(model, batch)
        for key in ("0", "1", "2", "3"):
            v, g = truth[key].double(), grads[key].double()
            for kind, value in (("out", v), ("grad", g)):
                for stat, expected in (("mean", value.mean()), ("std", value.std()),
                                       ("absmax", value.abs().max())):
                    steps, values = series.get(key, stat, kind=kind)
                    scale = value.pow(2).mean().sqrt().item()
                    assert values[steps.index(step)] == pytest.approx(
                        expected.item(), rel=1e-5, abs=1e-6 * scale), (key, kind, stat, step)
        model.zero_grad()
