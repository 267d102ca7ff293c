"""Nested outputs (dataclasses, namedtuples, detection's list of dicts, OrderedDict) are keyed
the same way by captures, comparisons and the dumped run.py.

Ground truth: the module's own output, read with a forward hook, indexed by hand.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

import fxdebug
from fxdebug.dumping.folder_runtime import flatten_outputs, run_py_source
from fxdebug.runtime import clone_inputs, map_tensors, named_leaves

Pair = collections.namedtuple("Pair", "h c")


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    extra: tuple


class Nested(torch.nn.Module):
    def forward(self, x):
        boxes = [{"boxes": x[:, :2] * 2, "labels": x[:, 0].long()}]
        ordered = collections.OrderedDict(first=x + 1, second=Pair(x - 1, None))
        return Result(x * 3, (boxes, ordered))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Nested()

    def forward(self, x):
        out = self.head(x)
        return out.logits.sum() + out.extra[1]["first"].sum()


EXPECTED = {"head/logits": lambda o: o.logits,
            "head/extra/0/0/boxes": lambda o: o.extra[0][0]["boxes"],
            "head/extra/0/0/labels": lambda o: o.extra[0][0]["labels"],
            "head/extra/1/first": lambda o: o.extra[1]["first"],
            "head/extra/1/second/h": lambda o: o.extra[1]["second"].h}


def test_captures_key_nested_outputs_by_path():
    net = Net()
    seen = []
    net.head.register_forward_hook(lambda module, args, output: seen.append(output))
    x = torch.randn(2, 3)
    net(x)
    gm = fxdebug.instrument(fxdebug.trace(net, leaf_modules=[Nested]))
    gm(x)
    records = fxdebug.records(gm)
    keys = [key for key in records.keys() if key.startswith("head/")]
    assert keys == list(EXPECTED)
    for key, pick in EXPECTED.items():
        assert torch.equal(records[key], pick(seen[0])), key


def test_the_dumped_run_py_flattens_as_fxdebug_does():
    namespace: dict = {}
    exec(compile("import dataclasses\nimport torch\n" + run_py_source(), "run.py", "exec"), namespace)
    imports = [line for line in run_py_source().splitlines() if line.startswith(("import", "from"))]
    assert not any("fxdebug" in line for line in imports)  # run.py needs torch only
    value = Nested()(torch.randn(2, 3))
    ours, theirs = flatten_outputs(value), namespace["flatten_outputs"](value)
    assert list(ours) == list(theirs) == ["output/" + key[len("head/"):] for key in EXPECTED] + [
        "output/extra/1/second/c"]
    assert all(ours[key] is theirs[key] for key in ours)


def test_copies_keep_every_container_type():
    x = torch.ones(2, requires_grad=True)
    value = Result(x, (Pair(x, [x]), collections.OrderedDict(a=x), slice(0, 2)))
    copied = clone_inputs(value)
    assert type(copied) is Result and type(copied.extra[0]) is Pair
    assert type(copied.extra[1]) is collections.OrderedDict and copied.extra[2] == slice(0, 2)
    leaves = [leaf for _, leaf in named_leaves(copied) if isinstance(leaf, torch.Tensor)]
    assert len(leaves) == 4 and all(leaf is not x and leaf.requires_grad for leaf in leaves)
    assert value.logits is x  # the original is untouched
    doubled = map_tensors(lambda t: t * 2, (torch.return_types.max((x, x.long())),))
    assert type(doubled[0]) is torch.return_types.max and doubled[0].values.tolist() == [2.0, 2.0]
