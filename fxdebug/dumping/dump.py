"""``dump()``: write a GraphModule to a folder of plain files that runs, moves and round-trips.

The folder::

    module.py         the model as code: imports, submodules built in __init__,
                      forward with one statement a line, each ending in
                      ``# [node key] user/file.py:line``; load() builds it and loads the weights
    weights.pt        every parameter and buffer (non-persistent ones too), once;
                      torch.load(..., weights_only=True)
    inputs.pt         the example inputs
    expected.pt       the outputs (and parameter gradients) the module gave when dumped
    settings.json     the numeric settings they were computed under (TF32, deterministic
                      algorithms, default dtype...: numeric_settings.py) and the devices;
                      run.py sets them again
    run.py            load, forward (--backward: and backward), compare, print the Records table
    breakpoints.json  node key -> line of module.py (what ``fxdebug debug --break KEY`` uses)
    README.md         what is where, what must be importable, what had to be pickled
    __init__.py       the folder is a package: ``from FOLDER import load``
    manifest.json     every file above with its size and sha256: what ``overwrite=True``
                      may replace (a folder holding anything else is never deleted)

Call tree::

    dump(gm, folder, *inputs)
      ├─ forward_code(gm)        forward.py: fx codegen, re-laid out: imports, one
      │                          statement a line, comments
      ├─ Structure(gm)           structure.py: submodules as code; torch.nn and other
      │                          importable classes rebuilt from extra_repr()/constructor
      │                          arguments and checked against the original, the rest
      │                          pickled (README says which)
      ├─ module_py(...)          forward.py + templates/module_*.py.tmpl
      ├─ expected_results(...)   expected.py: run a light copy (seed 0, shared weights,
      │                          writes to them guarded): outputs and parameter gradients
      ├─ run.py                  templates/run.py.tmpl + folder_runtime.py's functions
      └─ write_atomically()      writer.py: temporary folder in the same parent, then rename;
                                 leftovers of killed dumps cleaned, only manifest files replaced
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from typing import Any, BinaryIO, Callable

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..runtime import clone_inputs, flatten_tensors, torch_compat
from ..runtime.formatting import value_text
from ..frontend import trace
from ..tracing.keys import META_PASS, node_key
from ..tracing.modes import follow_mode
from .expected import expected_results
from .folder_runtime import NONDETERMINISTIC_RUNS, SPREAD_SCALE, first_line, run_py_source
from .forward import (PICKLED_FILE, class_name, forward_code, module_py, template, weights)
from .literals import Imports
from .numeric_settings import nondeterminism, read_settings, setting_text
from .standalone import standalone_copy
from .structure import Structure, tensor_file
from .writer import MANIFEST, prepare_destination, write_atomically

__all__ = ["dump", "FILES"]

FILES = ("__init__.py", "module.py", "run.py", "weights.pt", "inputs.pt", "expected.pt",
         "settings.json", "breakpoints.json", "README.md", MANIFEST)
KNOWN = FILES + (PICKLED_FILE,)  # every name a dump may write: what replacing one may delete


def _example_key(gm: fx.GraphModule) -> str:
    """A node of the model itself (not an inserted one) to show in the README, nested if possible."""
    keys = [node_key(n) for n in gm.graph.nodes
            if n.op in ("call_module", "call_function", "call_method") and not n.meta.get(META_PASS)]
    return next((k for k in keys if k.count(".") >= 2), keys[0] if keys else "KEY")


def _readme(cls: str, inputs: tuple, structure: Structure, imports: Imports, example: str,
            wrapped: list[str], copied: list[str], settings: dict, devices: list[str]) -> str:
    shapes = ", ".join(map(value_text, inputs))
    lines = [
        f"# {cls}, dumped by fxdebug",
        "",
        f"A traced `{cls}` as plain Python files, with its weights, example inputs "
        f"({shapes or 'none'}) and the results it gave when dumped.",
        "",
        "```bash",
        "python run.py                          # forward, compare outputs, print the Records table",
        "python run.py --backward               # also backward, compare parameter gradients",
        f"fxdebug debug . --break {example}   # pdb, stopped at that node's line of module.py",
        "```",
        "",
        "| file | what it holds |",
        "|---|---|",
        "| `module.py` | the model as code; every statement of `forward` ends with `# [node key] file:line` |",
        "| `weights.pt` | every parameter and buffer (non-persistent ones too), once; `torch.load(..., weights_only=True)` |",
        "| `inputs.pt` | the example inputs, a list |",
        "| `expected.pt` | `{\"outputs\": ..., \"grads\": ...}` recorded when dumped |",
        "| `settings.json` | the numeric settings (TF32, deterministic algorithms, default dtype...) "
        "they were computed under, which `run.py` sets again, and the devices |",
        "| `run.py` | loads, runs, compares (`torch.equal`, else `torch.allclose` with "
        "torch.testing's tolerances for the dtype; for gradients scaled by their largest "
        "element, so another machine or thread count passes) |",
        "| `breakpoints.json` | node key -> line of `module.py`, and the names of the node's inputs |",
    ]
    if structure.pickled:
        lines.append(f"| `{PICKLED_FILE}` | submodules that could not be written as code (below) |")
    lines += ["", "Every path is relative to this folder: move or copy it freely.", "",
              "## Numeric settings", "",
              "`run.py` first sets the settings that change what a model computes (TF32, float32 "
              "matmul precision, deterministic algorithms, cuDNN and oneDNN flags, attention "
              "backends, the default dtype, the CPU thread count) to those `expected.pt` was computed "
              "under, listed in "
              "`settings.json`, and prints those it changed. `load()` changes none of them: in "
              "your own process, set them yourself for the same numbers (for instance "
              + ", ".join(f"`{setting_text(name, settings[name])}`" for name in
                          ("torch.backends.cudnn.allow_tf32", "torch.get_float32_matmul_precision()",
                           "torch.get_num_threads()")
                          if name in settings) + ")."]
    why = nondeterminism(settings, devices)
    if why:
        lines += ["", f"Nondeterministic: {why}, so torch does not promise the same results twice; "
                  f"`run.py` runs the model {NONDETERMINISTIC_RUNS} times and widens each "
                  f"tolerance by {SPREAD_SCALE}x the largest difference between those runs."]
    lines += ["",
              "## Opening this folder runs its code", "",
              "`load()`, `python run.py` and `fxdebug debug` import `module.py` and run `run.py`: "
              "Python code, which can do anything your account can. Open only folders you trust, "
              "as with any pickle (see the warning in `torch.load`'s documentation). Tensors are "
              "read with `torch.load(..., weights_only=True)`"
              + (f"; `{PICKLED_FILE}` is unpickled with `weights_only=False` (module.py checks its "
                 f"sha256 first)." if structure.pickled else "; nothing is unpickled."), "",
              "## What must be importable", "",
              "module.py imports `torch`" + "".join(f", `{name}`" for name in imports.top_level_packages())
              + "; run it where these import as they did when it was dumped."]
    if "fxdebug" in imports.top_level_packages():
        lines += ["", "It keeps fxdebug's nodes (captures, gradient hooks, breakpoints), which call "
                  "`fxdebug.runtime`: install fxdebug where it runs. `fxdebug dump --standalone` "
                  "(`fxdebug.dump(..., standalone=True)`) writes a folder without them, which "
                  "needs torch and the model's own packages but not fxdebug."]
    if wrapped:
        lines += ["", "Functions kept as single calls with `torch.fx.wrap`: "
                  + ", ".join(f"`{name}`" for name in wrapped) + "."]
    if copied:
        lines += ["", "Copied into module.py from the script that was run (`__main__`), with the "
                  "constants and imports they use: " + ", ".join(f"`{name}`" for name in copied)
                  + "."]
    lines += ["", "## Submodules", ""]
    if structure.pickled_notes:
        lines.append(f"These submodules are pickled in `{PICKLED_FILE}` (their classes must be "
                     f"importable; their parameters and buffers are in `weights.pt`):")
        lines.append("")
        lines += [f"* `{note.path}` ({note.type_name}): {note.reason}" for note in structure.pickled_notes]
    else:
        lines.append("Every submodule is built by code in `module.py`; nothing is pickled.")
    if structure.hooked:
        lines += ["", "Hooks registered on these modules were not written (module.py registers "
                  "none): " + ", ".join(f"`{name}`" for name in structure.hooked) + "."]
    lines.append("")
    return "\n".join(lines)


def _devices(*values) -> list[str]:
    """The device types (``"cpu"``, ``"cuda"``) of every tensor in ``values``, sorted.

    >>> _devices({"w": torch.ones(1)}, [torch.ones(1)], 3)
    ['cpu']
    """
    return sorted({tensor.device.type for _, tensor in flatten_tensors(values)})


def _settings_json(settings: dict, devices: list[str]) -> str:
    """settings.json: ``{"settings": {name: value}, "devices": [...], "nondeterministic": why}``."""
    return json.dumps({"settings": settings, "devices": devices,
                       "nondeterministic": nondeterminism(settings, devices)}, indent=1) + "\n"


def _breakpoints_json(forward_line: int, nodes: dict[str, dict]) -> str:
    """``{"file", "forward_line", "nodes": {key: {line, node, op, source, inputs}}}``, a node a line."""
    rows = [f"  {json.dumps(key)}: {json.dumps(entry)}" for key, entry in nodes.items()]
    return ("{\n" f' "file": "module.py",\n "forward_line": {forward_line},\n "nodes": {{\n'
            + ",\n".join(rows) + "\n }\n}\n")


_PLAIN_LEAVES = (int, float, bool, str, type(None))


def _surely_loads(obj) -> bool:
    """Whether ``obj`` holds only what ``torch.load(weights_only=True)`` always loads.

    Dense tensors, numbers, strings and None in plain lists, tuples and dicts: no
    need to load the file back to know (10k gradients take seconds to unpickle).
    """
    stack = [obj]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in (torch.Tensor, torch.nn.Parameter):
            if value.layout != torch.strided or value.is_quantized:
                return False
        elif kind in (list, tuple):
            stack.extend(value)
        elif kind is dict:
            if not all(type(key) in (str, int) for key in value):
                return False
            stack.extend(value.values())
        elif kind not in _PLAIN_LEAVES:
            return False
    return True


def _plain_tensor_file(obj, what: str) -> bytes:
    """torch.save of ``obj``, checked to load with ``weights_only=True``."""
    try:
        data = tensor_file(obj)
        if not _surely_loads(obj):  # anything else: the weights_only unpickler decides
            torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # pickling or the weights_only unpickler refused a value
        raise FxdebugError(f"cannot dump {what}: they hold values torch.load(weights_only=True) "
                           f"cannot load ({type(exc).__name__}: {first_line(exc)}). Pass "
                           f"tensors, numbers, strings and lists/tuples/dicts of them.") from exc
    return data


def _refuse_pickling(structure: Structure) -> FxdebugError:
    listed = "; ".join(f"{note.path!r} ({note.type_name}): {note.reason}"
                       for note in structure.pickled_notes)
    return FxdebugError(
        f"cannot dump without pickling: fxdebug could not rebuild these submodules from code: "
        f"{listed}. Unpickling runs whatever code the file names (torch.load(..., "
        f"weights_only=False)), so fxdebug writes modules as code. Trace through them (do not list "
        f"their classes in leaf_modules), keep each constructor argument in an attribute of the "
        f"same name, or pass allow_pickled_modules=True (fxdebug dump --allow-pickle) to pickle them "
        f"into {PICKLED_FILE}.")


def dump(gm: torch.nn.Module, folder, *inputs, overwrite: bool = False,
         allow_pickled_modules: bool = False, standalone: bool = False) -> str:
    """Write ``gm`` to ``folder`` as a package that runs on its own and round-trips.

    Args:
        gm: a GraphModule (``fxdebug.trace``/``instrument`` output, or any
            ``torch.fx.GraphModule``); another ``nn.Module`` is traced first.
        folder: the folder to create. Its parent must exist.
        inputs: example inputs; the folder keeps them and the outputs (and
            parameter gradients) ``gm`` gives on them.
        overwrite: replace ``folder`` if it exists: only an empty folder, or an
            earlier dump holding exactly the files its manifest.json lists,
            unchanged (and the bytecode Python wrote for them), is ever replaced.
        allow_pickled_modules: pickle the submodules that cannot be rebuilt
            from code into pickled_modules.pt (loading it unpickles with
            ``weights_only=False``); without it, such a module is an error.
        standalone: leave out fxdebug's capture, gradient-recording and
            breakpoint nodes, so the folder runs where torch is installed and
            fxdebug is not (module.py then imports no fxdebug). Without it, a
            dump of an instrumented module imports ``fxdebug.runtime`` and
            says so in its README; a node that changes values (a gradient
            edit, a checkpoint) cannot be left out: an error names it.

    Returns:
        The absolute path of the folder. ``python FOLDER/run.py`` runs it;
        ``fxdebug debug FOLDER --break KEY`` steps through it in pdb.

    Raises:
        FxdebugError: a submodule cannot be rebuilt from code (and
            ``allow_pickled_modules`` is false), the folder exists (or holds files a dump did not write,
            or cannot be replaced for lack of permission), the graph calls a function that
            cannot be imported, a leaf module's class is defined locally, or
            writing failed. Nothing is left half-written.

    Example::

        >>> import os, tempfile, torch, fxdebug
        >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()))
        >>> folder = fxdebug.dump(gm, os.path.join(tempfile.mkdtemp(), "seq"), torch.randn(3, 4))
        >>> sorted(os.listdir(folder))[:4]
        ['README.md', '__init__.py', 'breakpoints.json', 'expected.pt']
        >>> code = open(os.path.join(folder, "module.py")).read()
        >>> print(next(line for line in code.splitlines() if "# [0]" in line).split("#")[0].strip())
        _0 = getattr(self, "0")(input_1)
    """
    if not isinstance(gm, torch.nn.Module):
        raise TypeError(f"fxdebug.dump expects a GraphModule or nn.Module, got {type(gm).__name__}.")
    folder = os.path.abspath(os.fspath(folder))
    parent = os.path.dirname(folder)
    if not os.path.isdir(parent):
        raise FxdebugError(f"cannot dump into {folder!r}: its parent folder {parent!r} does not "
                           f"exist. Create it first.")
    prepare_destination(folder, overwrite, KNOWN, hashes=False)  # before the work; again when writing
    if not isinstance(gm, fx.GraphModule):
        gm = trace(gm)
    follow_mode(gm)  # the graph of the modes the model is in now; module.py sets them again
    if standalone:
        gm = standalone_copy(gm)
    pytree_inputs = torch_compat.pytree_specs(gm.graph) is not None  # placeholders are the leaves
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args and not str(n.target).startswith("*")]
    varargs = any(str(n.target).startswith("*") for n in placeholders)
    if not pytree_inputs and (len(inputs) < len(required)
                              or (len(inputs) > len(placeholders) and not varargs)):
        raise FxdebugError(f"fxdebug.dump needs the example inputs of forward "
                           f"({', '.join(str(n.target) for n in placeholders)}): got {len(inputs)} "
                           f"input(s). Call fxdebug.dump(gm, folder, *inputs).")

    cls = class_name(gm)
    imports = Imports()
    forward = forward_code(gm, imports)
    structure = Structure(gm, imports)
    if structure.pickled and not allow_pickled_modules:
        raise _refuse_pickling(structure)
    pickled_bytes = structure.pickled_bytes()
    pickled_sha = hashlib.sha256(pickled_bytes).hexdigest() if pickled_bytes is not None else None
    weight_info = weights(gm)
    module_text, forward_line, node_lines = module_py(gm, cls, imports, forward, structure,
                                                      pickled_sha, pytree_inputs, weight_info)
    settings = read_settings()  # those expected_results computes under
    expected = expected_results(gm, inputs)
    devices = _devices(weight_info[0], list(inputs), expected)
    files: dict[str, bytes | Callable[[BinaryIO], Any]] = {
        "__init__.py": template("package_init.py.tmpl").format(cls=cls).encode(),
        "module.py": module_text.encode(),
        "run.py": template("run.py.tmpl").format(cls=cls, runtime=run_py_source(),
                                                  runs=NONDETERMINISTIC_RUNS,
                                                  spread_scale=SPREAD_SCALE).encode(),
        "breakpoints.json": _breakpoints_json(forward_line, node_lines).encode(),
        "README.md": _readme(cls, inputs, structure, imports, _example_key(gm),
                             forward.wrapped, forward.script.names(), settings, devices).encode(),
        "inputs.pt": _plain_tensor_file(list(clone_inputs(inputs)), "the example inputs"),
        "expected.pt": _plain_tensor_file(expected, "the outputs"),
        "settings.json": _settings_json(settings, devices).encode(),
        "weights.pt": functools.partial(torch.save, weight_info[0]),  # straight into the file
    }
    if pickled_bytes is not None:
        files[PICKLED_FILE] = pickled_bytes
    compile(module_text, os.path.join(folder, "module.py"), "exec")  # never write code that cannot parse
    write_atomically(folder, files, overwrite, KNOWN)
    return folder
