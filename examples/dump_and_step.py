"""Seed 004: a transformed model as files you can move, run and step through in pdb.

The seed pastes ``print(gm)`` into a subclass by hand, or calls
``GraphModule.to_folder``, whose folder fails to import once a pass has
inserted calls (no import block, absolute paths, half the submodules pickled);
and pdb cannot ``break`` in ``<eval_with_key>`` code. Here ``fxdebug.dump``
writes resnet18 with capture nodes to a folder, the folder is moved, ``run.py``
runs it in a fresh interpreter with the same outputs, and
``fxdebug debug FOLDER --break layer1.0.conv2`` is fed the pdb commands a
person would type: it stops at that node's line with its input in scope.

    python examples/dump_and_step.py
"""

import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torchvision

import fxdebug

torch.manual_seed(0)
model = torchvision.models.resnet18().eval()
x = torch.randn(1, 3, 64, 64)
gm = fxdebug.instrument(model, capture=["layer1.*", "fc"])

work = tempfile.mkdtemp()
folder = fxdebug.dump(gm, x, folder=os.path.join(work, "resnet18_dump"))
code = open(os.path.join(folder, "module.py")).read().splitlines()
print("module.py, around layer1.0.conv2:")
start = next(i for i, line in enumerate(code) if "# [layer1.0.conv2]" in line)
print("\n".join(code[start - 1:start + 3]))

moved = shutil.move(folder, os.path.join(work, "moved_elsewhere"))
root = os.path.dirname(os.path.dirname(os.path.abspath(fxdebug.__file__)))
env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
run = subprocess.run([sys.executable, os.path.join(moved, "run.py")], cwd=work, env=env,
                     capture_output=True, text=True)
assert run.returncode == 0, run.stderr
assert run.stdout.splitlines()[1].startswith("outputs: 1 equal"), run.stdout  # after the settings line
print("\nrun.py, in a fresh interpreter after the move:", run.stdout.splitlines()[1])

session = subprocess.run(
    [sys.executable, "-m", "fxdebug", "debug", moved, "--break", "layer1.0.conv2"],
    input="p layer1_0_relu.shape\nc\n", cwd=work, env=env, capture_output=True, text=True)
assert session.returncode == 0, session.stderr
print("\nfxdebug debug FOLDER --break layer1.0.conv2, commands `p layer1_0_relu.shape`, `c`:")
print("\n".join(line[:110] for line in session.stdout.splitlines()[:4]))
with torch.no_grad():
    seen = []
    hook = model.layer1[0].conv2.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    model(x)
    hook.remove()
assert f"(Pdb) {seen[0]}" in session.stdout  # the node's input, as a forward pre-hook sees it
assert "ok: same results as when dumped" in session.stdout
shutil.rmtree(work)
print(f"\nok: dumped folder moved, ran with equal outputs, pdb stopped at layer1.0.conv2 "
      f"with input {tuple(seen[0])}")
