"""Two runs of the same model, one with a perturbed layer: which key differs first?

Run a saves its captures with fxdebug.save_records; run b streams them to disk while
it runs (instrument(..., folder=)). fxdebug.compare_runs reads both folders, compares
key by key in execution order and names the first divergent key with its op and source
line; `fxdebug compare A B` does the same from a shell (exit 1 when they differ).
Run: python examples/compare_runs.py
"""
import copy
import os
import tempfile

import torch
import torchvision

import fxdebug

torch.manual_seed(0)
model = torchvision.models.resnet18().eval()
x = torch.randn(2, 3, 64, 64)
folder = tempfile.mkdtemp()

# run a: in memory, then saved
gm = fxdebug.instrument(model)
gm(x)
run_a = fxdebug.save_records(fxdebug.records(gm), os.path.join(folder, "a"))

# run b: a copy whose layer3.0.conv1 weight is slightly off, streamed to disk as it runs
perturbed = copy.deepcopy(model)
with torch.no_grad():
    perturbed.layer3[0].conv1.weight.mul_(1.001)
gm_b = fxdebug.instrument(perturbed, folder=os.path.join(folder, "b"))
gm_b(x)
fxdebug.records(gm_b)  # everything written (it also happens at exit)

report = fxdebug.compare_runs(run_a, os.path.join(folder, "b"))
print("\n".join(report.table().splitlines()[:6]))
first = report.first_divergence
assert first.key == "layer3.0.conv1", first
assert all(entry.status == "equal" for entry in report.entries[:report.entries.index(first)])
print(f"ok: first divergent key {first.key} ({first.op}, {first.location}), "
      f"max abs error {first.max_abs:.3g}")
