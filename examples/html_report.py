"""Looking at a run instead of reading 200-row tables: one self-contained HTML page with
the records table (sortable, filterable by key), activation and gradient norms per layer,
the nodes holding a NaN in red, and what a faulty pass changed, with its first divergent
node outlined. No network: CSS, JavaScript and charts are inline.
Run: python examples/html_report.py [report.html]
"""
import operator
import os
import sys
import tempfile

import torch
import torchvision

import fxdebug

torch.manual_seed(0)
model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)
with torch.no_grad():
    model.fc.bias[3] = float("nan")  # a broken bias: the output is NaN, the gradients are not
gm = fxdebug.instrument(model, grads=True)
gm(x).sum().backward()


def faulty_pass(gm):  # makes layer2's first residual add a subtraction
    for node in gm.graph.nodes:
        if node.meta.get("fxdebug_key") == "layer2.0.iadd":
            node.target = operator.sub
    return gm


try:
    fxdebug.PassManager([fxdebug.passes.Capture(), faulty_pass],
                        check_inputs=(x,)).run(torchvision.models.resnet18().eval())
    raise SystemExit("the faulty pass was not caught")
except fxdebug.PassEquivalenceError as exc:
    passes_report = exc.report

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "report.html")
fxdebug.report([gm, passes_report], path,
               title="fxdebug report: resnet18 with a NaN bias, and a faulty pass")
page = open(path, encoding="utf-8").read()
assert 'class="nonfinite"' in page
assert 'class="changed first"><td>~</td><td>layer2.0.iadd</td>' in page
assert "<script src" not in page and "<link" not in page  # self-contained
print(f"ok: report {path} ({os.path.getsize(path) // 1024} KiB): the NaN output and the faulty "
      f"pass's first divergence (layer2.0.iadd) are marked")
