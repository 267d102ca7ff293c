"""A detector torch.fx cannot trace, instrumented anyway (seed 004: FX fails on real models and
the user falls back to hooks; seed 000: forward hooks on every module, recursive detach of
tuple/dict outputs). GeneralizedRCNN.forward iterates over a list of images, so fx cannot
trace the root; fxdebug.instrument traces the largest traceable submodules when they are first
called (backbone, RPN head, box head...), runs the glue eagerly, captures everything under full
module paths, and says what ran eagerly and why.

Run: python examples/detection_partial.py
"""
import warnings

import torch
import torchvision

import fxdebug

torch.manual_seed(0)
model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
    weights=None, weights_backbone=None).eval()  # random weights, nothing downloaded
images = [torch.rand(3, 96, 128)]

try:
    fxdebug.trace(model)
except fxdebug.TraceFailure as failure:
    print(f"fx alone: {failure.kind} at {failure.location}")

instrumented = fxdebug.instrument(model)  # the user's model is left as it was
with warnings.catch_warnings(record=True) as caught, torch.no_grad():
    warnings.simplefilter("always")
    detections = instrumented(images)
    expected = model(images)
print(caught[0].message if caught else "(no warning)")
for key in ("boxes", "labels", "scores"):
    assert torch.equal(detections[0][key], expected[0][key])

rec = fxdebug.records(instrumented)
print(f"{len(rec)} tensors captured, e.g.:")
for key in ("backbone.body.0.0", "backbone.fpn", "rpn.head.conv.0.0", "rpn.head.conv.0.0_1",
            "roi_heads.box_head.fc7"):
    found = [k for k in rec.keys() if k == key or k.startswith(key + "/")]
    print(f"  {found[0]:<28} {tuple(rec[found[0]].shape)}")

# the same values forward hooks on the original model see, call by call
hooked, calls = {}, {}
for name in ("backbone.body.0.0", "rpn.head.conv.0.0", "roi_heads.box_head.fc7"):
    def hook(_module, _inputs, output, name=name):
        count = calls.get(name, 0)
        calls[name] = count + 1
        hooked[name if count == 0 else f"{name}_{count}"] = output.detach().clone()
    model.get_submodule(name).register_forward_hook(hook)
with torch.no_grad():
    model(images)
for key, value in hooked.items():
    assert torch.equal(rec[key], value), key
print(f"{len(hooked)} hooked outputs equal the captures (the RPN head's conv ran "
      f"{calls['rpn.head.conv.0.0']} times, once per feature level)")

print(instrumented.fxdebug_partial.summary().splitlines()[0])
# each traced part is an ordinary GraphModule: check it against the module it came from
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    arguments = fxdebug.part_inputs(instrumented, images)
head = fxdebug.traced_parts(instrumented)["rpn.head"]
report = fxdebug.check_equivalence(model.rpn.head, head, *arguments["rpn.head"])
assert report.ok
print(f"rpn.head part: {len(head.graph.nodes)} nodes, equivalent to model.rpn.head: {report.ok}")
print("ok: detector instrumented part by part, captures equal to forward hooks")
