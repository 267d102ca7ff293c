"""A compiler backend that gets one op wrong: check_compiled finds it, names it, and dumps a repro.

The backend below is what a compiler engineer might write: it "optimises"
every exact GELU into its tanh approximation. The model's outputs move by
about 1e-4, enough to fail torch.testing's float32 tolerance, and nobody
knows which op. ``fxdebug.check_compiled`` compiles the graph dynamo captured
piece by piece with the same backend, compares each piece with fxdebug's
eager captures of the same nodes and names the first node that differs, with
its module path and source line; ``report.dump`` writes the smallest piece
that still differs as a folder whose run.py shows the mismatch on its own.
"""

import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import fxdebug


def approximating_backend(gm, example_inputs):
    """Replace exact GELU by the tanh approximation (the "bug"), then run the graph eagerly."""
    for node in gm.graph.nodes:
        if node.target is F.gelu:
            node.kwargs = {**node.kwargs, "approximate": "tanh"}
    gm.recompile()
    return gm.forward


class Mlp(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        hidden = F.gelu(self.up(self.norm(x)))
        return x + self.down(hidden)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.Sequential(Mlp(), Mlp())
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.blocks(torch.tanh(self.embed(x))))


def main():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(4, 8)
    report = fxdebug.check_compiled(model, x, backend=approximating_backend)
    print(report.table())
    first = report.first_divergence
    assert not report.ok and first.key == "blocks.0.gelu", first
    assert first.location.endswith(f"compiled_divergence.py:{Mlp.forward.__code__.co_firstlineno + 1}")

    folder = report.dump(os.path.join(tempfile.mkdtemp(), "gelu_repro"))
    run = subprocess.run([sys.executable, os.path.join(folder, "run.py")], capture_output=True,
                         text=True)
    print(f"\n$ python {os.path.basename(folder)}/run.py\n{run.stdout}")
    assert run.returncode == 0 and "DIFFERENT" in run.stdout and "REPRODUCED" in run.stdout

    fine = fxdebug.check_compiled(model, x, backend="eager")
    assert fine.ok and fine.first_divergence is None
    print(f"ok: {first.key} ({first.location}) found; the eager backend agrees")


if __name__ == "__main__":
    main()
