"""The files of a dump folder, rendered from a :class:`~fxdebug.dumping.plan.DumpPlan`.

::

    render_files(plan) -> {file name: bytes, or a function writing the file}
      ├─ module.py, breakpoints.json   module_text.py
      ├─ run.py                        templates/run.py.tmpl + folder_runtime.py's functions
      ├─ README.md                     templates/README.md.tmpl
      ├─ settings.json, __init__.py
      └─ inputs.pt, expected.pt, weights.pt, pickled_modules.pt
"""

from __future__ import annotations

import functools
import io
import json
from typing import Any, BinaryIO, Callable

import torch

from ..errors import FxdebugError
from ..runtime import clone_inputs, leaves
from ..runtime.formatting import value_text
from .folder_runtime import NONDETERMINISTIC_RUNS, SPREAD_SCALE, first_line, run_py_source
from .module_text import module_text, template
from .numeric_settings import nondeterminism, setting_text
from .plan import PICKLED_FILE, DumpPlan
from .structure import tensor_file

__all__ = ["render_files"]


def _readme(plan: DumpPlan) -> str:
    """The folder's README.md: templates/README.md.tmpl, its optional paragraphs filled in."""
    module, settings = plan.module, plan.settings
    packages = module.imports.top_level_packages()
    pickled = module.pickled is not None
    pickled_notes = module.pickled.notes if module.pickled is not None else []
    why = nondeterminism(settings, plan.devices)
    if pickled_notes:
        submodules = "\n".join([f"These submodules are pickled in `{PICKLED_FILE}` (their classes "
                                f"must be importable; their parameters and buffers are in "
                                f"`weights.pt`):", ""]
                               + [f"* `{note.path}` ({note.type_name}): {note.reason}"
                                  for note in pickled_notes])
    else:
        submodules = "Every submodule is built by code in `module.py`; nothing is pickled."
    return template("README.md.tmpl").format(
        cls=module.cls, example=plan.example_key,
        shapes=", ".join(map(value_text, plan.inputs)) or "none",
        pickled_row=(f"\n| `{PICKLED_FILE}` | submodules that could not be written as code "
                     f"(below) |" if pickled else ""),
        setting_examples=", ".join(f"`{setting_text(name, settings[name])}`" for name in
                                   ("torch.backends.cudnn.allow_tf32",
                                    "torch.get_float32_matmul_precision()",
                                    "torch.get_num_threads()")
                                   if name in settings),
        nondeterministic=(f"\n\nNondeterministic: {why}, so torch does not promise the same "
                          f"results twice; `run.py` runs the model {NONDETERMINISTIC_RUNS} times "
                          f"and widens each tolerance by {SPREAD_SCALE}x the largest difference "
                          f"between those runs." if why else ""),
        unpickled=(f"; `{PICKLED_FILE}` is unpickled with `weights_only=False` (module.py checks "
                   f"its sha256 first)." if pickled else "; nothing is unpickled."),
        packages="".join(f", `{name}`" for name in packages),
        fxdebug_note=("\n\nIt keeps fxdebug's nodes (captures, gradient hooks, breakpoints), "
                      "which call `fxdebug.runtime`: install fxdebug where it runs. `fxdebug dump "
                      "--standalone` (`fxdebug.dump(..., standalone=True)`) writes a folder "
                      "without them, which needs torch and the model's own packages but not "
                      "fxdebug." if "fxdebug" in packages else ""),
        wrapped=("\n\nFunctions kept as single calls with `torch.fx.wrap`: "
                 + ", ".join(f"`{name}`" for name in module.wrapped) + "."
                 if module.wrapped else ""),
        copied=("\n\nCopied into module.py from the script that was run (`__main__`), with the "
                "constants and imports they use: "
                + ", ".join(f"`{name}`" for name in plan.copied) + "." if plan.copied else ""),
        submodules=submodules,
        hooked=("\n\nHooks registered on these modules were not written (module.py registers "
                "none): " + ", ".join(f"`{name}`" for name in plan.hooked) + "."
                if plan.hooked else ""))


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


def _opaque(value) -> bool:
    """Whether the walk stops at ``value``: anything but a plain list, tuple or dict of str/int keys."""
    kind = type(value)
    return not (kind is list or kind is tuple
                or (kind is dict and all(type(key) in (str, int) for key in value)))


def _surely_loads(obj) -> bool:
    """Whether ``obj`` holds only what ``torch.load(weights_only=True)`` always loads.

    Dense tensors, numbers, strings and None in plain lists, tuples and dicts: no
    need to load the file back to know (10k gradients take seconds to unpickle).

    >>> _surely_loads({"a": [torch.ones(1), 2, None]}), _surely_loads({(1, 2): torch.ones(1)})
    (True, False)
    """
    for _, leaf in leaves(obj, is_leaf=_opaque):
        kind = type(leaf)
        if kind in (torch.Tensor, torch.nn.Parameter):
            if leaf.layout != torch.strided or leaf.is_quantized:
                return False
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


def render_files(plan: DumpPlan) -> dict[str, bytes | Callable[[BinaryIO], Any]]:
    """Every file of the folder: its bytes, or a function writing it into a binary file."""
    cls = plan.module.cls
    module = module_text(plan.module)
    compile(module.text, "module.py", "exec")  # never write code that cannot parse
    files: dict[str, bytes | Callable[[BinaryIO], Any]] = {
        "__init__.py": template("package_init.py.tmpl").format(cls=cls).encode(),
        "module.py": module.text.encode(),
        "run.py": template("run.py.tmpl").format(cls=cls, runtime=run_py_source(),
                                                  runs=NONDETERMINISTIC_RUNS,
                                                  spread_scale=SPREAD_SCALE).encode(),
        "breakpoints.json": _breakpoints_json(module.forward_line, module.nodes).encode(),
        "README.md": _readme(plan).encode(),
        "inputs.pt": _plain_tensor_file(list(clone_inputs(plan.inputs)), "the example inputs"),
        "expected.pt": _plain_tensor_file(plan.expected, "the outputs"),
        "settings.json": _settings_json(plan.settings, plan.devices).encode(),
        "weights.pt": functools.partial(torch.save, plan.module.weights.tensors),  # straight into the file
    }
    if plan.module.pickled is not None:
        files[PICKLED_FILE] = plan.module.pickled.data
    return files
