"""Load a model named on the command line and build its example inputs.

A model is named ``package.module:factory`` or ``path/to/file.py:factory``;
the factory is called with no arguments and returns an ``nn.Module`` or a
``(module, example_inputs)`` pair. Inputs are given as shapes:
``1,3,224,224`` (float, standard normal) or ``1,16:int64`` (integers 0..1).

A file is loaded as ``python path/to/file.py`` would run it: its folder is
searched first, so ``from helpers import Net`` finds ``helpers.py`` beside it
(the current directory, for ``package.module``). The folder comes off
``sys.path`` again after loading, or, inside :func:`command_search_path`
(each CLI command), when the command ends: a factory or pass that imports
its neighbours when called finds them too. sys.path ends as it began.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys


from ..errors import FxdebugError

__all__ = ["DEFAULT_MODEL", "DEFAULT_INPUT", "load_model", "parse_input", "make_inputs",
           "command_search_path"]

DEFAULT_MODEL = "torchvision.models:resnet18"
DEFAULT_INPUT = "1,3,224,224"
_FORMAT_HINT = ("Name a model as package.module:factory (e.g. torchvision.models:resnet18) "
                "or path/to/file.py:factory; the factory takes no arguments.")
_HINTS = {
    "model": _FORMAT_HINT,
    "loss": ("Name a loss as package.module:function or path/to/file.py:function (looked up "
             "from the current directory); the function takes the model output and returns a "
             "scalar tensor."),
    "pass": ("Name a pass as package.module:name or path/to/file.py:name (looked up from the "
             "current directory): a Pass class or instance, or a function gm -> gm."),
}


_COMMAND_FOLDERS: list[list[str]] = []  # folders each running command put on sys.path


@contextlib.contextmanager
def command_search_path():
    """Keep the folders that loading model, loss and pass files adds to ``sys.path`` until
    the end of the block, then take them off (the CLI runs each command inside one).

    >>> import sys
    >>> before = list(sys.path)
    >>> with command_search_path():
    ...     with _searched_first("/nonexistent/models"):
    ...         pass
    ...     sys.path[0]
    '/nonexistent/models'
    >>> sys.path == before
    True
    """
    added: list[str] = []
    _COMMAND_FOLDERS.append(added)
    try:
        yield
    finally:
        _COMMAND_FOLDERS.remove(added)
        for folder in reversed(added):
            _take_off(folder)


def _take_off(folder: str) -> None:
    if folder in sys.path:
        sys.path.remove(folder)


@contextlib.contextmanager
def _searched_first(folder: str):
    """``folder`` first on ``sys.path`` while importing, as ``python file.py`` puts the
    script's folder; taken off after (or at the end of the running command) if it was not there."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and _COMMAND_FOLDERS:
            _COMMAND_FOLDERS[-1].append(folder)
        elif added:
            _take_off(folder)


def _import_file(path: str, what: str = "model"):
    if not os.path.isfile(path):
        raise FxdebugError(f"{what} file {path!r} does not exist. {_hint(what)}")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    name = f"fxdebug_user_model_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FxdebugError(f"{what} file {path!r} cannot be imported as Python (name it *.py). "
                           f"{_hint(what)}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _searched_first(os.path.dirname(os.path.realpath(path))):
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(name, None)
            if isinstance(exc, ModuleNotFoundError):
                exc.add_note(f"fxdebug: raised while loading {what} file {path!r}, with its "
                             f"folder searched first as `python {path}` would: put the module "
                             f"beside the file, install it, or add its folder to PYTHONPATH")
            raise
    return module


def _hint(what: str) -> str:
    return _HINTS.get(what, _FORMAT_HINT)


def _import_module(where: str):
    """Import ``where`` with the current directory searched first, as ``python -m`` would."""
    with _searched_first(os.getcwd()):
        return importlib.import_module(where)


def load_object(spec: str, what: str = "model"):
    """The object named by ``package.module:name`` or ``path/to/file.py:name``.

    >>> load_object("torch.nn.functional:relu", "loss").__name__
    'relu'
    """
    if ":" not in spec:
        raise FxdebugError(f"{what} {spec!r} has no ':name' part. {_hint(what)}")
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        module = _import_file(where, what)
    else:
        try:
            module = _import_module(where)
        except ImportError as exc:
            raise FxdebugError(f"cannot import {where!r} for {what} {spec!r}: {exc}. "
                               f"{_hint(what)}") from exc
    found = getattr(module, name, None)
    if found is None or not callable(found):
        raise FxdebugError(f"{where!r} has no callable {name!r} for {what} {spec!r}. "
                           f"{_hint(what)}")
    return found


def load_model(spec: str):
    """Return ``(model, inputs_or_None)`` for ``spec``; the model is in eval mode.

    >>> model, inputs = load_model("torch.nn:Identity")
    >>> type(model).__name__, inputs
    ('Identity', None)
    """
    import torch
    # the factory file's folder stays searched while the factory runs (a CLI command keeps it
    # to the command's end)
    with contextlib.nullcontext() if _COMMAND_FOLDERS else command_search_path():
        factory = load_object(spec, "model")
        try:
            made = factory()
        except Exception as exc:
            exc.add_note(f"fxdebug: raised while building the model: factory {spec!r} "
                         f"(run with --traceback for every frame)")
            raise
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        made, inputs = made
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not isinstance(made, torch.nn.Module):
        raise FxdebugError(f"factory {spec!r} returned {type(made).__name__}; it must return an "
                           f"nn.Module or a (module, example_inputs) pair.")
    return made.eval(), inputs


def parse_input(text: str) -> tuple:
    """Parse ``"1,3,224,224"`` or ``"1,16:int64"`` into (shape, dtype).

    >>> parse_input("1,16:int64")
    ((1, 16), torch.int64)
    """
    import torch
    shape_text, _, dtype_text = text.partition(":")
    try:
        shape = tuple(int(part) for part in shape_text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or any(dim <= 0 for dim in shape):
        raise FxdebugError(f"--input {text!r} is not a shape: write positive sizes separated by "
                           f"commas, e.g. --input 1,3,224,224 or --input 1,16:int64.")
    dtype = torch.float32
    if dtype_text:
        named = getattr(torch, dtype_text, None)
        if not isinstance(named, torch.dtype):
            raise FxdebugError(f"--input {text!r}: {dtype_text!r} is not a torch dtype "
                               f"(try float32, float64, int64, bool).")
        dtype = named
    return shape, dtype


def make_inputs(specs: list[str], seed: int = 0) -> tuple:
    """Random inputs for the given ``--input`` specs, seeded.

    >>> [tuple(t.shape) for t in make_inputs(["2,3", "4:int64"])]
    [(2, 3), (4,)]
    """
    import torch
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for spec in specs:
        shape, dtype = parse_input(spec)
        if dtype.is_floating_point or dtype.is_complex:
            tensors.append(torch.randn(shape, generator=generator, dtype=dtype))
        else:
            tensors.append(torch.randint(0, 2, shape, generator=generator).to(dtype))
    return tuple(tensors)
