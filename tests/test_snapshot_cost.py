"""The transactional snapshot costs some objects per module, not one per object it reaches.

A snapshot used to keep a copy of every container it reached (each module's dozen empty hook
dictionaries among them) and a name tuple per object: 58 objects the garbage collector tracks
per module of a Linear/ReLU chain, which set off full collections on large models (a 10k-node
chain traced 7.7x slower than torch.fx.symbolic_trace). Counted here, not timed: what the
snapshot keeps, and that what it lists without keeping (containers empty when taken) is still
put back and named.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from fxdebug.tracing.transaction import ModelSnapshot


def _chain(pairs: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(pairs):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    return nn.Sequential(*layers)


def _tracked_objects_kept(model: nn.Module) -> tuple[int, ModelSnapshot]:
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # nothing collected while counting
    try:
        before = len(gc.get_objects())
        snapshot = ModelSnapshot(model)
        return len(gc.get_objects()) - before, snapshot
    finally:
        if enabled:
            gc.enable()


def test_a_snapshot_keeps_a_few_objects_per_module_not_one_per_object_reached():
    per_module = []
    for pairs in (100, 200):
        model = _chain(pairs)
        modules = len(list(model.modules()))
        kept, snapshot = _tracked_objects_kept(model)
        per_module.append(kept / modules)
        assert per_module[-1] <= 8, per_module  # 58 per module before
        # a Linear: its __dict__ copy, its _parameters copy, two tensors' states; a ReLU: its
        # __dict__ copy
        assert snapshot.complete and snapshot.kept <= 3 * modules, (pairs, snapshot.kept)
        del snapshot
    assert abs(per_module[1] - per_module[0]) <= 1, per_module  # linear in modules


def test_a_registry_empty_when_taken_is_named_and_emptied_again():
    net = _chain(2)
    snapshot = ModelSnapshot(net)
    net[2].register_forward_hook(lambda *args: None)
    net[3].register_buffer("seen", torch.zeros(1))
    net[0].weight.note = "written under tracing"  # a tensor's __dict__, empty when taken
    assert snapshot.changes() == [  # sorted
        "0 (Linear)._parameters['weight'].__dict__: contents differ",
        "2 (Linear)._forward_hooks: contents differ", "3 (ReLU)._buffers: contents differ"]
    assert snapshot.restore() == []
    assert not net[2]._forward_hooks and not net[3]._buffers and not vars(net[0].weight)
    assert snapshot.changes() == []


def test_data_replaced_by_a_view_of_the_same_memory_is_put_back():
    net = _chain(1)
    weight = net[0].weight
    memory, shape = weight.data_ptr(), tuple(weight.shape)
    snapshot = ModelSnapshot(net)
    with torch.no_grad():
        weight.data = weight.data.view(-1)  # same pointer, another shape
    assert snapshot.changes() == ["0 (Linear)._parameters['weight']: tensor state differs"]
    with torch.no_grad():
        weight.data = torch.zeros(4, 4)  # other memory
    assert snapshot.restore() == []
    assert (weight.data_ptr(), tuple(weight.shape)) == (memory, shape)


def test_an_in_place_write_to_a_parameter_is_named_not_hidden():
    net = _chain(1)
    snapshot = ModelSnapshot(net)
    with torch.no_grad():
        net[0].bias.add_(1)
    assert snapshot.changes() == ["0 (Linear)._parameters['bias']: written in place"]
    assert snapshot.restore() == ["0 (Linear)._parameters['bias'] (written in place)"]
