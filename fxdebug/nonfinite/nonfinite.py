"""``find_nonfinite``: the first node that makes a NaN or Inf, in the forward and in the backward.

Call tree::

    find_nonfinite(model, *inputs)
      ├─ trace(model)                          keyed graph (a GraphModule: a keyed copy)
      ├─ ControlledRuns                        model's own mode, same RNG/buffers, cloned inputs
      ├─ _Watch (torch.fx.Interpreter), one forward + one backward:
      │    ├─ after each node: isfinite(out.sum())   (kept as a tensor, no sync per node)
      │    └─ Tensor.register_hook on each activation: isfinite(grad.sum()), in backward order
      ├─ a forward hit: replay the forward up to that node to read what it received
      └─ a backward hit: run again to count that gradient's non-finite values

A sum is non-finite whenever a value is, and costs one read of the tensor
(``isfinite(t).all()`` costs far more on CPU). A sum can also overflow on
finite values; a hit is therefore always confirmed on the values themselves,
and if it was such an overflow the search runs again with exact checks.

No ``saved_tensors_hooks`` are installed, so PyTorch's own "modified by an
inplace operation" check stays on, and no hook outlives the run: hooks go on
the run's own activations only, never on parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..runtime import Stats, flatten_tensors, outputs_loss, tensor_stats, torch_compat
from ..tables.fit_to_width import fit_table, table_width
from ..runtime.formatting import dtype_text, format_location, shape_text
from ..tables.report import Report
from ..frontend import keyed_module
from ..tracing.keys import META_PASS, META_SOURCE, node_key, op_name
from ..tracing.selection import matches
from ..equivalence.controlled_run import ControlledRuns

__all__ = ["find_nonfinite", "NonfiniteReport", "ForwardHit", "BackwardHit", "ValueStats"]

_WATCHED_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module")


@dataclasses.dataclass(frozen=True)
class ValueStats:
    """Statistics of one tensor a node received (an input node's value or a module parameter)."""

    name: str
    shape: str
    dtype: str
    stats: Stats

    @property
    def finite(self) -> bool:
        return self.stats.nonfinite == 0


@dataclasses.dataclass(frozen=True)
class ForwardHit:
    """The first node, in execution order, whose output holds a NaN or an Inf.

    ``inputs`` are the node's inputs as it received them, ``parameters`` the
    parameters and buffers of the module it calls (``call_module`` nodes).
    ``created`` is True when all of them were finite: this node made the
    non-finite values; False when it received them (from a parameter, a
    buffer, or a value no node of the graph produced). ``kind`` is
    ``"input"`` when the hit is an input of forward (the data already held
    NaN/Inf), ``"parameter"``, ``"buffer"`` or ``"attribute"`` for a tensor of
    the model read as it is, else ``"node"``: then no node created them.
    """

    key: str
    op: str
    source: tuple[str, int] | None
    shape: str
    dtype: str
    nan: int
    inf: int
    numel: int
    inputs: tuple[ValueStats, ...]
    parameters: tuple[ValueStats, ...]
    kind: str = "node"

    @property
    def created(self) -> bool:
        return self.kind == "node" and all(v.finite for v in self.inputs + self.parameters)

    def came_in(self) -> str:
        """What held the values before forward ran (``"input x"``), or ``""`` for a node."""
        return "" if self.kind == "node" else f"{self.kind} {self.key}"

    @property
    def location(self) -> str:
        return format_location(self.source)


@dataclasses.dataclass(frozen=True)
class BackwardHit:
    """The first node, in backward order, whose output's gradient holds a NaN or an Inf.

    ``made_by`` lists the users of that node whose own output gradients were
    finite: the backward of one of them turned the gradient non-finite (for
    ``torch.sqrt(relu(x))`` the hit is the relu and ``made_by`` is the sqrt).
    """

    key: str
    op: str
    source: tuple[str, int] | None
    shape: str
    nonfinite: int
    numel: int
    made_by: tuple[tuple[str, str, str], ...]  # (key, op, location)

    @property
    def location(self) -> str:
        return format_location(self.source)


@dataclasses.dataclass(repr=False)
class NonfiniteReport(Report):
    """What :func:`find_nonfinite` found; ``ok`` when every value and gradient is finite."""

    verdict_words = ("all finite", "NON-FINITE")

    forward: ForwardHit | None
    backward: BackwardHit | None
    later_forward: list[str]
    later_backward: list[str]
    parameter_grads: list[tuple[str, int, int]]  # (name, non-finite, numel)
    backward_ran: bool
    model_name: str
    inputs: str
    mode: str
    loss: str
    notes: list[str] = dataclasses.field(default_factory=list)
    creators: list[str] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)  # inputs, parameters... with NaN/Inf

    @property
    def ok(self) -> bool:
        return self.forward is None and self.backward is None and not self.parameter_grads

    def _size(self) -> str:
        return self.model_name

    def _finding(self) -> str:
        if self.forward is not None and self.forward.came_in():
            return f"{self.forward.came_in()} already holds NaN/Inf (no node created them)"
        if self.forward is not None:
            return f"first non-finite output at {self.forward.key} ({self.forward.location})"
        if self.backward is not None:
            return f"first non-finite gradient at {self.backward.key} ({self.backward.location})"
        if self.parameter_grads:
            return f"non-finite parameter gradient {self.parameter_grads[0][0]}"
        return ""

    def table(self, wide: bool | None = None, floatfmt: str = ".4g") -> str:
        """The first forward and backward hits, what the forward hit received, what followed."""
        verdict = "verdict: all finite" if self.ok else "verdict: NON-FINITE values found"
        return "\n".join(self._lines(wide, floatfmt) + [verdict]
                         + [f"note: {note}" for note in self.notes])

    def _lines(self, wide: bool | None, floatfmt: str) -> list[str]:
        """The table's lines above its verdict."""
        what = f"forward + backward of {self.loss}" if self.backward_ran else "forward only"
        lines = [f"find_nonfinite: {self.model_name}, inputs {self.inputs}, {self.mode} mode, "
                 f"{what}"]
        hit = self.forward
        if hit is None:
            lines.append("forward: every node output is finite")
        elif hit.came_in():
            lines += _came_in_lines(hit)
        else:
            lines.append(f"forward: first non-finite output at {hit.key} ({hit.op}, "
                         f"{hit.location}): {hit.shape} {hit.dtype}, {hit.nan} NaN and {hit.inf} "
                         f"Inf of {hit.numel}")
            lines.append("  it CREATED them: everything it received was finite" if hit.created
                         else "  it RECEIVED them: a value it read was already non-finite")
        if hit is not None:
            received = [("input", v) for v in hit.inputs] + [("parameter", v)
                                                             for v in hit.parameters]
            if received:
                rows = [[kind, v.name, v.shape, v.dtype,
                         *(format(x, floatfmt) for x in v.stats[:4]), str(v.stats.nonfinite)]
                        for kind, v in received]
                width = table_width(wide)
                body = fit_table(rows, ["", "name", "shape", "dtype", "mean", "std", "min", "max",
                                        "non-finite"], width=None if width is None else width - 2,
                                 drop=("std", "mean"), truncate=("name",),
                                 colalign=("left",) * 4 + ("right",) * 5)
                lines.extend("  " + line for line in body.splitlines())
            lines.append(_later("  later nodes with non-finite outputs", self.later_forward))
            lines.append(_later("  every node that CREATED non-finite values (all it received "
                                "was finite)", self.creators))
            if self.sources:
                lines.append(_later("  non-finite before forward ran (inputs, parameters, "
                                    "buffers)", self.sources))
        if self.backward_ran:
            grad = self.backward
            if grad is None:
                lines.append("backward: every activation gradient is finite")
            else:
                lines.append(f"backward: first non-finite gradient (backward order) is that of "
                             f"{grad.key} ({grad.op}, {grad.location}): {grad.shape}, "
                             f"{grad.nonfinite} non-finite of {grad.numel}")
                if grad.made_by:
                    made = ", ".join(f"{key} ({op}, {where})" for key, op, where in grad.made_by)
                    lines.append(f"  made by the backward of: {made} (their output gradients "
                                 f"were finite)")
                lines.append(_later("  later gradients (backward order) non-finite",
                                    self.later_backward))
            if self.parameter_grads:
                lines.append(_later("parameter gradients with non-finite values",
                                    [f"{name} ({count}/{numel})"
                                     for name, count, numel in self.parameter_grads]))
            else:
                lines.append("parameter gradients: all finite")
        return lines



def _came_in_lines(hit: ForwardHit) -> list[str]:
    """A hit on an input, parameter or buffer: the values were non-finite before forward ran."""
    counts = f"{hit.nan} NaN and {hit.inf} Inf of {hit.numel} ({hit.shape} {hit.dtype})"
    if hit.kind == "input":
        return [f"forward: the input {hit.key} of forward already holds non-finite values: "
                f"{counts}",
                f"  no node created them: they came in with the data. Check the batch "
                f"(torch.isfinite({hit.key}).all()) and the code or data loader that made it; "
                f"ignore=[{hit.key!r}] if they are there on purpose"]
    return [f"forward: {hit.kind} {hit.key} of the model already holds non-finite values: "
            f"{counts}",
            "  no node created them: it was non-finite before this forward (an optimizer step, "
            f"a checkpoint load, a write into it); fxdebug.watch_nonfinite(model) names the "
            f"step that made it so"]


def _later(title: str, keys: list[str]) -> str:
    if not keys:
        return f"{title}: none"
    if len(keys) <= 6:
        return f"{title}: {len(keys)} ({', '.join(keys)})"
    return f"{title}: {len(keys)} ({', '.join(keys[:3])}, ..., {', '.join(keys[-2:])})"


class _Stop(BaseException):
    """Ends a replay right after the node of interest (never escapes find_nonfinite)."""


class _Watch(fx.Interpreter):
    """Runs a keyed graph node by node, noting which outputs and gradients are finite."""

    def __init__(self, gm: fx.GraphModule, hooks: bool, ignore: list[str],
                 stop_at: fx.Node | None = None, count_grad_of: fx.Node | None = None,
                 exact: bool = False):
        super().__init__(gm)
        self.hooks = hooks
        self.check = _all_finite if exact else _sum_finite
        self.ignore = ignore
        self.stop_at = stop_at
        self.count_grad_of = count_grad_of
        self.finite: list[tuple[fx.Node, torch.Tensor]] = []
        self.grads: list[tuple[fx.Node, torch.Tensor]] = []
        self.grad_count: tuple[int, tuple[int, ...], int] | None = None
        self.received: tuple[ValueStats, ...] = ()
        self.stop_output: Any = None

    def _watched(self, node: fx.Node) -> bool:
        return (node.op in _WATCHED_OPS and META_PASS not in node.meta
                and not any(matches(node_key(node), p) for p in self.ignore))

    def run_node(self, node: fx.Node):
        if node is self.stop_at:
            self.received = tuple(
                ValueStats(node_key(arg) + ("" if not sub else f"/{sub}"),
                           shape_text(t.shape), dtype_text(t.dtype), tensor_stats(t))
                for arg in node.all_input_nodes
                for sub, t in flatten_tensors(self.env.get(arg)))
        out = super().run_node(node)
        if node is self.stop_at:
            self.stop_output = out
            raise _Stop
        if self._watched(node):
            for _, tensor in flatten_tensors(out):
                if not (tensor.is_floating_point() or tensor.is_complex()):
                    continue
                self.finite.append((node, self.check(tensor)))
                if (self.hooks and tensor.requires_grad and node.op != "get_attr"
                        and (not tensor.is_leaf or node.op == "placeholder")):
                    tensor.register_hook(self._grad_hook(node))
        return out

    def _grad_hook(self, node: fx.Node) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.grads.append((node, self.check(grad)))  # a tensor: no sync per gradient
            if node is self.count_grad_of and self.grad_count is None:
                self.grad_count = (_count_nonfinite(grad), tuple(grad.shape), grad.numel())
        return hook


def _sum_finite(tensor: torch.Tensor) -> torch.Tensor:
    """False if ``tensor`` holds a NaN or Inf (or, rarely, if its sum overflows)."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return torch.isfinite(tensor.sum(dtype=torch.float32))
    return torch.isfinite(tensor.sum())


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(tensor).all()


def _count_nonfinite(tensor: torch.Tensor) -> int:
    return int(tensor.numel() - torch.isfinite(tensor).sum())


def _describe_inputs(inputs) -> str:
    return ", ".join(f"{shape_text(t.shape)} {dtype_text(t.dtype)}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in inputs) or "none"


def _first_bad(flags: list[tuple[fx.Node, torch.Tensor]]) -> tuple[fx.Node | None, list[str]]:
    """The first node with a False flag, and the keys of later nodes with one (in order)."""
    if not flags:
        return None, []
    values = torch.stack([flag.to("cpu") for _, flag in flags]).tolist()
    first = None
    later: dict[str, None] = {}
    for (node, _), ok in zip(flags, values):
        if ok:
            continue
        if first is None:
            first = node
        elif node is not first:
            later[node_key(node)] = None
    return first, list(later)


def _module_stats(gm: fx.GraphModule, node: fx.Node) -> tuple[ValueStats, ...]:
    if node.op != "call_module":
        return ()
    module = gm.get_submodule(str(node.target))
    named = list(module.named_parameters()) + list(module.named_buffers())
    return tuple(ValueStats(f"{node.target}.{name}", shape_text(t.shape), dtype_text(t.dtype),
                            tensor_stats(t))
                 for name, t in named if t.is_floating_point() or t.is_complex())


def find_nonfinite(model: torch.nn.Module, *inputs, backward: bool = True,
                   loss: Callable[[Any], torch.Tensor] | None = None,
                   ignore=None) -> NonfiniteReport:
    """Find the first node whose output holds a NaN or an Inf, and the first non-finite gradient.

    One forward and (with ``backward=True``) one backward, run node by node:
    the first node whose output is non-finite is reported with statistics of
    everything it received (its inputs, and the parameters of the module it
    calls), so you see whether it created the bad values or was handed them;
    the backward reports the first node, in backward order, whose output
    gradient is non-finite, and the users whose backward made it so.

    The model runs in its own training mode, on copies of the inputs; its
    buffers (BatchNorm statistics), the random-number state and parameter
    ``.grad`` are left as they were (gradients are taken with
    ``torch.autograd.grad``).

    Args:
        model: an ``nn.Module`` (traced with :func:`fxdebug.trace` on every
            call) or a GraphModule (``fxdebug.trace(model)`` once, then pass
            it in a training loop: no tracing per call).
        inputs: its positional inputs.
        backward: also run the backward of ``loss(output)``.
        loss: ``output -> scalar``; default: the sum of every floating output's sum.
        ignore: keys or globs whose outputs may be non-finite on purpose (an
            attention mask filled with ``-inf``).

    Returns:
        :class:`NonfiniteReport`: ``ok``, ``forward``, ``backward``,
        ``later_forward``, ``creators`` (every node that made a NaN/Inf from finite
        values, in execution order: a model with two bugs shows both),
        ``parameter_grads``, ``table()``.

    Example::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return torch.log(self.fc(x)).sum(-1)
        >>> report = fxdebug.find_nonfinite(Net(), torch.randn(8, 4))
        >>> report.forward.key, report.forward.created, report.later_forward, report.creators
        ('log', True, ['sum'], ['log'])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"find_nonfinite expects an nn.Module or a GraphModule, got "
                        f"{type(model).__name__}.")
    if not inputs:
        raise FxdebugError("find_nonfinite needs example inputs: find_nonfinite(model, x).")
    ignore = [ignore] if isinstance(ignore, str) else list(ignore or ())
    gm = keyed_module(model)
    notes: list[str] = []
    loss_text = "sum(out.sum())" if loss is None else getattr(loss, "__name__", "loss")
    mode = "train" if model.training else "eval"
    parameter_grads: list[tuple[str, int, int]] = []
    with ControlledRuns([model, gm], inputs, train=None) as runs:
        watch = _Watch(gm, hooks=backward, ignore=ignore)
        backward_ran = runs.run(lambda *args: _run_once(gm, watch, args, backward, loss, notes,
                                                        parameter_grads), grad=backward)
        forward_hit, later = _forward_search(gm, runs, watch, ignore)
        creators, sources = _creators(gm, runs, ignore) if forward_hit is not None else ([], [])
        backward_hit, later_grads = _backward_search(gm, runs, watch, ignore, loss)
    if forward_hit is not None and backward_ran:
        notes.append("the backward ran through a non-finite forward; fix the forward first")
    return NonfiniteReport(forward=forward_hit, backward=backward_hit, later_forward=later,
                           later_backward=later_grads, parameter_grads=parameter_grads,
                           backward_ran=backward_ran, model_name=type(model).__name__,
                           inputs=_describe_inputs(inputs), mode=mode, loss=loss_text,
                           notes=notes, creators=creators, sources=sources)


def _run_once(gm: fx.GraphModule, watch: _Watch, args: tuple, backward: bool, loss,
              notes: list[str], parameter_grads: list[tuple[str, int, int]]) -> bool:
    """One forward (and backward) under ``watch``; returns whether a backward ran."""
    with torch.set_grad_enabled(backward):
        out = watch.run(*args)
    if not backward:
        return False
    wrt_named = [(name, p) for name, p in gm.named_parameters() if p.requires_grad]
    wrt_inputs = [t for _, t in flatten_tensors(args) if t.requires_grad]
    with torch.enable_grad():
        value = _loss(out, loss)
    if value is None or not value.requires_grad or not (wrt_named or wrt_inputs):
        notes.append("backward skipped: nothing the output depends on requires grad")
        return False
    found = torch.autograd.grad(value, [p for _, p in wrt_named] + wrt_inputs,
                                allow_unused=True)
    named_grads = [(name, grad) for (name, _), grad in zip(wrt_named, found) if grad is not None]
    if named_grads:
        screened = torch.stack([_sum_finite(grad) for _, grad in named_grads]).tolist()
        for (name, grad), finite in zip(named_grads, screened):
            bad = 0 if finite else _count_nonfinite(grad)
            if bad:
                parameter_grads.append((name, bad, grad.numel()))
    return True


def _forward_search(gm: fx.GraphModule, runs: ControlledRuns, watch: _Watch,
                    ignore) -> tuple[ForwardHit | None, list[str]]:
    first, later = _first_bad(watch.finite)
    if first is None:
        return None, []
    hit: ForwardHit | None = _replay(gm, runs, first, ignore)
    if hit is not None and hit.nan + hit.inf == 0:
        # a sum overflowed on finite values: search again, exactly
        exact = _Watch(gm, hooks=False, ignore=ignore, exact=True)
        runs.run(exact.run)
        first, later = _first_bad(exact.finite)
        hit = None if first is None else _replay(gm, runs, first, ignore)
    return hit, later


def _creators(gm: fx.GraphModule, runs: ControlledRuns, ignore) -> tuple[list[str], list[str]]:
    """Keys of every node whose output is non-finite while all it received was finite, and
    of the inputs, parameters and buffers that were non-finite before forward ran.

    One more forward, checking every value exactly (not by its sum). What a node
    received: the nodes it reads (a node whose value was not checked, being ignored
    or not a float tensor, counts as finite) and, for a module call, the module's
    parameters and buffers. Inputs and parameters read with get_attr are sources,
    not creators.
    """
    exact = _Watch(gm, hooks=False, ignore=ignore, exact=True)
    runs.run(exact.run)
    finite: dict[fx.Node, bool] = {}
    flags = torch.stack([flag.to("cpu") for _, flag in exact.finite]).tolist() if exact.finite else []
    for (node, _), ok in zip(exact.finite, flags):
        finite[node] = finite.get(node, True) and bool(ok)
    found, sources = [], []
    for node, ok in finite.items():
        if not ok and node.op in ("placeholder", "get_attr"):
            sources.append(node_key(node))
        if ok or node.op in ("placeholder", "get_attr"):
            continue
        if all(finite.get(arg, True) for arg in node.all_input_nodes) and all(
                v.finite for v in _module_stats(gm, node)):
            found.append(node_key(node))
    return found, sources


def _backward_search(gm: fx.GraphModule, runs: ControlledRuns, watch: _Watch, ignore,
                     loss) -> tuple[BackwardHit | None, list[str]]:
    def count_of(node: fx.Node):
        recount = _Watch(gm, hooks=True, ignore=ignore, count_grad_of=node)
        runs.run(lambda *args: _run_once(gm, recount, args, True, loss, [], []), grad=True)
        return recount.grad_count

    node, later = _first_bad(watch.grads)
    if node is None:
        return None, []
    count = count_of(node)
    if count is None or count[0] == 0:  # a sum overflowed on finite values: search exactly
        watch = _Watch(gm, hooks=True, ignore=ignore, exact=True)
        runs.run(lambda *args: _run_once(gm, watch, args, True, loss, [], []), grad=True)
        node, later = _first_bad(watch.grads)
        if node is None:
            return None, []
        count = count_of(node)
    return _backward_hit(gm, node, watch, count), later


def _loss(out: Any, loss) -> torch.Tensor | None:
    if loss is not None:
        value = loss(out)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = (f"a tensor of shape {shape_text(value.shape)}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise FxdebugError(f"find_nonfinite: loss(output) must return a scalar tensor, got "
                               f"{got}; reduce it, e.g. loss=lambda out: out.mean().")
        return value.reshape(())
    return outputs_loss(out)


def _replay(gm: fx.GraphModule, runs: ControlledRuns, node: fx.Node, ignore) -> ForwardHit:
    """Run the forward again up to ``node`` to read what it received and what it made."""
    watch = _Watch(gm, hooks=False, ignore=ignore, stop_at=node)
    try:
        runs.run(watch.run)
    except _Stop:
        pass
    tensors = [t for _, t in flatten_tensors(watch.stop_output)
               if t.is_floating_point() or t.is_complex()]
    nan = sum(int(torch.isnan(t).sum()) for t in tensors)
    inf = sum(int(torch.isinf(t).sum()) for t in tensors)
    first = tensors[0] if tensors else torch.empty(0)
    return ForwardHit(key=node_key(node), op=op_name(node, gm), source=node.meta.get(META_SOURCE),
                      shape=shape_text(first.shape), dtype=dtype_text(first.dtype), nan=nan,
                      inf=inf, numel=sum(t.numel() for t in tensors), inputs=watch.received,
                      parameters=_module_stats(gm, node), kind=_kind(gm, node))


def _kind(gm: fx.GraphModule, node: fx.Node) -> str:
    """``"input"``, ``"parameter"``, ``"buffer"``, ``"attribute"`` (read as it is) or ``"node"``."""
    if node.op == "placeholder":
        return "input"
    if node.op != "get_attr":
        return "node"
    owner, _, name = str(node.target).rpartition(".")
    try:
        module = gm.get_submodule(owner)
    except AttributeError:
        return "attribute"
    return ("parameter" if name in torch_compat.own_parameters(module) else
            "buffer" if name in torch_compat.own_buffers(module) else "attribute")


def _backward_hit(gm: fx.GraphModule, node: fx.Node, watch: _Watch,
                  count: tuple[int, tuple[int, ...], int] | None) -> BackwardHit:
    finite_by_node: dict[fx.Node, bool] = {}
    for seen, flag in watch.grads:
        finite_by_node[seen] = finite_by_node.get(seen, True) and bool(flag)
    made_by = tuple((node_key(user), op_name(user, gm), format_location(user.meta.get(META_SOURCE)))
                    for user in node.users if finite_by_node.get(user) is True)
    bad, shape, numel = count if count is not None else (-1, (), 0)
    return BackwardHit(key=node_key(node), op=op_name(node, gm), source=node.meta.get(META_SOURCE),
                       shape=shape_text(shape), nonfinite=bad, numel=numel, made_by=made_by)
