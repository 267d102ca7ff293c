"""``find_nonfinite``: the first node that makes a NaN or Inf, in the forward and in the backward.

Call tree::

    find_nonfinite(model, *inputs)
      ├─ trace(model)                          keyed graph (a GraphModule: a keyed copy)
      ├─ ControlledRuns                        model's own mode, same RNG/buffers, cloned inputs
      ├─ _Watch (torch.fx.Interpreter), one forward + one backward:
      │    ├─ after each node: out.sum()   (kept as a tensor: no sync, no isfinite per node)
      │    ├─ Tensor.register_hook on each activation: grad.sum(), in backward order
      │    └─ then the sums stacked, isfinite once, read once (per device and dtype)
      ├─ a forward hit: replay the forward up to that node to read what it received
      └─ a backward hit: run again to count that gradient's non-finite values

    find_nonfinite(model, *inputs, lockstep=True)   every rank of a sharded model at once
      the same four runs on every rank, whatever each finds (forward + backward,
      forward to the end past the hit, forward, forward + backward), with exact checks
      from the start: FSDP2's all-gathers and tensor parallelism's all-reduces are
      called in the same order everywhere. Values are read as this rank's local tensors
      (a DTensor's shard): nothing read here runs a collective of its own.

A sum is non-finite whenever a value is, and costs one read of the tensor
(``isfinite(t).all()`` costs far more on CPU). A sum can also overflow on
finite values; a hit is therefore always confirmed on the values themselves,
and if it was such an overflow the search runs again with exact checks.

No ``saved_tensors_hooks`` are installed, so PyTorch's own "modified by an
inplace operation" check stays on, and no hook outlives the run: hooks go on
the run's own activations only, never on parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from ..errors import FxdebugError, renamed_arguments
from ..runtime import flatten_tensors, outputs_loss, tensor_stats
from ..base import torch_compat
from ..base.formatting import dtype_text, format_location, shape_text
from ..frontend import keyed_module
from ..tracing.keys import META_PASS, META_SOURCE, node_key, op_name
from ..tracing.selection import matches
from ..equivalence.controlled_run import ControlledRuns
from .nonfinite_report import BackwardHit, ForwardHit, NonfiniteReport, ValueStats
from ..distributed.sharded_replay import local as _local, sharded_parameter

__all__ = ["find_nonfinite", "NonfiniteReport", "ForwardHit", "BackwardHit", "ValueStats"]

_WATCHED_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module")


class _Stop(BaseException):
    """Ends a replay right after the node of interest (never escapes find_nonfinite)."""


class _Watch(fx.Interpreter):
    """Runs a keyed graph node by node, noting which outputs and gradients are finite."""

    def __init__(self, gm: fx.GraphModule, hooks: bool, ignore: list[str],
                 stop_at: fx.Node | None = None, count_grad_of: fx.Node | None = None,
                 exact: bool = False, finish: bool = False):
        super().__init__(gm)
        self.finish = finish  # run on past stop_at: a sharded model's collectives must all run
        self.hooks = hooks
        self.check = _all_finite if exact else _sum
        self.ignore = ignore
        self.stop_at = stop_at
        self.count_grad_of = count_grad_of
        # (node, check): a sum, finite where the values are; an exact check's flag (see _flags)
        self.finite: list[tuple[fx.Node, torch.Tensor]] = []
        self.grads: list[tuple[fx.Node, torch.Tensor]] = []
        self.hooked: list[torch.Tensor] = []  # the activations whose gradients are watched
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
                           shape_text(t.shape), dtype_text(t.dtype), tensor_stats(_local(t)))
                for arg in node.all_input_nodes
                for sub, t in flatten_tensors(self.env.get(arg)))
        out = super().run_node(node)
        if node is self.stop_at:
            self.stop_output = out
            if not self.finish:
                raise _Stop
        if self._watched(node):
            for _, tensor in flatten_tensors(out):
                if not (tensor.is_floating_point() or tensor.is_complex()):
                    continue
                self.finite.append((node, self.check(_local(tensor))))
                if (self.hooks and tensor.requires_grad and node.op != "get_attr"
                        and (not tensor.is_leaf or node.op == "placeholder")):
                    tensor.register_hook(self._grad_hook(node))
                    self.hooked.append(tensor)
        return out

    def _grad_hook(self, node: fx.Node) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            grad = _local(grad)
            self.grads.append((node, self.check(grad)))  # a tensor: no sync per gradient
            if node is self.count_grad_of and self.grad_count is None:
                self.grad_count = (_count_nonfinite(grad), tuple(grad.shape), grad.numel())
        return hook


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """A number that is not finite if ``tensor`` holds a NaN or Inf (or, rarely, if its sum
    overflows): the check :func:`_flags` reads."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.sum(dtype=torch.float32)
    return tensor.sum()


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """The exact check: a bool tensor, True where every value is finite."""
    return torch.isfinite(tensor).all()


def _flags(checks: list[torch.Tensor]) -> list[bool]:
    """Whether each check (a sum from :func:`_sum`, or :func:`_all_finite`'s bool) says
    finite: the checks of each device and dtype stacked where they are, ``isfinite`` once,
    read once (one synchronization per device, not one per node).

    >>> _flags([torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(False)])
    [True, False, False]
    """
    found = [True] * len(checks)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, check in enumerate(checks):
        groups.setdefault((check.device, check.dtype), []).append(index)
    for (_, dtype), indices in groups.items():  # (in the order of the checks)
        stacked = torch.stack([checks[index] for index in indices])
        for index, ok in zip(indices, (stacked if dtype == torch.bool
                                       else torch.isfinite(stacked)).tolist()):
            found[index] = bool(ok)
    return found


def _count_nonfinite(tensor: torch.Tensor) -> int:
    return int(tensor.numel() - torch.isfinite(tensor).sum())


def _describe_inputs(inputs) -> str:
    return ", ".join(f"{shape_text(t.shape)} {dtype_text(t.dtype)}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in inputs) or "none"


def _first_bad(checks: list[tuple[fx.Node, torch.Tensor]]
               ) -> tuple[fx.Node | None, list[str], int, list[bool]]:
    """The first node whose check says non-finite, the keys of later nodes with one (in
    order), the first one's place in ``checks`` (-1: none), and every check's verdict."""
    if not checks:
        return None, [], -1, []
    values = _flags([check for _, check in checks])
    first, position = None, -1
    later: dict[str, None] = {}
    for index, ((node, _), ok) in enumerate(zip(checks, values)):
        if ok:
            continue
        if first is None:
            first, position = node, index
        elif node is not first:
            later[node_key(node)] = None
    return first, list(later), position, values


def _module_stats(gm: fx.GraphModule, node: fx.Node) -> tuple[ValueStats, ...]:
    if node.op != "call_module":
        return ()
    module = gm.get_submodule(str(node.target))
    named = list(module.named_parameters()) + list(module.named_buffers())
    return tuple(ValueStats(f"{node.target}.{name}", shape_text(_local(t).shape),
                            dtype_text(t.dtype), tensor_stats(_local(t)))
                 for name, t in named if t.is_floating_point() or t.is_complex())


@renamed_arguments({"backward": "grads"})
def find_nonfinite(model: torch.nn.Module, *inputs, grads: bool = True,
                   loss: Callable[[Any], torch.Tensor] | None = None,
                   ignore=None, lockstep: bool = False) -> NonfiniteReport:
    """Find the first node whose output holds a NaN or an Inf, and the first non-finite gradient.

    One forward and (with ``grads=True``) one backward, run node by node:
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
        grads: also run the backward of ``loss(output)`` and look at the gradients
            (``backward=`` before).
        loss: ``output -> scalar``; default: the sum of every floating output's sum.
        ignore: keys or globs whose outputs may be non-finite on purpose (an
            attention mask filled with ``-inf``).
        lockstep: every rank of a sharded model (FSDP2, tensor parallel) calls it
            at once, each on its own inputs: every rank then runs the same forwards
            and backwards in the same order, whatever it finds, so the model's
            collectives match; each rank reports its own (local) values.

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
        watch = _Watch(gm, hooks=grads, ignore=ignore, exact=lockstep)
        backward_ran = runs.run(lambda *args: _run_once(gm, watch, args, grads, loss, notes,
                                                        parameter_grads), grad=grads)
        forward_hit, later = _forward_search(gm, runs, watch, ignore, lockstep)
        creators, sources = _creators(gm, runs, ignore) if (
            forward_hit is not None or lockstep) else ([], [])
        backward_hit, later_grads = _backward_search(gm, runs, watch, ignore, loss,
                                                     lockstep and backward_ran)
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
    if sharded_parameter(gm):  # FSDP2's graph reads all-gathered copies, not the parameters:
        wrt_inputs += [t for t in watch.hooked if not t.is_leaf]  # reach every activation
    with torch.enable_grad():
        value = _loss(out, loss)
    if value is None or not value.requires_grad or not (wrt_named or wrt_inputs):
        notes.append("backward skipped: nothing the output depends on requires grad")
        return False
    found = torch.autograd.grad(value, [p for _, p in wrt_named] + wrt_inputs,
                                allow_unused=True)
    named_grads = [(name, _local(grad)) for (name, _), grad in zip(wrt_named, found)
                   if grad is not None]
    if wrt_named and not named_grads and sharded_parameter(gm):
        notes.append("parameter gradients not replayed: the forward read all-gathered copies "
                     "of the sharded parameters (FSDP2); the watch's flag read the step's own")
    if named_grads:
        screened = _flags([_sum(grad) for _, grad in named_grads])
        for (name, grad), finite in zip(named_grads, screened):
            bad = 0 if finite else _count_nonfinite(grad)
            if bad:
                parameter_grads.append((name, bad, grad.numel()))
    return True


def _forward_search(gm: fx.GraphModule, runs: ControlledRuns, watch: _Watch, ignore,
                    lockstep: bool = False) -> tuple[ForwardHit | None, list[str]]:
    first, later, _, _ = _first_bad(watch.finite)
    if lockstep:  # exact already; the replay's forward runs to the end, hit or not
        return _replay(gm, runs, first, ignore, finish=True), later
    if first is None:
        return None, []
    hit: ForwardHit | None = _replay(gm, runs, first, ignore)
    if hit is not None and hit.nan + hit.inf == 0:
        # a sum overflowed on finite values: search again, exactly
        exact = _Watch(gm, hooks=False, ignore=ignore, exact=True)
        runs.run(exact.run)
        first, later, _, _ = _first_bad(exact.finite)
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
    flags = _flags([check for _, check in exact.finite])
    for (node, _), ok in zip(exact.finite, flags):
        finite[node] = finite.get(node, True) and bool(ok)
    found, sources = [], []
    for node, ok in list(finite.items()):  # checked nodes; the look-through adds others
        if not ok and node.op in ("placeholder", "get_attr"):
            sources.append(node_key(node))
        if ok or node.op in ("placeholder", "get_attr"):
            continue
        if all(_received_finite(arg, finite) for arg in node.all_input_nodes) and all(
                v.finite for v in _module_stats(gm, node)):
            found.append(node_key(node))
    return found, sources


def _received_finite(node: fx.Node, finite: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s value was finite: checked, or (not checked: a list a hook node returns,
    the getitem taking a tensor out of it) all the nodes it read were. ``finite`` is extended."""
    pending = [node]
    while pending:  # iterative: a chain of unchecked nodes is not a recursion depth
        current = pending[-1]
        if current in finite:
            pending.pop()
            continue
        unknown = [arg for arg in current.all_input_nodes if arg not in finite]
        if unknown:
            pending.extend(unknown)
            continue
        finite[current] = all(finite[arg] for arg in current.all_input_nodes)
        pending.pop()
    return finite[node]


def _backward_search(gm: fx.GraphModule, runs: ControlledRuns, watch: _Watch, ignore,
                     loss, lockstep: bool = False) -> tuple[BackwardHit | None, list[str]]:
    def count_of(node: fx.Node | None):
        recount = _Watch(gm, hooks=True, ignore=ignore, count_grad_of=node)
        runs.run(lambda *args: _run_once(gm, recount, args, True, loss, [], []), grad=True)
        return recount.grad_count

    node, later, position, flags = _first_bad(watch.grads)
    if lockstep:  # exact already; the count's forward and backward run on every rank
        count = count_of(node)
        hit = None if node is None else _backward_hit(gm, node, watch, flags, count, position)
        return hit, later
    if node is None:
        return None, []
    count = count_of(node)
    if count is None or count[0] == 0:  # a sum overflowed on finite values: search exactly
        watch = _Watch(gm, hooks=True, ignore=ignore, exact=True)
        runs.run(lambda *args: _run_once(gm, watch, args, True, loss, [], []), grad=True)
        node, later, position, flags = _first_bad(watch.grads)
        if node is None:
            return None, []
        count = count_of(node)
    return _backward_hit(gm, node, watch, flags, count, position), later


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


def _replay(gm: fx.GraphModule, runs: ControlledRuns, node: fx.Node | None, ignore,
            finish: bool = False) -> ForwardHit | None:
    """Run the forward again up to ``node`` (``finish``: to the end) to read what it
    received and what it made."""
    watch = _Watch(gm, hooks=False, ignore=ignore, stop_at=node, finish=finish)
    try:
        runs.run(watch.run)
    except _Stop:
        pass
    if node is None:
        return None
    tensors = [_local(t) for _, t in flatten_tensors(watch.stop_output)
               if t.is_floating_point() or t.is_complex()]
    nan = sum(int(torch.isnan(t).sum()) for t in tensors)
    inf = sum(int(torch.isinf(t).sum()) for t in tensors)
    first = tensors[0] if tensors else torch.empty(0)
    return ForwardHit(key=node_key(node), op=op_name(node, gm), source=node.meta.get(META_SOURCE),
                      shape=shape_text(first.shape), dtype=dtype_text(first.dtype), nan=nan,
                      inf=inf, numel=sum(t.numel() for t in tensors), inputs=watch.received,
                      parameters=_module_stats(gm, node), kind=_kind(gm, node),
                      position=list(gm.graph.nodes).index(node))


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


def _backward_hit(gm: fx.GraphModule, node: fx.Node, watch: _Watch, flags: list[bool],
                  count: tuple[int, tuple[int, ...], int] | None,
                  position: int = -1) -> BackwardHit:
    """``flags``: the verdict of each of ``watch.grads``' checks (from :func:`_first_bad`)."""
    finite_by_node: dict[fx.Node, bool] = {}
    for (seen, _), ok in zip(watch.grads, flags):
        finite_by_node[seen] = finite_by_node.get(seen, True) and ok
    made_by = tuple((node_key(user), op_name(user, gm), format_location(user.meta.get(META_SOURCE)))
                    for user in _watched_users(node, finite_by_node)
                    if finite_by_node.get(user) is True)
    bad, shape, numel = count if count is not None else (-1, (), 0)
    return BackwardHit(key=node_key(node), op=op_name(node, gm), source=node.meta.get(META_SOURCE),
                       shape=shape_text(shape), nonfinite=bad, numel=numel, made_by=made_by,
                       position=position)


def _watched_users(node: fx.Node, watched: dict[fx.Node, bool]) -> list[fx.Node]:
    """The nodes that read ``node``'s value, looking through nodes whose gradients are not
    watched (the nodes that run a module's hooks, FSDP2's among them), in graph order."""
    found: dict[fx.Node, None] = {}
    seen: dict[fx.Node, None] = {}
    todo = list(node.users)
    while todo:
        user = todo.pop(0)
        if user in seen:
            continue
        seen[user] = None
        if user in watched:
            found[user] = None
        else:
            todo.extend(user.users)
    return list(found)
