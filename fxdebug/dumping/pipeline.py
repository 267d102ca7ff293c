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

A pipeline, each step reading only what the one before it made::

    dump(gm, *inputs, folder=)
      ├─ prepare_destination()   writer.py: refuse an existing folder before any work
      ├─ trace, follow_mode, standalone_copy: the GraphModule to write, in the modes it is in
      ├─ plan_dump(gm, inputs)   plan.py: forward's statements, the submodules as code (or
      │                          pickled), the weights, the numeric settings, the expected
      │                          results, as named values (DumpPlan)
      ├─ render_files(plan)      render.py: every file's bytes (module_text.py: module.py,
      │                          breakpoints.json; run.py carries folder_runtime.py's functions)
      └─ write_atomically()      writer.py: temporary folder in the same parent, then rename;
                                 leftovers of killed dumps cleaned, only manifest files replaced
"""

from __future__ import annotations

import os

import torch
import torch.fx as fx

from ..errors import FxdebugError, deprecated
from ..frontend import trace
from ..base import torch_compat
from ..tracing.modes import follow_mode
from .plan import PICKLED_FILE, plan_dump
from .render import render_files
from .standalone import standalone_copy
from .writer import MANIFEST, prepare_destination, write_atomically

__all__ = ["dump", "FILES"]

FILES = ("__init__.py", "module.py", "run.py", "weights.pt", "inputs.pt", "expected.pt",
         "settings.json", "breakpoints.json", "README.md", MANIFEST)
KNOWN = FILES + (PICKLED_FILE,)  # every name a dump may write: what replacing one may delete


def _check_inputs(gm: fx.GraphModule, inputs: tuple) -> None:
    """Raise unless ``inputs`` are as many as forward takes (pytree inputs: any, fx checks them)."""
    pytree_inputs = torch_compat.pytree_specs(gm.graph) is not None  # placeholders are the leaves
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args and not str(n.target).startswith("*")]
    varargs = any(str(n.target).startswith("*") for n in placeholders)
    if not pytree_inputs and (len(inputs) < len(required)
                              or (len(inputs) > len(placeholders) and not varargs)):
        raise FxdebugError(f"fxdebug.dump needs the example inputs of forward "
                           f"({', '.join(str(n.target) for n in placeholders)}): got {len(inputs)} "
                           f"input(s). Call fxdebug.dump(gm, *inputs, folder=folder).")


def dump(gm: torch.nn.Module, *inputs, folder: str | os.PathLike | None = None,
         overwrite: bool = False, allow_pickled_modules: bool = False,
         standalone: bool = False) -> str:
    """Write ``gm`` to ``folder`` as a package that runs on its own and round-trips.

    Args:
        gm: a GraphModule (``fxdebug.trace``/``instrument`` output, or any
            ``torch.fx.GraphModule``); another ``nn.Module`` is traced first.
        inputs: example inputs; the folder keeps them and the outputs (and
            parameter gradients) ``gm`` gives on them.
        folder: the folder to create (keyword-only, as every option after the
            inputs; ``dump(gm, folder, *inputs)`` before). Its parent must exist.
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
        >>> folder = fxdebug.dump(gm, torch.randn(3, 4), folder=os.path.join(tempfile.mkdtemp(), "seq"))
        >>> sorted(os.listdir(folder))[:4]
        ['README.md', '__init__.py', 'breakpoints.json', 'expected.pt']
        >>> code = open(os.path.join(folder, "module.py")).read()
        >>> print(next(line for line in code.splitlines() if "# [0]" in line).split("#")[0].strip())
        _0 = getattr(self, "0")(input_1)
    """
    if not isinstance(gm, torch.nn.Module):
        raise TypeError(f"fxdebug.dump expects a GraphModule or nn.Module, got {type(gm).__name__}.")
    if folder is None:
        if not inputs or not isinstance(inputs[0], (str, os.PathLike)):
            raise FxdebugError("fxdebug.dump needs the folder to write: "
                               "fxdebug.dump(gm, *inputs, folder=folder).")
        deprecated("fxdebug.dump(gm, folder, *inputs)", "fxdebug.dump(gm, *inputs, folder=folder)")
        folder, inputs = inputs[0], inputs[1:]
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
    _check_inputs(gm, inputs)
    plan = plan_dump(gm, inputs, allow_pickled_modules)
    write_atomically(folder, render_files(plan), overwrite, KNOWN)
    return folder
