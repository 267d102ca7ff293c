"""run.py --backward on another machine: gradients summed in another order still pass."""

from __future__ import annotations

import re
import shutil
import textwrap

import torch
import torchvision

import fxdebug
from subprocesses import run_python

# Runs each folder's run.py --backward with 16 threads (the dump was made with one).
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
    changed = tmp_path / "changed"  # the same dump, one layer's weight 1% larger: a real difference
    shutil.copytree(folder, changed)
    weights = torch.load(changed / "weights.pt", weights_only=True)
    weights["layer4.1.conv2.weight"] *= 1.01
    torch.save(weights, changed / "weights.pt")
    proc = run_python(CHILD, folder, str(changed), cwd=str(tmp_path), OMP_NUM_THREADS="16")
    assert proc.returncode == 0, proc.stderr
    same, other = proc.stdout.split("== ")[1:]
    assert same.rstrip().endswith("exit 0") and "ok: same results as when dumped" in same, same
    close = re.findall(r"(\S+): close \(max abs diff (\S+); rtol (\S+), atol (\S+)\)", same)
    assert close, f"16 threads summed the gradients in the same order as one:\n{same}"
    expected = torch.load(tmp_path / "same" / "expected.pt", weights_only=True)["grads"]
    for name, diff, rtol, atol in close:  # the printed figures are the gradient's own
        largest = expected[name].abs().max().item()
        assert float(rtol) == 1.3e-6 and float(atol) > float(diff) > 0
        assert abs(float(atol) - (1e-5 + 4 * 1.3e-6 * largest)) <= 0.01 * float(atol)
    assert other.rstrip().endswith("exit 1") and "FAILED" in other, other
    assert re.search(r"gradients: .*DIFFERENT.*\n(.*\n)*  \S+: DIFFERENT \(max abs diff", other), other
