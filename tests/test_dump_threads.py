"""run.py --backward: the dump's thread count set again, and gradients summed in another order
(another machine) still pass."""

from __future__ import annotations

import re
import shutil
import textwrap

import torch
import torchvision

import fxdebug
from subprocesses import run_python

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
        folder = fxdebug.dump(fxdebug.trace(model), tmp_path / "same", torch.randn(2, 3, 64, 64))
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
