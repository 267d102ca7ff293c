"""Submodules as code: the ``__init__`` body of module.py, and what had to be pickled.

torch.nn modules and other importable classes are rebuilt from their
``extra_repr()`` or constructor arguments, on the meta device, and compared
with the original (type, attributes, parameter and buffer names and shapes);
a module no guess rebuilds is pickled instead, and the folder's README says
which and why.
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
from typing import Any

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..runtime import Recorder
from ..base import torch_compat
from .literals import Imports, NotLiteral, call_arguments, importable, literal

__all__ = ["Structure", "Pickled", "tensor_file", "BASE_MODULE_ATTRS"]

BASE_MODULE_ATTRS = dict.fromkeys(vars(torch.nn.Module()))
_HOOK_ATTRS = [k for k, v in vars(torch.nn.Module()).items() if "hook" in k and isinstance(v, dict)]


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


def _non_persistent(module: torch.nn.Module) -> list[str]:
    return [name for name in torch_compat.own_buffers(module)
            if not torch_compat.is_persistent_buffer(module, name)]


def _mismatch(original: torch.nn.Module, rebuilt: torch.nn.Module, path: str = "") -> str | None:
    """Why ``rebuilt`` differs from ``original`` (type, attributes, tensor names/shapes), or None."""
    where = path or "the module"
    if type(original) is not type(rebuilt):
        return f"{where} is a {type(rebuilt).__name__}, not a {type(original).__name__}"
    own = [k for k in vars(original) if k not in BASE_MODULE_ATTRS]
    rebuilt_own = [k for k in vars(rebuilt) if k not in BASE_MODULE_ATTRS]
    if sorted(own) != sorted(rebuilt_own):
        return f"{where} has attributes {sorted(own)}, rebuilt {sorted(rebuilt_own)}"
    for key in own:
        try:
            same = literal(vars(original)[key]) == literal(vars(rebuilt)[key])
        except NotLiteral:
            return f"{where}.{key} is a {type(vars(original)[key]).__name__}, which cannot be written as code"
        if not same:
            return f"{where}.{key} is {vars(original)[key]!r}, rebuilt {vars(rebuilt)[key]!r}"
    for kind, own_tensors in (("parameters", torch_compat.own_parameters),
                              ("buffers", torch_compat.own_buffers)):
        mine, theirs = own_tensors(original), own_tensors(rebuilt)
        if list(mine) != list(theirs):
            return f"{where} has {kind} {list(mine)}, rebuilt {list(theirs)}"
        for name, tensor in mine.items():
            other = theirs[name]
            if (tensor is None) != (other is None) or (
                    tensor is not None and tuple(tensor.shape) != tuple(other.shape)):
                return f"{where}.{name} has another shape when rebuilt"
    if _non_persistent(original) != _non_persistent(rebuilt):
        return f"{where} has other non-persistent buffers when rebuilt"
    children, rebuilt_children = torch_compat.own_children(original), torch_compat.own_children(rebuilt)
    if list(children) != list(rebuilt_children):
        return f"{where} has children {list(children)}, rebuilt {list(rebuilt_children)}"
    for name, child in children.items():
        other = rebuilt_children[name]
        if (child is None) != (other is None):
            return f"{_join(path, name)} is missing when rebuilt"
        if child is not None and other is not None:
            reason = _mismatch(child, other, _join(path, name))
            if reason:
                return reason
    return None


def _repr_arguments(text: str) -> tuple[tuple, dict] | None:
    """``extra_repr()`` text read as a call's literal arguments, or None."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if not isinstance(call, ast.Call):  # text closed the call early: "x), g(y"
            return None
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    except (SyntaxError, ValueError, TypeError, RecursionError, AttributeError):
        return None  # extra_repr is not a call's arguments: try the constructor's signature
    return (args, kwargs) if len(kwargs) == len(call.keywords) else None


def _signature(cls: type) -> inspect.Signature | None:
    try:
        return inspect.signature(cls)
    except (TypeError, ValueError):
        return None


def _constructor_candidates(module: torch.nn.Module, cache: dict | None = None
                            ) -> list[tuple[tuple, dict]]:
    """Constructor arguments to try: those ``extra_repr()`` shows, then attributes named like parameters.

    ``cache`` (optional) keeps what depends only on the class or the repr text
    (the parsed ``extra_repr()``, the constructor's signature) across modules.
    """
    cache = {} if cache is None else cache
    candidates: list[tuple[tuple, dict]] = []
    try:
        text = module.extra_repr()
    except (ValueError, TypeError, RecursionError, AttributeError):  # try the signature
        text = None
    if isinstance(text, str):
        key: tuple[str, Any] = ("repr", text)
        if key not in cache:
            cache[key] = _repr_arguments(text)
        if cache[key] is not None:
            args, literal = cache[key]
            candidates.append((args, dict(literal)))
    key = ("signature", type(module))
    if key not in cache:
        cache[key] = _signature(type(module))
    signature = cache[key]
    if signature is None:
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
class Pickled:
    path: str
    type_name: str
    reason: str


class Structure:
    """The ``__init__`` body that rebuilds gm's submodules, the imports it needs, and what had
    to be pickled."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.imports = Imports()
        self.lines: list[str] = []
        self.pickled: dict[str, torch.nn.Module] = {}
        self.pickled_notes: list[Pickled] = []
        self._built: dict[int, str] = {}
        self._rebuilt: dict[str, torch.nn.Module | None] = {}  # constructor code -> its module
        self._candidates: dict = {}  # parsed extra_repr texts, signatures per class
        self._classes: dict[type, tuple[str, dict]] = {}  # class -> (its expression, eval namespace)
        self.hooked = [name or "(the module itself)" for name, m in gm.named_modules()
                       if any(getattr(m, attr, None) for attr in _HOOK_ATTRS)]
        self._own_tensors(gm, "self")
        self._children(gm, "self", "")

    def _own_tensors(self, module: torch.nn.Module, expr: str) -> None:
        for name, param in torch_compat.own_parameters(module).items():
            value = "None" if param is None else (
                f"torch.nn.Parameter(torch.empty({literal(tuple(param.shape))}, "
                f"dtype={param.dtype!r}))")
            self.lines.append(f"{expr}.register_parameter({json.dumps(name)}, {value})")
        for name, buffer in torch_compat.own_buffers(module).items():
            value = "None" if buffer is None else (
                f"torch.empty({literal(tuple(buffer.shape))}, dtype={buffer.dtype!r})")
            persistent = torch_compat.is_persistent_buffer(module, name)
            extra = "" if persistent else ", persistent=False"
            self.lines.append(f"{expr}.register_buffer({json.dumps(name)}, {value}{extra})")

    def _children(self, module: torch.nn.Module, expr: str, path: str) -> None:
        for name, child in torch_compat.own_children(module).items():
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
        found = importable(cls)
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
        if isinstance(module, Recorder):  # a part's recorder files into its whole model's
            # Recorder: the dumped part runs alone, so it records its own runs (begin_part
            # starts a run on a plain Recorder)
            return f"{self._class_expr(Recorder, path)[0]}()", ""
        known = self._classes.get(cls)
        if known is None:
            cls_expr, module_name = self._class_expr(cls, path)
            importlib.import_module(module_name)  # so that the dotted path resolves
            root = module_name.split(".")[0]
            namespace = {"torch": torch, "float": float, root: importlib.import_module(root)}
            known = self._classes[cls] = (cls_expr, namespace)
        cls_expr, namespace = known
        reason = f"{cls.__name__}'s constructor arguments could not be recovered"
        for args, kwargs in _constructor_candidates(module, self._candidates):
            try:
                code = f"{cls_expr}({call_arguments(args, kwargs)})"
            except NotLiteral:
                continue
            rebuilt = self._rebuild(code, namespace)
            if rebuilt is None:  # the guess is wrong: try the next one, pickle if none fits
                continue
            mismatch = _mismatch(module, rebuilt)
            if mismatch is None:
                return code, ""
            reason = f"{cls.__name__}({call_arguments(args, kwargs)[:60]}) differs: {mismatch}"
        return None, reason

    def _rebuild(self, code: str, namespace: dict) -> torch.nn.Module | None:
        """The module ``code`` builds on the meta device (None if it raises), built once per text.

        5000 ``Linear(8, 8)`` are one check: the same text builds the same module
        (literals and a class path, the RNG forked), and comparing only reads it.
        """
        if code not in self._rebuilt:
            try:
                with torch.random.fork_rng(devices=[]), torch.device("meta"):
                    self._rebuilt[code] = eval(code, namespace)  # literals and the class path
            except Exception:  # the guess is wrong: the caller tries the next one
                self._rebuilt[code] = None
        return self._rebuilt[code]

    def _pickle(self, module: torch.nn.Module, path: str, reason: str) -> None:
        self._class_expr(type(module), path)  # raises for classes that cannot be imported
        self.pickled[path] = module
        self.pickled_notes.append(Pickled(path, type(module).__name__, reason))

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
        return tensor_file(light)

    def _reason(self, path: str) -> str:
        return next((note.reason for note in self.pickled_notes if note.path == path), "")


def _container_code(module: torch.nn.Module) -> str | None:
    """Code for an empty container (fx's plain ``Module`` and torch's own containers)."""
    if type(module) is torch.nn.Module:
        return "torch.nn.Module()"
    if type(module) in (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict):
        if not [k for k in vars(module) if k not in BASE_MODULE_ATTRS]:
            return f"torch.nn.{type(module).__name__}()"
    return None


def tensor_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
