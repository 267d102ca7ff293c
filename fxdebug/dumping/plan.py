"""What goes into a dump folder, collected from the GraphModule once, as named values.

::

    plan_dump(gm, inputs) -> DumpPlan
      ├─ forward_code(gm)        forward.py: forward's statements and their imports
      ├─ Structure(gm)           structure.py: submodules as code (or pickled) and their imports
      ├─ weights_of(gm)          every parameter and buffer once, tied names, frozen names
      ├─ the node of each line   key, op, source line, inputs (breakpoints.json)
      ├─ read_settings()         numeric_settings.py: those the results are computed under
      └─ expected_results(...)   expected.py: outputs and parameter gradients of a copy

Everything after the plan (module_text.py, render.py, writer.py) reads only these
values: no GraphModule, no accumulator filled on the way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import keyword
import re

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..runtime import Recorder, flatten_tensors
from ..tracing.keys import META_PASS, META_SOURCE, node_key, op_name
from .expected import expected_results
from .forward import forward_code, node_where
from .literals import Imports
from .numeric_settings import read_settings
from .structure import Pickled, Structure

__all__ = ["Weights", "NodeEntry", "Line", "PickledModules", "ModulePlan", "DumpPlan",
           "plan_dump", "class_name", "weights_of", "PICKLED_FILE"]

PICKLED_FILE = "pickled_modules.pt"


@dataclasses.dataclass(frozen=True)
class Weights:
    tensors: dict[str, torch.Tensor]  # name -> tensor, each storage once (what weights.pt holds)
    tied: dict[str, str]              # a name sharing a tensor -> the name it is saved under
    frozen: list[str]                 # parameters with requires_grad=False


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """A node as breakpoints.json lists it (``line`` is added when module.py is written)."""
    key: str
    name: str
    fx_op: str          # "placeholder", "call_module", ..., "output"
    op: str             # what it does, for people: Conv2d, torch.flatten
    source: str         # the user's file:line, "" where there is none
    inputs: list[str]
    inserted_by: str    # the pass that inserted it, "" for the model's own nodes


@dataclasses.dataclass(frozen=True)
class Line:
    """One statement of forward and the node it belongs to (None: fx's input flattening)."""
    statement: str
    node: NodeEntry | None


@dataclasses.dataclass(frozen=True)
class PickledModules:
    data: bytes
    sha256: str
    notes: list[Pickled]   # which submodules, and why they could not be written as code


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """What module.py is made of."""
    cls: str
    imports: Imports
    script: str                       # functions copied from __main__ ("" when none)
    wrapped: list[str]
    signature: str
    lines: list[Line]
    init_lines: list[str]             # __init__'s body after super().__init__()
    weights: Weights
    training: bool
    training_exceptions: dict[str, bool]
    pickled: PickledModules | None


@dataclasses.dataclass(frozen=True)
class DumpPlan:
    module: ModulePlan
    inputs: tuple
    expected: dict          # {"outputs", "grads", "backward_error"}
    settings: dict          # numeric settings expected was computed under
    devices: list[str]
    example_key: str        # a node to show in the README
    copied: list[str]       # the script's names of the functions copied into module.py
    hooked: list[str]       # modules whose hooks module.py does not register


def class_name(gm: fx.GraphModule) -> str:
    """The class name module.py gives the module: ``gm``'s, unless it clashes with module.py's names.

    >>> class_name(torch.nn.Linear(1, 1)), class_name(torch.nn.Module())
    ('Linear', 'DumpedModule')
    """
    name = re.sub(r"\W", "_", type(gm).__name__) or "Dumped"
    if name[0].isdigit() or keyword.iskeyword(name) or name in ("torch", "os", "load", "HERE",
                                                                  "pickled", "Module"):
        name = f"Dumped{name}"
    return name


def weights_of(gm: torch.nn.Module) -> Weights:
    """Every parameter and buffer once (a view of a larger storage copied), tied and frozen names.

    >>> lin = torch.nn.Linear(2, 2); lin.bias.requires_grad_(False)
    Parameter containing:...
    >>> w = weights_of(torch.nn.ModuleDict({"a": lin, "b": lin}))
    >>> sorted(w.tensors), w.tied, w.frozen
    (['a.bias', 'a.weight'], {'b.weight': 'a.weight', 'b.bias': 'a.bias'}, ['a.bias'])
    """
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    frozen: list[str] = []
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        data = tensor.detach()
        if data.untyped_storage().nbytes() != data.numel() * data.element_size() or data.storage_offset():
            data = data.clone()  # a view into a larger storage: save only its own elements
        tensors[name] = data
        if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
            frozen.append(name)
    return Weights(tensors, tied, frozen)


def _training_exceptions(gm: torch.nn.Module) -> dict[str, bool]:
    """The modules in the other train/eval state than the root (containers fx made and the
    recorder do nothing with it, so they are left out)."""
    return {name: module.training for name, module in gm.named_modules(remove_duplicate=False)
            if name and module.training != gm.training
            and type(module) is not torch.nn.Module and not isinstance(module, Recorder)}


def _lines(gm: fx.GraphModule, statements) -> list[Line]:
    modules = dict(gm.named_modules(remove_duplicate=False))  # not get_submodule per node
    entries: dict[fx.Node, NodeEntry] = {}
    lines = []
    for statement in statements:
        node = statement.node
        if node is not None and node not in entries:
            source = node_where(node) if node.meta.get(META_SOURCE) else ""
            entries[node] = NodeEntry(node_key(node), node.name, node.op, op_name(node, gm, modules), source,
                                      [arg.name for arg in node.all_input_nodes],
                                      str(node.meta.get(META_PASS) or ""))
        lines.append(Line(statement.text, entries[node] if node is not None else None))
    return lines


def _example_key(gm: fx.GraphModule) -> str:
    """A node of the model itself (not an inserted one) to show in the README, nested if possible."""
    keys = [node_key(n) for n in gm.graph.nodes
            if n.op in ("call_module", "call_function", "call_method") and not n.meta.get(META_PASS)]
    return next((k for k in keys if k.count(".") >= 2), keys[0] if keys else "KEY")


def _devices(*values) -> list[str]:
    """The device types (``"cpu"``, ``"cuda"``) of every tensor in ``values``, sorted.

    >>> _devices({"w": torch.ones(1)}, [torch.ones(1)], 3)
    ['cpu']
    """
    return sorted({tensor.device.type for _, tensor in flatten_tensors(values)})


def _refuse_pickling(notes: list[Pickled]) -> FxdebugError:
    listed = "; ".join(f"{note.path!r} ({note.type_name}): {note.reason}" for note in notes)
    return FxdebugError(
        f"cannot dump without pickling: fxdebug could not rebuild these submodules from code: "
        f"{listed}. Unpickling runs whatever code the file names (torch.load(..., "
        f"weights_only=False)), so fxdebug writes modules as code. Trace through them (do not list "
        f"their classes in leaf_modules), keep each constructor argument in an attribute of the "
        f"same name, or pass allow_pickled_modules=True (fxdebug dump --allow-pickle) to pickle them "
        f"into {PICKLED_FILE}.")


def _pickled(structure: Structure, allow: bool) -> PickledModules | None:
    if not structure.pickled:
        return None
    if not allow:
        raise _refuse_pickling(structure.pickled_notes)
    data = structure.pickled_bytes()
    if data is None:
        return None
    return PickledModules(data, hashlib.sha256(data).hexdigest(), list(structure.pickled_notes))


def plan_dump(gm: fx.GraphModule, inputs: tuple, allow_pickled_modules: bool = False) -> DumpPlan:
    """Everything the folder holds, read from ``gm`` (in the modes it is in) and ``inputs``.

    >>> plan = plan_dump(torch.fx.symbolic_trace(torch.nn.Linear(2, 1)), (torch.ones(1, 2),))
    >>> plan.module.cls, [line.statement for line in plan.module.lines][-1], plan.devices
    ('Linear', 'return linear', ['cpu'])
    """
    cls = class_name(gm)
    forward = forward_code(gm, cls)
    structure = Structure(gm)
    pickled = _pickled(structure, allow_pickled_modules)
    weights = weights_of(gm)
    module = ModulePlan(cls, Imports.merged(forward.imports, structure.imports), forward.script.text(),
                        forward.wrapped, forward.signature, _lines(gm, forward.statements),
                        structure.lines, weights, gm.training, _training_exceptions(gm), pickled)
    settings = read_settings()  # those expected_results computes under
    expected = expected_results(gm, inputs)
    return DumpPlan(module, tuple(inputs), expected, settings,
                    _devices(weights.tensors, list(inputs), expected), _example_key(gm),
                    forward.script.names(), structure.hooked)
