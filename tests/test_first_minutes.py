"""A new user's first minutes: a fast --help, tables that fit, every NaN creator, short reprs."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import fxdebug
from fxdebug.cli._common import BUILTIN_PASS_NAMES
from subprocesses import REPO, child_env, fxdebug_cli


def test_help_and_argument_errors_do_not_import_torch():
    probe = ("import sys, runpy\nsys.argv = ['fxdebug'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('fxdebug', run_name='__main__')\n"
             "except SystemExit as exc:\n    code = exc.code\n"
             "print('TORCH', 'torch' in sys.modules, code, file=sys.stderr)\n")
    for args, status in ((["--help"], 0), (["summary", "--bogus"], 2), (["report", "--help"], 0)):
        result = subprocess.run([sys.executable, "-c", probe, *args], cwd=REPO, env=child_env(),
                                capture_output=True, text=True, timeout=120)
        assert f"TORCH False {status}" in result.stderr, (args, result.stderr[-2000:])


def test_builtin_pass_names_match_the_passes():
    from fxdebug.passes import BUILTIN_PASSES
    assert BUILTIN_PASS_NAMES == tuple(BUILTIN_PASSES)


def _records():
    torch.manual_seed(0)
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()))
    gm(torch.randn(2, 3))
    return fxdebug.records(gm)


def test_table_fits_columns_and_wide_keeps_everything(monkeypatch):
    rec = _records()
    monkeypatch.delenv("COLUMNS", raising=False)
    full = rec.table()  # stdout is not a terminal under pytest: the full table
    assert full == rec.table(wide=True) and "zeros %" in full
    monkeypatch.setenv("COLUMNS", "40")
    narrow = rec.table()
    table_lines = narrow.splitlines()[:4]
    assert all(len(line) <= 40 for line in table_lines), narrow
    assert "(hidden: 0 %, dtype" in narrow and "zeros %" not in narrow
    assert rec.table(wide=True) == full


def test_summary_fits_80_columns():
    result = fxdebug_cli("summary", "--input", "1,3,32,32", "--depth", "1", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n(hidden")[0].splitlines()  # the title too
    assert len(lines) > 5 and all(len(line) <= 80 for line in lines), result.stdout
    piped = fxdebug_cli("summary", "--input", "1,3,32,32", "--depth", "1")
    assert "zeros %" in piped.stdout and "grad" not in piped.stdout


def test_record_repr_is_one_line():
    rec = _records()
    text = repr(rec.record("0"))
    assert "\n" not in text and text.startswith("Record('0', Linear, 2x4 float32")
    assert f"max={rec['0'].max().item():.4g}" in text  # ground truth from the tensor


def test_find_nonfinite_lists_every_creator():
    class TwoBugs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            first = torch.log(self.a(x))            # bug 1: log of negatives
            second = torch.sqrt(self.b(x) - 10)     # bug 2: sqrt of negatives
            return first.nan_to_num() + second

    report = fxdebug.find_nonfinite(TwoBugs(), torch.randn(3, 4), grads=False)
    assert report.forward.key == "log"
    assert report.creators == ["log", "sqrt"]  # `add` received its NaN; nan_to_num fixed one
    assert "sqrt" in report.table()


def test_passes_accepts_user_pass_files(tmp_path):
    (tmp_path / "my_passes.py").write_text(
        "import operator, torch\n"
        "def torch_add(gm):  # written for torch.fx.symbolic_trace\n"
        "    for node in gm.graph.nodes:\n"
        "        if node.target is operator.add:\n"
        "            node.target = torch.add\n"
        "    return gm\n")
    for spec in ("my_passes.py:torch_add", "my_passes:torch_add"):
        result = fxdebug_cli("passes", "torchvision.models:resnet18", "--input", "1,3,32,32",
                             "--pass", spec, "--check", cwd=str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert "layer1.0.iadd" in result.stdout and "ok" in result.stdout
        assert "changed nothing" not in result.stderr  # resnet's `out += identity` is an add


def test_loss_from_current_directory_and_errors_about_the_loss(tmp_path):
    (tmp_path / "losses.py").write_text("def first(out):\n    return out[0, 0]\n")
    (tmp_path / "net.py").write_text("import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(3, 2))\n")
    ok = fxdebug_cli("summary", "net.py:build", "--input", "2,3", "--grads",
                     "--loss", "losses:first", cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert "grad norm" in ok.stdout
    bad = fxdebug_cli("summary", "net.py:build", "--input", "2,3", "--grads",
                      "--loss", "nolosses:first", cwd=str(tmp_path))
    assert bad.returncode == 2 and "loss" in bad.stderr and "factory" not in bad.stderr
    assert os.path.exists(tmp_path / "losses.py")


def test_partial_warning_is_one_line_at_the_users_call():
    import warnings

    from partial_models import Flow, flow_inputs
    gm = fxdebug.instrument(Flow().eval())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            gm(*flow_inputs()); line = sys._getframe().f_lineno  # noqa: E702
    messages = [w for w in caught if "as a whole" in str(w.message)]
    assert len(messages) == 1
    warning = messages[0]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "\n" not in str(warning.message) and len(str(warning.message)) < 400
    assert "summary()" in str(warning.message)


def test_importing_a_submodule_never_hides_a_public_function():
    import importlib
    for name in ("fxdebug.instrumenting", "fxdebug.monitoring.training_monitor",
                 "fxdebug.equivalence.vector_jacobian", "fxdebug.runs.run_comparison",
                 "fxdebug.dumping.pipeline", "fxdebug.reporting.graph_diff",
                 "fxdebug.reporting.node_table"):
        importlib.import_module(name)  # what `from ..instrumenting import x` does
    importlib.import_module("fxdebug.instrument")  # loading an old pickle: old path on purpose
    import fxdebug.monitoring.spikes as spikes  # a package of its own, not the function monitor
    assert spikes.__name__ == "fxdebug.monitoring.spikes"
    for package, name in ((fxdebug, "instrument"), (fxdebug, "monitor"), (fxdebug, "vjp"),
                          (fxdebug, "dump"), (fxdebug.monitoring, "monitor"),
                          (fxdebug.equivalence, "vjp"), (fxdebug.runs, "compare_runs"),
                          (fxdebug.dumping, "dump"), (fxdebug.reporting, "diff"),
                          (fxdebug.reporting, "print_tabular")):
        assert type(getattr(package, name)).__name__ == "function", (package.__name__, name)
    assert sorted(set(fxdebug.__all__) - set(dir(fxdebug))) == []
