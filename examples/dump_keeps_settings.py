"""A model dumped in a process with other numeric settings than torch's defaults (float32 matmul
precision "medium", deterministic algorithms, float64 default dtype): the folder's settings.json
records them, and `python run.py --backward`, a fresh process with torch's defaults, sets them
again before it runs, says which, and gets the results recorded at dump time. In your own
process, `from FOLDER import load` sets nothing.
Run: python examples/dump_keeps_settings.py
"""
import os
import subprocess
import sys
import tempfile

import torch

import fxdebug


class Scores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) + torch.arange(x.shape[0]).unsqueeze(1) / 10  # the default dtype's


torch.manual_seed(0)
model, x = Scores(), torch.randn(3, 8)
before = torch.get_float32_matmul_precision(), torch.get_default_dtype()
torch.set_float32_matmul_precision("medium")
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float64)
try:
    folder = fxdebug.dump(fxdebug.trace(model), x, folder=os.path.join(tempfile.mkdtemp(), "scores"))
finally:  # this process as it was
    torch.set_float32_matmul_precision(before[0])
    torch.use_deterministic_algorithms(False)
    torch.set_default_dtype(before[1])

run = subprocess.run([sys.executable, "run.py", "--backward"], cwd=folder, capture_output=True,
                     text=True)
print(f"$ python scores/run.py --backward\n{run.stdout}{run.stderr}")
assert run.returncode == 0 and "ok: same results as when dumped" in run.stdout
assert "torch.set_default_dtype(torch.float64)" in run.stdout.splitlines()[0]
print("ok: run.py set the dump's settings again in its own process; this one kept torch's")
