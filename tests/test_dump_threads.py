"""run.py --backward: the dump's thread count set again, and gradients summed in another order
(another machine) still pass; the same bits promised only where MKL gives them (MKL_CBWR)."""

from __future__ import annotations

import json
import os
import re
import shutil
import textwrap

import pytest
import torch
import torchvision

import fxdebug
from subprocesses import child_env, run_python, start_python

# Runs each folder's run.py --backward in a process with 16 threads (the dump was made with one).
CHILD = textwrap.dedent("""
    import runpy, sys, torch
    torch.set_num_threads(16)
    for folder in sys.argv[1:]:
        sys.argv = ["run.py", "--backward"]
        print("==", folder)
        try:
            runpy.run_path(folder + "/run.py", run_name="__main__")
        except SystemExit as exc:
            print("exit", exc.code)
""")


def test_gradients_pass_with_another_thread_count_and_real_changes_fail(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torchvision.models.resnet18()  # train mode: batch norm sums over the batch too
        folder = fxdebug.dump(fxdebug.trace(model), torch.randn(2, 3, 64, 64), folder=tmp_path / "same")
    finally:
        torch.set_num_threads(threads)
    # The same dump with expected gradients nudged by 4e-7 (relative): within float32's
    # tolerance, as another summation order would be. Whether 16 threads actually sum in
    # another order than one is up to torch, so the tolerance path is checked on this copy.
    nudged = tmp_path / "nudged"
    shutil.copytree(folder, nudged)
    expected = torch.load(nudged / "expected.pt", weights_only=True)
    expected["grads"] = {name: grad * (1 + 4e-7) for name, grad in expected["grads"].items()}
    torch.save(expected, nudged / "expected.pt")
    changed = tmp_path / "changed"  # the same dump, one layer's weight 1% larger: a real difference
    shutil.copytree(folder, changed)
    weights = torch.load(changed / "weights.pt", weights_only=True)
    weights["layer4.1.conv2.weight"] *= 1.01
    torch.save(weights, changed / "weights.pt")
    proc = run_python(CHILD, folder, str(nudged), str(changed), cwd=str(tmp_path),
                      OMP_NUM_THREADS="16")
    assert proc.returncode == 0, proc.stderr
    same, close_copy, other = proc.stdout.split("== ")[1:]
    assert same.rstrip().endswith("exit 0") and "ok: same results as when dumped" in same, same
    # run.py set the dump's thread count again: on the same machine, the same bits
    assert same.splitlines()[1] == "settings applied as when dumped: torch.set_num_threads(1)", same
    assert " equal" in same and "close" not in same and "NOT as when dumped" not in same, same
    assert close_copy.rstrip().endswith("exit 0") and "ok: same results" in close_copy, close_copy
    close = re.findall(r"(\S+): close \(max abs diff (\S+); rtol (\S+), atol (\S+)\)", close_copy)
    reference = torch.load(tmp_path / "same" / "expected.pt", weights_only=True)["grads"]
    assert {name for name, *_ in close} == {name for name, grad in reference.items()
                                            if grad.abs().max() > 0}, close_copy
    for name, diff, rtol, atol in close:  # the printed figures are the gradient's own
        largest = reference[name].abs().max().item()
        assert float(rtol) == 1.3e-6 and float(atol) > float(diff) > 0
        assert float(atol) == float(f"{1e-5 + 4 * 1.3e-6 * largest:.2g}")  # printed to 2 digits
    assert other.rstrip().endswith("exit 1") and "FAILED" in other, other
    assert re.search(r"gradients: .*DIFFERENT.*\n(.*\n)*  \S+: DIFFERENT \(max abs diff", other), other


# Dumps resnet18 at 1x3x32x32 with 2 threads, MKL_CBWR as argv[2] ("-": unset), before MKL's first
# computation (MKL reads it then). Its layer4 convolutions' outputs are 1x1: each one's input
# gradient is a matrix product that MKL sums in parts between its threads.
DUMP_TWO_THREADS = textwrap.dedent("""
    import os, sys, torch, torchvision, fxdebug
    os.environ.pop("MKL_CBWR", None) if sys.argv[2] == "-" else os.environ.update(MKL_CBWR=sys.argv[2])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    fxdebug.dump(fxdebug.trace(model), x, folder=sys.argv[1])
""")

# run.py --backward in a process that starts with one thread and no MKL_CBWR: run.py sets both.
RUN_PY = textwrap.dedent("""
    import os, runpy, sys
    os.environ.pop("MKL_CBWR", None)
    import torch
    torch.set_num_threads(1)
    folder = sys.argv[1]
    sys.argv = ["run.py", "--backward"]
    try:
        runpy.run_path(folder + "/run.py", run_name="__main__")
    except SystemExit as exc:
        print("exit", exc.code)
""")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL_CBWR is MKL's")
def test_run_py_promises_the_same_bits_only_where_mkl_gives_them(tmp_path):
    # Without MKL_CBWR, 2 threads give the gradients one of a few values from run to run, even
    # in one process (3 values in 40 runs on a busy 2-core machine; one with MKL_CBWR=AUTO or
    # one thread): run.py says why, and passes on close values. With it, the same bits.
    folders = {"unset": str(tmp_path / "unset"), "AUTO": str(tmp_path / "auto")}
    dumps = {cbwr: start_python(["-c", DUMP_TWO_THREADS, folder, "-" if cbwr == "unset" else cbwr],
                                str(tmp_path), child_env(), None) for cbwr, folder in folders.items()}
    for cbwr, wait in dumps.items():
        done = wait(300)
        assert done.returncode == 0, (cbwr, done.stderr[-4000:])
    recorded = {cbwr: json.loads(open(os.path.join(folder, "settings.json")).read())
                for cbwr, folder in folders.items()}
    assert recorded["unset"]["settings"]["os.environ['MKL_CBWR']"] is None
    assert recorded["AUTO"]["settings"]["os.environ['MKL_CBWR']"] == "AUTO"
    assert recorded["unset"]["nondeterministic"].startswith(
        "the dump ran on the CPU with 2 threads without MKL_CBWR"), recorded["unset"]
    assert recorded["AUTO"]["nondeterministic"] == ""
    runs = {cbwr: start_python(["-c", RUN_PY, folder], str(tmp_path), child_env(), None)
            for cbwr, folder in folders.items()}
    unset, auto = (runs[cbwr](300).stdout for cbwr in folders)
    assert unset.splitlines()[0] == "settings applied as when dumped: torch.set_num_threads(2)", unset
    assert ("nondeterministic: the dump ran on the CPU with 2 threads without MKL_CBWR (MKL's "
            "threaded matrix products") in unset, unset
    assert "DIFFERENT" not in unset and "ok: same results as when dumped\nexit 0" in unset, unset
    assert re.search(r"^gradients: (\d+ (equal|close)(, |$))+", unset, re.M), unset
    assert auto.splitlines()[0] == ("settings applied as when dumped: MKL_CBWR=AUTO, "
                                    "torch.set_num_threads(2)"), auto
    assert "nondeterministic" not in auto and "outputs: 1 equal" in auto, auto
    assert "gradients: 62 equal" in auto and "ok: same results as when dumped\nexit 0" in auto, auto
