"""A NaN that appears during training, sent to a colleague as a folder that runs without
fxdebug: find_nonfinite names the node that made it, fxdebug.dump(..., standalone=True) writes
the instrumented model without fxdebug's nodes, and the colleague's `python run.py --backward`
(here: an interpreter where `import fxdebug` fails) reproduces the NaN outputs and gradients,
compared by place.
Run: python examples/send_a_repro.py
"""
import os
import subprocess
import sys
import tempfile

import torch

import fxdebug


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.norm = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.norm(self.conv(x)).mean((2, 3)) + 0.6
        return self.fc(h.log())  # the bug: the log of a mean that training can make negative


torch.manual_seed(3)
model = TinyCNN()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    x, y = torch.randn(4, 3, 8, 8), torch.randn(4, 2)
    loss = (model(x) - y).square().mean()
    if not torch.isfinite(loss):
        break
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"step {step}: loss {loss.item()}")
assert step > 0 and not torch.isfinite(loss)

report = fxdebug.find_nonfinite(model, x)
print(report.table())
assert report.forward.key == "log" and report.forward.created

gm = fxdebug.instrument(model, grads=True)  # what you debug with; the folder leaves fxdebug out
folder = fxdebug.dump(gm, x, folder=os.path.join(tempfile.mkdtemp(), "nan_repro"), standalone=True)
shadow = tempfile.mkdtemp()  # the colleague's machine: torch, and no fxdebug
os.makedirs(os.path.join(shadow, "fxdebug"))
with open(os.path.join(shadow, "fxdebug", "__init__.py"), "w") as handle:
    handle.write("raise ModuleNotFoundError(\"No module named 'fxdebug'\", name='fxdebug')\n")
run = subprocess.run([sys.executable, "run.py", "--backward"], cwd=folder, capture_output=True,
                     text=True, env=dict(os.environ, PYTHONPATH=shadow))
print(f"\n$ python nan_repro/run.py --backward   # without fxdebug\n{run.stdout}{run.stderr}")
assert run.returncode == 0 and "NaN at the same places" in run.stdout
print(f"ok: the NaN of step {step} comes from {report.forward.key} ({report.forward.location}); "
      f"the standalone repro reproduces it without fxdebug")
