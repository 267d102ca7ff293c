"""``lint_inplace``: in-place writes that break autograd, found before any backward.

PyTorch reports "one of the variables needed for gradient computation has been
modified by an inplace operation" only when ``backward()`` runs, names no line,
and says nothing at all when the write goes through ``.data``: the gradients
are then silently wrong. ``lint_inplace`` finds these writes up front, in two
layers:

1. **Static candidates** from the traced graph: methods ending in ``_``
   (``x.zero_()``), ``x[i] = v``, augmented assignment (``x += y``; fxdebug's
   tracer keeps it in place), modules and functions with ``inplace=True``,
   ``out=`` arguments, ``Embedding(max_norm=...)`` (it renormalises its weight
   in place on every call) and reads of ``.data``.
2. **Confirmation** in one forward run of a private copy of the model (the
   model, its inputs and the global RNG are left as they were; no backward is
   run). After each node the run walks the autograd graph built so far,
   recording every tensor autograd saved (``grad_fn._saved_*``) with its
   version; a node that changes the version of a saved tensor is the write
   backward would fail on. Writes through ``.data`` do not change versions, so
   for every candidate the saved tensors sharing its storage are also compared
   by value before and after it. No ``saved_tensors_hooks`` are installed.

A candidate whose write changed a saved value is an ``"error"``; the other
candidates are ``"warning"`` (harmless in this run, e.g. resnet's
``ReLU(inplace=True)``, but worth knowing).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Iterable

import torch
import torch.fx as fx

from ..runtime import flatten_tensors, map_tensors
from ..frontend import keyed_module
from ..base import torch_compat
from ..base.fit_to_width import fit_table, table_width
from ..base.formatting import format_location
from ..runtime.inplace_ops import INPLACE_OPERATORS, OPERATOR_SYMBOLS
from ..base.report import Report
from ..tracing.alias_rules import alias_inputs, inplace_requested, mutated_argument
from ..tracing.keys import META_SOURCE, node_key, op_name

__all__ = ["Hazard", "Hazards", "lint_inplace"]

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "record_stream_"})
_INPLACE_MESSAGE = "modified by an inplace operation"


@dataclasses.dataclass(frozen=True)
class Hazard:
    """One in-place write found by :func:`lint_inplace`.

    Attributes:
        key: stable key of the node that writes in place (``"layer1.0.iadd"``).
        op: what that node does (``"Tensor.zero_"``, ``"operator.setitem"``, ``"ReLU"``).
        location: the user's ``file:line`` of the write.
        severity: ``"error"`` (it changed a value autograd saved for backward)
            or ``"warning"`` (an in-place write that changed nothing saved in
            the lint run).
        destroys: key of the node whose saved value the write changes (a
            parameter's name for parameters), or ``None``.
        saved_by: key of the node whose backward needs that value, or ``None``.
        problem: what goes wrong, in a sentence.
        fix: what to write instead, in a sentence.
        source: ``(filename, lineno)`` behind ``location``.

    Example::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         y = torch.relu(x)
        ...         y += 1
        ...         return y
        >>> hazard = fxdebug.lint_inplace(Net(), torch.randn(3, requires_grad=True))[0]
        >>> hazard.severity, hazard.key, hazard.destroys, hazard.saved_by
        ('error', 'iadd', 'relu', 'relu')
        >>> hazard.fix
        'write x = x + y instead of x += y'
    """

    key: str
    op: str
    location: str
    severity: str
    destroys: str | None
    saved_by: str | None
    problem: str
    fix: str
    source: tuple[str, int] | None = None

    def __str__(self) -> str:
        return (f"{self.severity}: {self.key} ({self.op}, {self.location}): {self.problem} "
                f"Fix: {self.fix}")


class Hazards(Report):
    """What :func:`lint_inplace` returns: :class:`Hazard` items in graph order.

    A sequence (``len``, ``for``, ``hazards[0]``) and a report: ``ok`` when
    nothing breaks backward (warnings allowed), ``table()``, a one-line ``repr``.

    >>> Hazards()
    <Hazards 0 hazard(s), OK>
    >>> Hazards().table()
    'no in-place hazards'
    """

    verdict_words = ("OK", "BREAKS BACKWARD")

    def __init__(self, hazards: Iterable[Hazard] = ()) -> None:
        self.hazards: list[Hazard] = list(hazards)

    def append(self, hazard: Hazard) -> None:
        self.hazards.append(hazard)

    def __iter__(self):
        return iter(self.hazards)

    def __len__(self) -> int:
        return len(self.hazards)

    def __getitem__(self, index):
        return self.hazards[index]

    def __bool__(self) -> bool:
        return bool(self.hazards)

    def __eq__(self, other) -> bool:
        if isinstance(other, Hazards):
            other = other.hazards
        return self.hazards == other

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by its hazards: unhashable

    @property
    def ok(self) -> bool:
        """No hazard breaks backward (warnings may remain)."""
        return not self.errors

    def _size(self) -> str:
        return f"{len(self.hazards)} hazard(s)"

    def _finding(self) -> str:
        first = next(iter(self.errors or self.hazards), None)
        return "" if first is None else f"{first.severity} at {first.key} ({first.location})"

    @property
    def errors(self) -> list[Hazard]:
        """The hazards that break backward (or silently corrupt gradients)."""
        return [hazard for hazard in self.hazards if hazard.severity == "error"]

    @property
    def warnings(self) -> list[Hazard]:
        """In-place writes that changed no saved value in the lint run."""
        return [hazard for hazard in self.hazards if hazard.severity == "warning"]

    def table(self, wide: bool | None = None) -> str:
        """One row per hazard: severity, key, op, line, destroyed value, saved by, fix."""
        if not self.hazards:
            return "no in-place hazards"
        rows = [(h.severity, h.key, h.op, h.location, h.destroys or "-", h.saved_by or "-", h.fix)
                for h in self.hazards]
        body = fit_table(rows, ("severity", "key", "op", "line", "destroys", "saved by", "fix"),
                         width=table_width(wide), drop=("saved by", "destroys", "op"),
                         truncate=("key", "line"))  # the fix in full: it says what to do
        return f"{body}\n{len(self.errors)} error(s), {len(self.warnings)} warning(s)"


@dataclasses.dataclass
class _Candidate:
    node: fx.Node
    kind: str  # method, operator, setitem, module, function, torch_function, out, embedding, data
    target: fx.Node | None         # the node whose storage is written (None: a parameter)
    through: str | None = None     # "data" / "detach" when the write goes through that alias
    module: torch.nn.Module | None = None


def _through(node: fx.Node, root) -> tuple[str | None, fx.Node | None]:
    """``("data", node)`` when ``node`` is (a view of) ``x.data``; ``("detach", ...)`` likewise."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 64:
        if node.op == "call_function" and node.target is getattr and node.args[1:2] == ("data",):
            return "data", node
        if (node.op == "call_method" and node.target == "detach") or (
                node.op == "call_function" and node.target is torch.detach):
            return "detach", node
        sources = alias_inputs(node, root) if node.op in ("call_method", "call_function") else []
        if not sources or mutated_argument(node, root) is not None:
            return None, None
        node, seen = sources[0], seen + 1
    return None, None


def _static_candidates(gm: fx.GraphModule) -> dict[fx.Node, _Candidate]:
    found: dict[fx.Node, _Candidate] = {}
    written_data: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            try:
                module = gm.get_submodule(node.target)
            except AttributeError:
                module = None
            if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
                found[node] = _Candidate(node, "embedding", None, module=module)
                continue
        if node.op == "call_method" and node.target in _NOT_WRITES:
            continue
        target = mutated_argument(node, gm)
        if target is None:
            continue
        if "out" in node.kwargs:
            kind = "out"
        elif node.op == "call_method":
            kind = "method"
        elif node.op == "call_module":
            kind = "module"
        elif node.target is operator.setitem:
            kind = "setitem"
        elif node.target in INPLACE_OPERATORS:
            kind = "operator"
        elif inplace_requested(node):
            kind = "function"
        else:
            kind = "torch_function"
        through, alias = _through(target, gm)
        if alias is not None:
            written_data.add(alias)
        found[node] = _Candidate(node, kind, target, through)
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is getattr and node.args[1:2] == ("data",)
                and node not in written_data):
            found[node] = _Candidate(node, "data", None)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def _fix(candidate: _Candidate, gm: fx.GraphModule) -> str:
    node = candidate.node
    if candidate.through == "data":
        return ("never write through .data: compute the new value out of place (with "
                ".detach() instead, PyTorch at least reports the clash)")
    if candidate.through == "detach":
        return ("a .detach() shares the storage of the value it detaches: compute the new value "
                "out of place instead of writing to it")
    if candidate.kind == "method":
        name = str(node.target)
        if name == "zero_":
            return "use torch.zeros_like(x) (or x * 0) instead of x.zero_()"
        if hasattr(torch.Tensor, name[:-1]):
            return f"use the out-of-place x = x.{name[:-1]}(...) instead of x.{name}(...)"
        return f"clone first: x = x.clone(); x.{name}(...)"
    if candidate.kind == "operator":
        symbol = OPERATOR_SYMBOLS.get(node.target, "+")
        return f"write x = x {symbol} y instead of x {symbol}= y"
    if candidate.kind == "setitem":
        return "clone before the write (x = x.clone(); x[...] = v), or write before x is used"
    if candidate.kind == "module":
        return f"construct {op_name(node, gm)} with inplace=False"
    if candidate.kind == "function":
        return "pass inplace=False"
    if candidate.kind == "torch_function":
        name = getattr(node.target, "__name__", "f_")
        return f"use the out-of-place {name[:-1]}(...) instead of {name}(...)"
    if candidate.kind == "out":
        return "drop out=... and use the returned tensor"
    if candidate.kind == "embedding":
        return (f"read the weight as {node.target}.weight.clone() where it is used directly, or "
                f"renormalise it under torch.no_grad() before the forward")
    if candidate.kind == "data":
        return "use .detach() instead of .data: writes through .data are invisible to autograd"
    return "compute the value out of place"


class _Entry:
    """One tensor autograd saved: the saved tensor, its version at saving, who saved it."""

    __slots__ = ("tensor", "version", "storage", "owner", "broken")

    def __init__(self, tensor, owner):
        self.tensor = tensor
        self.version = torch_compat.tensor_version(tensor)
        self.storage = _storage(tensor)
        self.owner = owner
        self.broken = False


def _storage(tensor: torch.Tensor):
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested or meta tensors
        return None
    return (str(tensor.device), pointer) if pointer else None




class _Stop(Exception):
    """Ends the lint run after a candidate raised in the forward."""


class _Watch(fx.Interpreter):
    """Runs the graph once, keeping every value, and watches autograd's saved tensors."""

    def __init__(self, gm: fx.GraphModule, candidates: dict[fx.Node, _Candidate]):
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.candidates = candidates
        self.entries: list[_Entry] = []
        self.seen: dict = {}
        self.produced: list[tuple[fx.Node, torch.Tensor]] = []
        self.damage: dict[fx.Node, list[tuple[_Entry | None, str]]] = {}
        self.failure: tuple[fx.Node, BaseException] | None = None
        self.current: fx.Node | None = None

    # -- the run ---------------------------------------------------------------------------
    def run_node(self, node: fx.Node):
        self.current = node
        candidate = self.candidates.get(node)
        snapshots = self._snapshot(candidate) if candidate is not None else []
        try:
            result = super().run_node(node)
        except RuntimeError as exc:
            if candidate is None or candidate.kind == "data":
                raise
            self.failure = (node, exc)
            raise _Stop from exc
        self._check_versions(node)
        for entry, before in snapshots:
            if not entry.broken and not _same_values(entry.tensor, before):
                entry.broken = True
                self.damage.setdefault(node, []).append((entry, "value"))
        for _, tensor in flatten_tensors(result):
            self.produced.append((node, tensor))
            self._discover(node, tensor)
        return result

    def _written_tensor(self, candidate: _Candidate):
        if candidate.kind == "embedding":
            return getattr(candidate.module, "weight", None)
        value = self.env.get(candidate.target) if candidate.target is not None else None
        return value if isinstance(value, torch.Tensor) else None

    def _snapshot(self, candidate: _Candidate):
        if candidate.kind == "data":
            return []
        written = self._written_tensor(candidate)
        storage = _storage(written) if written is not None else None
        if storage is None:
            return []
        with torch.no_grad():
            return [(entry, entry.tensor.detach().clone()) for entry in self.entries
                    if not entry.broken and entry.storage == storage]

    def _check_versions(self, node: fx.Node) -> None:
        for entry in self.entries:
            if not entry.broken and torch_compat.tensor_version(entry.tensor) != entry.version:
                entry.broken = True
                self.damage.setdefault(node, []).append((entry, "version"))

    def _discover(self, owner: fx.Node, tensor: torch.Tensor) -> None:
        stack = [tensor.grad_fn] if tensor.grad_fn is not None else []
        while stack:
            fn = stack.pop()
            if fn in self.seen:
                continue
            self.seen[fn] = owner
            for name in torch_compat.saved_tensor_names(fn):
                if torch_compat.saved_tensor_has_unpack_hooks(fn, name):
                    continue  # checkpointed or offloaded: unpacking would run the user's hooks
                try:
                    saved = getattr(fn, name)
                except RuntimeError as exc:
                    if _INPLACE_MESSAGE not in str(exc):
                        raise
                    self.damage.setdefault(owner, []).append((None, "inside"))
                    continue
                for item in saved if isinstance(saved, (tuple, list)) else (saved,):
                    if isinstance(item, torch.Tensor) and _storage(item) is not None:
                        self.entries.append(_Entry(item, owner))
            stack.extend(next_fn for next_fn, _ in reversed(fn.next_functions)
                         if next_fn is not None)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.all((a == b) | (torch.isnan(a) & torch.isnan(b))))
    return torch.equal(a, b)


def _value_names(gm: fx.GraphModule, watch: _Watch):
    """Map a tensor to the key of the node (or the parameter name) it is the value of."""
    exact: dict[tuple, str] = {}
    by_storage: dict[tuple, str] = {}
    for node, tensor in watch.produced:
        storage = _storage(tensor)
        if storage is None:
            continue
        layout = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        exact.setdefault(layout, node_key(node))
        by_storage.setdefault(storage, node_key(node))
    for name, tensor in list(gm.named_parameters()) + list(gm.named_buffers()):
        storage = _storage(tensor)
        if storage is not None:
            by_storage.setdefault(storage, name)

    def name_of(tensor: torch.Tensor) -> str | None:
        storage = _storage(tensor)
        layout = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        return exact.get(layout) or by_storage.get(storage)

    return name_of


def _problem(candidate: _Candidate | None, how: str, destroys, saved_by, more: int) -> str:
    extra = f" (and {more} more saved value(s))" if more else ""
    if how == "inside":
        return ("writes in place inside this node to a value its own backward needs: backward "
                "will raise 'modified by an inplace operation'.")
    what = f"overwrites {destroys!r}, which autograd saved for the backward of {saved_by!r}{extra}"
    if how == "value":
        via = "through .data" if candidate is not None and candidate.through == "data" else \
            "without autograd noticing"
        return f"{what}, {via}: backward will silently compute wrong gradients."
    if candidate is None:
        return (f"{what}: backward will raise 'modified by an inplace operation'. This node "
                f"writes in place internally (not visible in the graph).")
    return f"{what}: backward will raise 'modified by an inplace operation'."


def _warning_problem(candidate: _Candidate) -> str:
    if candidate.kind == "data":
        return ("reads .data: a later write through it would change values autograd saved "
                "without autograd noticing.")
    if candidate.kind == "embedding":
        max_norm = getattr(candidate.module, "max_norm", None)
        return (f"renormalises {candidate.node.target}.weight in place on every call "
                f"(max_norm={max_norm}); in the lint run no saved value changed.")
    return "writes in place; in the lint run it changed no value autograd saved for backward."


def _lint_copy(model: torch.nn.Module) -> fx.GraphModule:
    return copy.deepcopy(keyed_module(model))  # the lint run changes BN statistics, max_norm weights...


def _private_inputs(inputs) -> tuple:
    def private(value):
        clone = value.detach().clone()
        if value.requires_grad:
            clone.requires_grad_(True)
            if not value.is_leaf:
                clone = clone.clone()  # keep it a non-leaf, as the caller's was
        return clone
    return tuple(map_tensors(private, value) for value in inputs)


def _devices(gm: fx.GraphModule, inputs) -> list[int]:
    devices: dict[int, None] = {}
    for tensor in list(gm.parameters()) + [t for _, t in flatten_tensors(inputs)]:
        if tensor.device.type == "cuda":
            devices[tensor.device.index or 0] = None
    return list(devices)


def lint_inplace(model: torch.nn.Module, *inputs) -> Hazards:
    """Find in-place writes that break (or silently corrupt) autograd, before any backward.

    Args:
        model: an ``nn.Module`` or a ``torch.fx.GraphModule``, in the mode
            (train/eval) you will run it in. It is not modified: the lint
            runs a private deep copy.
        inputs: example inputs, with ``requires_grad`` as in training.

    Returns:
        :class:`Hazards`, a list of :class:`Hazard` in graph order with
        ``.errors``, ``.warnings`` and ``.table()``.

    Raises:
        fxdebug.TraceFailure: the model cannot be traced.
        Exception: the model itself raised in the lint's forward run; a note
            names the node and the user's line.

    Example (seed 003: a saved ``sigmoid`` output zeroed through ``.data``)::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(3, 3)
        ...     def forward(self, x):
        ...         out = self.fc(x).sigmoid()
        ...         out.data.zero_()
        ...         return out
        >>> hazards = fxdebug.lint_inplace(Net(), torch.randn(2, 3))
        >>> [(h.severity, h.key, h.destroys, h.saved_by) for h in hazards]
        [('error', 'zero_', 'sigmoid', 'sigmoid')]
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxdebug.lint_inplace expects an nn.Module or a GraphModule, "
                        f"got {type(model).__name__}.")
    gm = _lint_copy(model)
    candidates = _static_candidates(gm)
    private = _private_inputs(inputs)
    watch = _Watch(gm, candidates)
    with torch.random.fork_rng(devices=_devices(gm, private)), torch.enable_grad():
        try:
            watch.run(*private)
        except _Stop:
            pass
        except Exception as exc:
            node = watch.current
            where = (f" at node {node_key(node)!r} ({op_name(node, gm)}, "
                     f"{format_location(node.meta.get(META_SOURCE))})") if node is not None else ""
            exc.add_note(f"fxdebug.lint_inplace: the model raised{where} during the lint's forward "
                         f"run (a private copy, on copies of the inputs); fix the forward first.")
            raise
    hazards = _collect(gm, candidates, watch)
    del watch
    return hazards


def _collect(gm: fx.GraphModule, candidates, watch: _Watch) -> Hazards:
    name_of = _value_names(gm, watch)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    writers = dict.fromkeys(list(candidates) + list(watch.damage))
    if watch.failure is not None:
        writers[watch.failure[0]] = None
    hazards = Hazards()
    for node in sorted(writers, key=order.__getitem__):
        candidate = candidates.get(node)
        source = node.meta.get(META_SOURCE)
        base = dict(key=node_key(node), op=op_name(node, gm), location=format_location(source),
                    source=source)
        fix = _fix(candidate, gm) if candidate is not None else (
            "make the write out of place, or clone the value before it is used")
        if watch.failure is not None and watch.failure[0] is node:
            message = " ".join(str(watch.failure[1]).split())
            hazards.append(Hazard(severity="error", destroys=None, saved_by=None,
                                  problem=f"raises in the forward: {message}", fix=fix, **base))
            continue
        damage = watch.damage.get(node, [])
        if damage:
            entry, how = damage[0]
            destroys = name_of(entry.tensor) if entry is not None else None
            saved_by = node_key(entry.owner) if entry is not None else node_key(node)
            problem = _problem(candidate, how, destroys, saved_by, len(damage) - 1)
            hazards.append(Hazard(severity="error", destroys=destroys, saved_by=saved_by,
                                  problem=problem, fix=fix, **base))
        elif candidate is not None:
            not_run = watch.failure is not None and order[node] > order[watch.failure[0]]
            problem = _warning_problem(candidate)
            if not_run:
                problem = "not checked: the lint run stopped at an earlier error."
            hazards.append(Hazard(severity="warning", destroys=None, saved_by=None,
                                  problem=problem, fix=fix, **base))
    return hazards

