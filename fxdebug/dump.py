"""``dump()``: write a GraphModule to a folder of plain files that runs, moves and round-trips.

The folder::

    module.py         the model as code: imports, submodules built in __init__,
                      forward with one statement a line, each ending in
                      ``# [node key] user/file.py:line``; load() builds it and loads the weights
    weights.pt        every parameter and buffer (non-persistent ones too), once;
                      torch.load(..., weights_only=True)
    inputs.pt         the example inputs
    expected.pt       the outputs (and parameter gradients) the module gave when dumped
    run.py            load, forward (--backward: and backward), compare, print the Records table
    breakpoints.json  node key -> line of module.py (what ``fxdebug debug --break KEY`` uses)
    README.md         what is where, what must be importable, what had to be pickled
    __init__.py       the folder is a package: ``from FOLDER import load``

Call tree::

    dump(gm, folder, *inputs)
      ├─ _Structure(gm)          submodules as code; torch.nn and other importable
      │                          classes rebuilt from extra_repr()/constructor arguments and
      │                          checked against the original, the rest pickled (README says which)
      ├─ _forward_code(gm)       fx codegen, re-laid out: imports, one statement a line, comments
      ├─ _expected(gm, inputs)   run a copy (seed 0): outputs and parameter gradients
      └─ _write_atomically()     temporary folder in the same parent, then rename
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import io
import json
import keyword
import math
import os
import re
import shutil
import sys
import tempfile
import types
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import _custom_builtins
from torch.package import sys_importer

from .errors import FxdebugError
from .keys import META_PASS, META_SOURCE, node_key, op_name
from .runtime import Recorder

__all__ = ["dump", "portable_location", "FILES"]

FILES = ("__init__.py", "module.py", "run.py", "weights.pt", "inputs.pt", "expected.pt",
         "breakpoints.json", "README.md")
PICKLED_FILE = "pickled_modules.pt"
_COMMENT_COLUMN = 60
_BASE_MODULE_ATTRS = dict.fromkeys(vars(torch.nn.Module()))
_HOOK_ATTRS = [k for k, v in vars(torch.nn.Module()).items() if "hook" in k and isinstance(v, dict)]
_DELETION = re.compile(r"^(?:[A-Za-z_]\w* = )+None$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


# -- locations ---------------------------------------------------------------------------
def portable_location(location) -> str:
    """``file:line`` without an absolute path: relative to the ``sys.path`` entry holding it.

    Files on no ``sys.path`` entry are shown by their base name, so a dump
    never records where it was written.

    >>> import os, sys, torch
    >>> site = os.path.dirname(os.path.dirname(torch.__file__))
    >>> portable_location((os.path.join(site, "torch", "nn", "modules", "conv.py"), 12))
    'torch/nn/modules/conv.py:12'
    >>> portable_location(("/nowhere/model.py", 3))
    'model.py:3'
    """
    if location is None:
        return "?"
    filename, lineno = location
    path = os.path.abspath(filename)
    best = ""
    for entry in sys.path:
        root = os.path.join(os.path.abspath(entry or os.curdir), "")
        if path.startswith(root) and len(root) > len(best):
            best = root
    relative = path[len(best):] if best else os.path.basename(path)
    return f"{relative.replace(os.sep, '/')}:{lineno}"


def _node_where(node: fx.Node) -> str:
    source = node.meta.get(META_SOURCE)
    return portable_location(source) if source else "no source line"


# -- literals: values that can be written as code and compared as text ---------------------
class _NotLiteral(Exception):
    pass


def _literal(value) -> str:
    """Python code that evaluates to ``value`` (raises _NotLiteral when there is none)."""
    if value is None or type(value) in (bool, int, str):
        return repr(value)
    if type(value) is float:
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "-float('inf')"
        return repr(value)
    if isinstance(value, torch.Size):
        return f"torch.Size({_literal(tuple(value))})"
    if type(value) is tuple:
        items = [_literal(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if type(value) is list:
        return f"[{', '.join(_literal(v) for v in value)}]"
    if type(value) is dict:
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return repr(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise _NotLiteral(type(value).__name__)


def _call_arguments(args, kwargs) -> str:
    return ", ".join([_literal(a) for a in args] + [f"{k}={_literal(v)}" for k, v in kwargs.items()])


# -- importable names -----------------------------------------------------------------------
def _importable(obj) -> tuple[str, str] | str:
    """``(module, qualname)`` under which ``obj`` can be imported, or why it cannot."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or ""
    if "<lambda>" in qualname:
        return "is a lambda"
    if "<locals>" in qualname:
        return f"is defined inside a function ({qualname})"
    if module == "__main__":
        return (f"is defined in the script being run (__main__.{qualname}), which the "
                f"dumped folder cannot import")
    try:
        module, qualname = sys_importer.get_name(obj)
    except Exception as exc:  # ObjNotFoundError / ObjMismatchError / ImportError
        return f"cannot be imported by name ({type(exc).__name__}: {exc})"
    if module == "_operator":
        module = "operator"
    return module, qualname


class _Imports:
    """The import block of module.py: lines and module-level assignments, sorted."""

    def __init__(self) -> None:
        self.lines: dict[str, None] = {"import torch": None}
        self.assignments: dict[str, None] = {}

    def add_object(self, name: str, module: str, qualname: str) -> None:
        if module == "builtins" and qualname == name:
            return
        if "." in qualname:
            self.lines[f"import {module}"] = None
            self.assignments[f"{name} = {module}.{qualname}"] = None
        elif qualname == name:
            self.lines[f"from {module} import {name}"] = None
        else:
            self.lines[f"from {module} import {qualname} as {name}"] = None

    def text(self) -> str:
        plain = sorted(line for line in self.lines if line.startswith("import "))
        froms = sorted(line for line in self.lines if line.startswith("from "))
        others = [line for line in self.lines if not line.startswith(("import ", "from "))]
        return "\n".join(plain + froms + others + list(self.assignments))

    def top_level_packages(self) -> list[str]:
        found: dict[str, None] = {}
        for line in sorted(self.lines):
            parts = line.split()
            if parts[0] in ("import", "from") and len(parts) > 1:
                found.setdefault(parts[1].split(".")[0])
        return [name for name in found if name not in sys.stdlib_module_names and name != "torch"]


# -- submodule structure ---------------------------------------------------------------------
def _attr_expr(parent: str, name: str) -> str:
    if name.isidentifier() and not keyword.iskeyword(name):
        return f"{parent}.{name}"
    return f"getattr({parent}, {json.dumps(name)})"


def _assign(parent: str, name: str, value: str) -> str:
    if name.isidentifier() and not keyword.iskeyword(name):
        return f"{parent}.{name} = {value}"
    return f"{parent}.add_module({json.dumps(name)}, {value})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _mismatch(original: torch.nn.Module, rebuilt: torch.nn.Module, path: str = "") -> str | None:
    """Why ``rebuilt`` differs from ``original`` (type, attributes, tensor names/shapes), or None."""
    where = path or "the module"
    if type(original) is not type(rebuilt):
        return f"{where} is a {type(rebuilt).__name__}, not a {type(original).__name__}"
    own = [k for k in vars(original) if k not in _BASE_MODULE_ATTRS]
    rebuilt_own = [k for k in vars(rebuilt) if k not in _BASE_MODULE_ATTRS]
    if sorted(own) != sorted(rebuilt_own):
        return f"{where} has attributes {sorted(own)}, rebuilt {sorted(rebuilt_own)}"
    for key in own:
        try:
            same = _literal(vars(original)[key]) == _literal(vars(rebuilt)[key])
        except _NotLiteral:
            return f"{where}.{key} is a {type(vars(original)[key]).__name__}, which cannot be written as code"
        if not same:
            return f"{where}.{key} is {vars(original)[key]!r}, rebuilt {vars(rebuilt)[key]!r}"
    for kind in ("_parameters", "_buffers"):
        mine, theirs = getattr(original, kind), getattr(rebuilt, kind)
        if list(mine) != list(theirs):
            return f"{where} has {kind[1:]} {list(mine)}, rebuilt {list(theirs)}"
        for name, tensor in mine.items():
            other = theirs[name]
            if (tensor is None) != (other is None) or (
                    tensor is not None and tuple(tensor.shape) != tuple(other.shape)):
                return f"{where}.{name} has another shape when rebuilt"
    if sorted(original._non_persistent_buffers_set) != sorted(rebuilt._non_persistent_buffers_set):
        return f"{where} has other non-persistent buffers when rebuilt"
    if list(original._modules) != list(rebuilt._modules):
        return f"{where} has children {list(original._modules)}, rebuilt {list(rebuilt._modules)}"
    for name, child in original._modules.items():
        other = rebuilt._modules[name]
        if (child is None) != (other is None):
            return f"{_join(path, name)} is missing when rebuilt"
        if child is not None:
            reason = _mismatch(child, other, _join(path, name))
            if reason:
                return reason
    return None


def _constructor_candidates(module: torch.nn.Module) -> list[tuple[tuple, dict]]:
    """Constructor arguments to try: those ``extra_repr()`` shows, then attributes named like parameters."""
    candidates: list[tuple[tuple, dict]] = []
    try:
        text = module.extra_repr()
        call = ast.parse(f"f({text})", mode="eval").body
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        if len(kwargs) == len(call.keywords):
            candidates.append((args, kwargs))
    except (SyntaxError, ValueError, TypeError, RecursionError, AttributeError):
        pass  # extra_repr is not a call's arguments: try the constructor's signature
    try:
        signature = inspect.signature(type(module))
    except (TypeError, ValueError):
        return candidates
    kwargs: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = getattr(module, parameter.name, inspect.Parameter.empty)
        if value is not inspect.Parameter.empty and not isinstance(value, (torch.Tensor, torch.nn.Module)):
            kwargs[parameter.name] = value
        elif parameter.default is parameter.empty:
            return candidates
    if ((), kwargs) not in candidates:
        candidates.append(((), kwargs))
    return candidates


@dataclasses.dataclass
class _Pickled:
    path: str
    type_name: str
    reason: str


class _Structure:
    """The ``__init__`` body that rebuilds gm's submodules, and what had to be pickled."""

    def __init__(self, gm: fx.GraphModule, imports: _Imports) -> None:
        self.gm = gm
        self.imports = imports
        self.lines: list[str] = []
        self.pickled: dict[str, torch.nn.Module] = {}
        self.pickled_notes: list[_Pickled] = []
        self._built: dict[int, str] = {}
        self.hooked = [name or "(the module itself)" for name, m in gm.named_modules()
                       if any(getattr(m, attr, None) for attr in _HOOK_ATTRS)]
        self._own_tensors(gm, "self")
        self._children(gm, "self", "")

    def _own_tensors(self, module: torch.nn.Module, expr: str) -> None:
        for name, param in module._parameters.items():
            value = "None" if param is None else (
                f"torch.nn.Parameter(torch.empty({_literal(tuple(param.shape))}, "
                f"dtype={param.dtype!r}))")
            self.lines.append(f"{expr}.register_parameter({json.dumps(name)}, {value})")
        for name, buffer in module._buffers.items():
            value = "None" if buffer is None else (
                f"torch.empty({_literal(tuple(buffer.shape))}, dtype={buffer.dtype!r})")
            persistent = name not in module._non_persistent_buffers_set
            extra = "" if persistent else ", persistent=False"
            self.lines.append(f"{expr}.register_buffer({json.dumps(name)}, {value}{extra})")

    def _children(self, module: torch.nn.Module, expr: str, path: str) -> None:
        for name, child in module._modules.items():
            child_path = _join(path, name)
            child_expr = _attr_expr(expr, name)
            if child is None:
                self.lines.append(_assign(expr, name, "None"))
                continue
            if id(child) in self._built:  # the same module object under two paths
                self.lines.append(_assign(expr, name, self._built[id(child)]))
                continue
            self._built[id(child)] = child_expr
            container = _container_code(child)
            if container is not None:
                self.lines.append(_assign(expr, name, container))
                self._own_tensors(child, child_expr)
                self._children(child, child_expr, child_path)
                continue
            code, reason = self._constructor_code(child, child_path)
            if code is None:
                self._pickle(child, child_path, reason)
                self.lines.append(_assign(expr, name, f"pickled[{json.dumps(child_path)}]")
                                  + f"  # pickled: {reason}")
            else:
                self.lines.append(_assign(expr, name, code))

    def _class_expr(self, cls: type, path: str) -> tuple[str, str]:
        """``(expression, module to import)`` for a module class; raises if it cannot be imported."""
        if getattr(torch.nn, cls.__name__, None) is cls:
            return f"torch.nn.{cls.__name__}", "torch"
        found = _importable(cls)
        if isinstance(found, str):
            raise FxdebugError(
                f"cannot dump submodule {path!r}: its class {cls.__qualname__} {found}. "
                f"module.py must build or unpickle every leaf module, and both need the class "
                f"by its import path. Define {cls.__name__} at the top level of an importable "
                f"module, or trace through it (do not list it in leaf_modules), then dump again.")
        module, qualname = found
        self.imports.lines[f"import {module}"] = None
        return f"{module}.{qualname}", module

    def _constructor_code(self, module: torch.nn.Module, path: str) -> tuple[str | None, str]:
        cls = type(module)
        cls_expr, module_name = self._class_expr(cls, path)
        if cls is Recorder:
            return f"{cls_expr}()", ""
        reason = f"{cls.__name__}'s constructor arguments could not be recovered"
        importlib.import_module(module_name)  # so that the dotted path resolves
        root = module_name.split(".")[0]
        namespace = {"torch": torch, "float": float, root: importlib.import_module(root)}
        for args, kwargs in _constructor_candidates(module):
            try:
                code = f"{cls_expr}({_call_arguments(args, kwargs)})"
            except _NotLiteral:
                continue
            try:
                with torch.random.fork_rng(devices=[]), torch.device("meta"):
                    rebuilt = eval(code, namespace)  # code made of literals and the class path
            except Exception:  # the guess is wrong: try the next one, pickle if none fits
                continue
            mismatch = _mismatch(module, rebuilt)
            if mismatch is None:
                return code, ""
            reason = f"{cls.__name__}({_call_arguments(args, kwargs)[:60]}) differs: {mismatch}"
        return None, reason

    def _pickle(self, module: torch.nn.Module, path: str, reason: str) -> None:
        self._class_expr(type(module), path)  # raises for classes that cannot be imported
        self.pickled[path] = module
        self.pickled_notes.append(_Pickled(path, type(module).__name__, reason))

    def pickled_bytes(self) -> bytes | None:
        """The pickled submodules, with parameters and buffers on the meta device (weights.pt has them)."""
        if not self.pickled:
            return None
        memo: dict[int, Any] = {}
        for module in self.pickled.values():
            for tensor in list(module.parameters()) + list(module.buffers()):
                meta = tensor.detach().to("meta")
                if isinstance(tensor, torch.nn.Parameter):
                    meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = meta
        light: dict[str, torch.nn.Module] = {}
        for path, module in self.pickled.items():
            try:
                light[path] = copy.deepcopy(module, dict(memo))  # tensors -> meta, no data copied
                torch.save(light[path], io.BytesIO())
            except Exception as exc:
                raise FxdebugError(
                    f"cannot dump submodule {path!r} ({type(module).__name__}): it cannot be "
                    f"written as code ({self._reason(path)}) and pickling it failed: "
                    f"{type(exc).__name__}: {exc}. Make its attributes picklable (no lambdas or "
                    f"local functions), or trace through it instead of keeping it a leaf.") from exc
        return _tensor_file(light)

    def _reason(self, path: str) -> str:
        return next((note.reason for note in self.pickled_notes if note.path == path), "")


def _container_code(module: torch.nn.Module) -> str | None:
    """Code for an empty container (fx's plain ``Module`` and torch's own containers)."""
    if type(module) is torch.nn.Module:
        return "torch.nn.Module()"
    if type(module) in (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict):
        if not [k for k in vars(module) if k not in _BASE_MODULE_ATTRS]:
            return f"torch.nn.{type(module).__name__}()"
    return None


# -- forward ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Forward:
    lines: list[tuple[str, fx.Node | None]]   # (statement, node it belongs to)
    signature: str                             # "def forward(self, x):"
    wrapped: list[str]                         # global names fx.wrap must know


def _node_comment(node: fx.Node | None) -> str:
    if node is None:  # torch.fx's own input flattening
        return "# [inputs]"
    parts = [f"# [{node_key(node)}]"]
    if node.op != "output" and node.meta.get(META_SOURCE):
        parts.append(_node_where(node))
    if node.meta.get(META_PASS):
        parts.append(f"(inserted by {node.meta[META_PASS]})")
    return " ".join(parts)


def _forward_code(gm: fx.GraphModule, imports: _Imports) -> _Forward:
    code = gm.graph.python_code(root_module="self")
    src_lines = code.src.split("\n")
    def_index = code._prologue_start - 1
    if not src_lines[def_index].startswith("def forward"):
        raise FxdebugError("fxdebug.dump does not understand the code torch.fx generated for this "
                           "graph (no 'def forward' where expected); please report it with the model.")
    wrapped = re.findall(r'wrap\("(\w+)"\)', "\n".join(src_lines[:def_index]))
    nodes = list(gm.graph.nodes)
    lines: list[tuple[str, fx.Node | None]] = []
    for offset, raw in enumerate(src_lines[def_index + 1:], start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        index = (code._lineno_map or {}).get(offset)
        node = nodes[index] if index is not None and 0 <= index < len(nodes) else None
        parts = text.split(";  ")
        lines.append((parts[0], node))
        for part in parts[1:]:
            if not _DELETION.match(part):  # fx frees values after their last use: the dump
                lines.append((part, node))  # keeps them, so pdb can print any of them
    body = "\n".join([src_lines[def_index]] + [text for text, _ in lines])
    used = dict.fromkeys(_IDENTIFIER.findall(body))
    for name, obj in code.globals.items():
        if name not in used or name == "wrap":
            continue
        if name in _custom_builtins:
            imports.lines[_custom_builtins[name].import_str] = None
            continue
        if isinstance(obj, types.ModuleType):
            imports.lines[f"import {obj.__name__}" + ("" if name == obj.__name__ else f" as {name}")] = None
            continue
        found = _importable(obj)
        if isinstance(found, str):
            user = next((n for n in nodes if n.target is obj), None)
            where = (f"node {node_key(user)!r} ({_node_where(user)})" if user is not None
                     else "the graph")
            raise FxdebugError(
                f"cannot dump: {where} calls {getattr(obj, '__qualname__', name)}, which {found}. "
                f"module.py imports every function the graph calls; move it to the top level of "
                f"an importable module (and torch.fx.wrap it there if it must stay one node), "
                f"then trace and dump again.")
        imports.add_object(name, *found)
    return _Forward(lines, src_lines[def_index], [w for w in wrapped if w in used])


# -- expected values (the functions below are copied into run.py) ---------------------------
def flatten_outputs(value, prefix="output"):
    """Flatten a (nested) output into ``{"output/0/logits": tensor, ...}``; other leaves kept if simple.

    >>> list(flatten_outputs((torch.ones(1), {"b": 2})))
    ['output/0', 'output/1/b']
    """
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        items = list(zip(value._fields, value))
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    elif isinstance(value, dict):
        items = list(value.items())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif value is None or isinstance(value, (bool, int, float, str)):
        return {prefix: value}
    else:
        return {}
    flat = {}
    for name, item in items:
        flat.update(flatten_outputs(item, f"{prefix}/{name}"))
    return flat


def loss_of(flat):
    """The scalar backward starts from: the sum of every floating output that requires grad.

    >>> loss_of({"a": torch.ones(2, requires_grad=True), "b": torch.ones(3)})
    tensor(2., grad_fn=<SumBackward0>)
    """
    terms = [t.sum() for t in flat.values()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def first_line(exc):
    """The first line of an exception's message (what run.py compares for a failing backward).

    >>> first_line(RuntimeError("broken\\ndetails"))
    'broken'
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def compare(title, expected, got):
    """Print how ``got`` compares with ``expected`` (dicts of values); return whether all match.

    >>> compare("outputs", {"y": torch.ones(2)}, {"y": torch.ones(2) + 1e-7})
    outputs: 1 close
      y: close (max abs diff 1.19e-07)
    True
    """
    verdicts = {}
    for key, want in expected.items():
        have = got.get(key)
        if not isinstance(want, torch.Tensor):
            verdicts[key] = "equal" if have == want else f"DIFFERENT ({have!r} != {want!r})"
        elif not isinstance(have, torch.Tensor):
            verdicts[key] = "MISSING"
        elif have.shape != want.shape or have.dtype != want.dtype:
            verdicts[key] = (f"DIFFERENT (shape {tuple(have.shape)} {have.dtype}, "
                             f"expected {tuple(want.shape)} {want.dtype})")
        elif torch.equal(have, want):
            verdicts[key] = "equal"
        else:
            diff = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
            if torch.allclose(have, want, rtol=1e-5, atol=1e-6, equal_nan=True):
                verdicts[key] = f"close (max abs diff {diff:.3g})"
            else:
                verdicts[key] = f"DIFFERENT (max abs diff {diff:.3g})"
    counts = {}
    for verdict in verdicts.values():
        word = verdict.split(" ")[0]
        counts[word] = counts.get(word, 0) + 1
    print(f"{title}: " + ", ".join(f"{n} {word}" for word, n in counts.items()))
    for key, verdict in verdicts.items():
        if verdict != "equal" or len(verdicts) <= 8:
            print(f"  {key}: {verdict}")
    return all(v == "equal" or v.startswith("close") for v in verdicts.values())


def _clone(value):
    def one(item):
        if isinstance(item, torch.Tensor):
            return item.detach().clone().requires_grad_(item.requires_grad)
        return item
    return torch.utils._pytree.tree_map(one, value)


def _expected(gm: fx.GraphModule, inputs: tuple) -> dict:
    """Outputs and parameter gradients of a copy of ``gm`` (seed 0, the caller's RNG untouched)."""
    from .debugger import stops_disabled
    model = copy.deepcopy(gm)
    with torch.random.fork_rng(devices=[]), stops_disabled():
        torch.manual_seed(0)
        flat = flatten_outputs(model(*_clone(inputs)))
        grads: dict[str, torch.Tensor] = {}
        backward_error = ""
        loss = loss_of(flat) if torch.is_grad_enabled() else None
        if loss is not None:
            try:
                loss.backward()
            except RuntimeError as exc:  # e.g. an in-place op autograd rejects: run.py shows it again
                backward_error = first_line(exc)
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                     if p.grad is not None and not backward_error}
    outputs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    return {"outputs": outputs, "grads": grads, "backward_error": backward_error}


# -- weights ----------------------------------------------------------------------------------
def _weights(gm: fx.GraphModule) -> tuple[dict, dict, list]:
    """(name -> tensor, tied name -> first name, frozen parameter names)."""
    first: dict[int, str] = {}
    weights: dict[str, torch.Tensor] = {}
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
        weights[name] = data
        if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
            frozen.append(name)
    return weights, tied, frozen


def _training_flags(gm: torch.nn.Module) -> tuple[bool, dict[str, bool]]:
    """The root's train/eval state and the modules in the other state (containers fx made
    and the recorder do nothing with it, so they are left out)."""
    exceptions = {name: module.training for name, module in gm.named_modules(remove_duplicate=False)
                  if name and module.training != gm.training
                  and type(module) is not torch.nn.Module and not isinstance(module, Recorder)}
    return gm.training, exceptions


# -- file contents ----------------------------------------------------------------------------
def _class_name(gm: fx.GraphModule) -> str:
    name = re.sub(r"\W", "_", type(gm).__name__) or "Dumped"
    if name[0].isdigit() or keyword.iskeyword(name) or name in ("torch", "os", "load", "HERE",
                                                                  "pickled", "Module"):
        name = f"Dumped{name}"
    return name


def _pad(statement: str, comment: str, indent: str) -> str:
    text = f"{indent}{statement}"
    return f"{text.ljust(_COMMENT_COLUMN)}  {comment}" if len(text) < _COMMENT_COLUMN else f"{text}  {comment}"


_MODULE_HEAD = '''"""{cls}, written by fxdebug.dump: the traced model as plain Python.

Every statement of ``forward`` ends with ``# [node key] file:line`` (the
statement of your model it comes from); breakpoints.json maps each key to its
line here. ``load()`` builds the module and loads weights.pt. Values are kept
until forward returns, so pdb can print any of them.
"""

import os

{imports}
{wrap}
HERE = os.path.dirname(os.path.abspath(__file__))
FROZEN = {frozen}  # parameters with requires_grad=False
TIED = {tied}  # name -> the name whose tensor it shares
TRAINING = {training}  # train() / eval() state of the module
TRAINING_EXCEPTIONS = {training_exceptions}  # submodules in the other state
'''

_PICKLED_LOADER = '''

def _pickled_modules(folder=HERE):
    """The submodules that could not be written as code (see README.md); their tensors are in weights.pt."""
    return torch.load(os.path.join(folder, "{pickled_file}"), weights_only=False)
'''

_MODULE_TAIL = '''

def _set_tensor(model, name, tensor):
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        if not isinstance(tensor, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=name not in FROZEN)
        module._parameters[attr] = tensor
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise KeyError(f"weights.pt has {{name!r}}, which is neither a parameter nor a buffer of {cls}")


def load(folder=HERE, map_location=None):
    """Build {cls} and load every parameter and buffer from ``folder``/weights.pt."""
    model = {cls}()
    weights = torch.load(os.path.join(folder, "weights.pt"), map_location=map_location,
                         weights_only=True)
    for name, tensor in weights.items():
        _set_tensor(model, name, tensor)
    for name, source in TIED.items():
        owner, _, attr = source.rpartition(".")
        module = model.get_submodule(owner)
        _set_tensor(model, name, module._parameters.get(attr, module._buffers.get(attr)))
    expected = set(name for name, _ in model.named_parameters(remove_duplicate=False))
    expected |= set(name for name, _ in model.named_buffers(remove_duplicate=False))
    missing = sorted(expected - set(weights) - set(TIED))
    if missing:
        raise KeyError(f"weights.pt lacks {{missing[:5]}}; the folder is incomplete")
    model.train(TRAINING)
    for path, flag in TRAINING_EXCEPTIONS.items():
        model.get_submodule(path).training = flag
    return model
'''

_RUN = '''"""Run the dumped {cls} on the dumped inputs and compare with what it gave when dumped.

    python run.py              forward, compare the outputs, print the Records table
    python run.py --backward   also backward; compare the parameter gradients

Written by fxdebug.dump. Paths are relative to this folder: move or copy it freely.
To step through forward in pdb: fxdebug debug FOLDER --break NODE_KEY
"""

import argparse
import dataclasses
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def import_module():
    """module.py of this folder, imported by its path."""
    spec = importlib.util.spec_from_file_location("fxdebug_dumped_module",
                                                  os.path.join(HERE, "module.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


{flatten}

{loss}

{first_line}

{compare}

def main(argv=None):
    parser = argparse.ArgumentParser(description="Run the dumped {cls} and compare with the "
                                                 "outputs recorded when it was dumped.")
    parser.add_argument("--backward", action="store_true",
                        help="also run backward and compare the parameter gradients")
    args = parser.parse_args(argv)
    model = import_module().load()
    inputs = torch.load(os.path.join(HERE, "inputs.pt"), weights_only=True)
    expected = torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)
    torch.manual_seed(0)
    with torch.set_grad_enabled(args.backward):
        got = flatten_outputs(model(*inputs))
    ok = compare("outputs", expected["outputs"], got)
    if args.backward:
        loss = loss_of(got)
        if loss is None:
            print("gradients: no output requires grad, nothing to compare")
        else:
            try:
                loss.backward()
                error = ""
            except RuntimeError as exc:
                error = first_line(exc)
            if error or expected["backward_error"]:
                same = error == expected["backward_error"]
                print(f"gradients: backward failed: {{error or 'no error'}}")
                print("  as it did when dumped" if same else
                      f"  when dumped: {{expected['backward_error'] or 'no error'}}")
                ok = same and ok
            else:
                grads = {{name: p.grad for name, p in model.named_parameters() if p.grad is not None}}
                ok = compare("gradients", expected["grads"], grads) and ok
    if hasattr(model, "fxdebug_recorder"):
        import fxdebug
        print(fxdebug.records(model).table())
    print("ok: same results as when dumped" if ok else "FAILED: results differ from when dumped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
'''

_INIT = '''"""{cls}, dumped by fxdebug: ``from FOLDER import load; model = load()``."""

from .module import {cls}, load

__all__ = ["{cls}", "load"]
'''


def _example_key(gm: fx.GraphModule) -> str:
    """A node of the model itself (not an inserted one) to show in the README, nested if possible."""
    keys = [node_key(n) for n in gm.graph.nodes
            if n.op in ("call_module", "call_function", "call_method") and not n.meta.get(META_PASS)]
    return next((k for k in keys if k.count(".") >= 2), keys[0] if keys else "KEY")


def _readme(cls: str, inputs: tuple, structure: _Structure,
            imports: _Imports, example: str, wrapped: list[str]) -> str:
    shapes = ", ".join("x".join(map(str, t.shape)) + f" {str(t.dtype).replace('torch.', '')}"
                       if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs)
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
        "| `run.py` | loads, runs, compares (`torch.equal`, else `torch.allclose`) |",
        "| `breakpoints.json` | node key -> line of `module.py`, and the names of the node's inputs |",
    ]
    if structure.pickled:
        lines.append(f"| `{PICKLED_FILE}` | submodules that could not be written as code (below) |")
    lines += ["", "Every path is relative to this folder: move or copy it freely.", "",
              "## What must be importable", "",
              "module.py imports `torch`" + "".join(f", `{name}`" for name in imports.top_level_packages())
              + "; run it where these import as they did when it was dumped."]
    if wrapped:
        lines += ["", "Functions kept as single calls with `torch.fx.wrap`: "
                  + ", ".join(f"`{name}`" for name in wrapped) + "."]
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


def _breakpoints_json(forward_line: int, nodes: dict[str, dict]) -> str:
    """``{"file", "forward_line", "nodes": {key: {line, node, op, source, inputs}}}``, a node a line."""
    rows = [f"  {json.dumps(key)}: {json.dumps(entry)}" for key, entry in nodes.items()]
    return ("{\n" f' "file": "module.py",\n "forward_line": {forward_line},\n "nodes": {{\n'
            + ",\n".join(rows) + "\n }\n}\n")


def _tensor_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _plain_tensor_file(obj, what: str) -> bytes:
    """torch.save of ``obj``, checked to load with ``weights_only=True``."""
    try:
        data = _tensor_file(obj)
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # pickling or the weights_only unpickler refused a value
        raise FxdebugError(f"cannot dump {what}: they hold values torch.load(weights_only=True) "
                           f"cannot load ({type(exc).__name__}: {first_line(exc)}). Pass "
                           f"tensors, numbers, strings and lists/tuples/dicts of them.") from exc
    return data


# -- writing --------------------------------------------------------------------------------
def _looks_like_dump(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "breakpoints.json"))
            and os.path.isfile(os.path.join(path, "run.py"))) or not os.listdir(path)


def _write_atomically(folder: str, files: dict[str, bytes], overwrite: bool) -> None:
    parent = os.path.dirname(folder)
    name = os.path.basename(folder)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise FxdebugError(f"cannot write dump folder {folder!r}: creating a folder in "
                           f"{parent!r} failed ({exc.strerror}). Choose a folder whose parent is "
                           f"writable.") from exc
    old = None
    try:
        for filename, data in files.items():
            try:
                with open(os.path.join(tmp, filename), "wb") as handle:
                    handle.write(data)
            except OSError as exc:
                raise FxdebugError(f"cannot write dump folder {folder!r}: writing {filename} "
                                   f"failed ({exc.strerror}); nothing was written. Free disk "
                                   f"space or choose another folder.") from exc
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.lexists(folder):
            old = tempfile.mkdtemp(prefix=f".{name}.", suffix=".old", dir=parent)
            os.rename(folder, os.path.join(old, name))
        try:
            os.rename(tmp, folder)
        except OSError as exc:
            if old is not None:
                os.rename(os.path.join(old, name), folder)
            raise FxdebugError(f"cannot write dump folder {folder!r}: renaming the finished "
                               f"temporary folder failed ({exc.strerror}).") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _module_py(gm: fx.GraphModule, cls: str, imports: _Imports, forward: _Forward,
               structure: _Structure, has_pickled: bool, pytree_inputs: bool
               ) -> tuple[str, int, dict[str, dict]]:
    """module.py's text, the line of ``def forward`` and, for every node key, its line and inputs."""
    _, tied, frozen = _weights(gm)
    training, training_exceptions = _training_flags(gm)
    extra_attrs = []
    if pytree_inputs:  # forward flattens its inputs with specs kept on the module
        from torch.utils._pytree import treespec_dumps
        for attr in ("_in_spec", "_out_spec"):
            spec = getattr(gm, attr, None)
            if spec is not None:
                extra_attrs.append(f"self.{attr} = torch.utils._pytree.treespec_loads("
                                   f"{treespec_dumps(spec)!r})")
    head = _MODULE_HEAD.format(
        cls=cls, imports=imports.text(),
        wrap="".join(f'\ntorch.fx.wrap("{name}")\n' for name in forward.wrapped),
        frozen=_literal(tuple(frozen)), tied=_literal(tied), training=training,
        training_exceptions=_literal(training_exceptions))
    if has_pickled:
        head += _PICKLED_LOADER.format(pickled_file=PICKLED_FILE)
    out = head.rstrip("\n").split("\n") + ["", "", f"class {cls}(torch.nn.Module):",
                                           "    def __init__(self):", "        super().__init__()"]
    if has_pickled:
        out.append("        pickled = _pickled_modules()")
    out += [f"        {line}" for line in structure.lines + extra_attrs]
    out += ["", f"    {forward.signature}"]
    forward_line = len(out)
    node_lines: dict[str, dict] = {}
    for statement, node in forward.lines:
        out.append(_pad(statement, _node_comment(node), "        "))
        if node is not None and node.op != "placeholder" and node_key(node) not in node_lines:
            node_lines[node_key(node)] = {
                "line": len(out), "node": node.name, "op": op_name(node, gm),
                "source": _node_where(node), "inputs": [arg.name for arg in node.all_input_nodes]}
    return "\n".join(out) + "\n" + _MODULE_TAIL.format(cls=cls), forward_line, node_lines


def dump(gm: torch.nn.Module, folder, *inputs, overwrite: bool = False) -> str:
    """Write ``gm`` to ``folder`` as a package that runs on its own and round-trips.

    Args:
        gm: a GraphModule (``fxdebug.trace``/``instrument`` output, or any
            ``torch.fx.GraphModule``); another ``nn.Module`` is traced first.
        folder: the folder to create. Its parent must exist.
        inputs: example inputs; the folder keeps them and the outputs (and
            parameter gradients) ``gm`` gives on them.
        overwrite: replace ``folder`` if it exists (only an earlier dump or an
            empty folder is ever replaced).

    Returns:
        The absolute path of the folder. ``python FOLDER/run.py`` runs it;
        ``fxdebug debug FOLDER --break KEY`` steps through it in pdb.

    Raises:
        FxdebugError: the folder exists, the graph calls a function that
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
    if os.path.lexists(folder):
        if not overwrite:
            raise FxdebugError(f"cannot dump into {folder!r}: it already exists. Pass "
                               f"overwrite=True (--overwrite) to replace it, or choose another folder.")
        if not os.path.isdir(folder) or not _looks_like_dump(folder):
            raise FxdebugError(f"refusing to overwrite {folder!r}: it is not an fxdebug dump "
                               f"(no run.py and breakpoints.json) nor an empty folder.")
    if not isinstance(gm, fx.GraphModule):
        from .tracing import trace
        gm = trace(gm)
    from torch.fx.graph import _PyTreeCodeGen
    pytree_inputs = isinstance(gm.graph._codegen, _PyTreeCodeGen)  # placeholders are the leaves
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args and not str(n.target).startswith("*")]
    varargs = any(str(n.target).startswith("*") for n in placeholders)
    if not pytree_inputs and (len(inputs) < len(required)
                              or (len(inputs) > len(placeholders) and not varargs)):
        raise FxdebugError(f"fxdebug.dump needs the example inputs of forward "
                           f"({', '.join(str(n.target) for n in placeholders)}): got {len(inputs)} "
                           f"input(s). Call fxdebug.dump(gm, folder, *inputs).")

    cls = _class_name(gm)
    imports = _Imports()
    forward = _forward_code(gm, imports)
    structure = _Structure(gm, imports)
    pickled_bytes = structure.pickled_bytes()
    module_py, forward_line, node_lines = _module_py(gm, cls, imports, forward, structure,
                                                     pickled_bytes is not None, pytree_inputs)
    weights = _weights(gm)[0]
    files = {
        "__init__.py": _INIT.format(cls=cls).encode(),
        "module.py": module_py.encode(),
        "run.py": _RUN.format(cls=cls, flatten=inspect.getsource(flatten_outputs).rstrip(),
                              loss=inspect.getsource(loss_of).rstrip(),
                              first_line=inspect.getsource(first_line).rstrip(),
                              compare=inspect.getsource(compare)).encode(),
        "breakpoints.json": _breakpoints_json(forward_line, node_lines).encode(),
        "README.md": _readme(cls, inputs, structure, imports, _example_key(gm),
                             forward.wrapped).encode(),
        "inputs.pt": _plain_tensor_file(list(_clone(inputs)), "the example inputs"),
        "expected.pt": _plain_tensor_file(_expected(gm, inputs), "the outputs"),
        "weights.pt": _tensor_file(weights),
    }
    if pickled_bytes is not None:
        files[PICKLED_FILE] = pickled_bytes
    compile(module_py, os.path.join(folder, "module.py"), "exec")  # never write code that cannot parse
    _write_atomically(folder, files, overwrite)
    return folder
