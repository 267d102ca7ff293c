"""The monitor's logged copy under ``torch.compile``: statistics computed inside the graph.

Call tree::

    CompiledCopy(target, compiled)          the model is compiled (the torch.compile module
      ├─ instrument(target, grads=True,     passed, or mon.model compiled later)
      │             mode="stats")           the keys and capture places of the eager copy
      └─ _rewrite(gm)                       capture_stats -> tap_output, record_grads ->
                                            tap_grads (its result replaces the value in the
                                            ops after it), begin_run dropped: no custom op,
                                            no graph break (fxdebug.compiled.monitor_taps)
    copy.run(args, kwargs)                  a logged forward, called from the monitor's
      ├─ bank.start(device)                 forward wrapper, a frame dynamo skips: dynamo
      ├─ call(*args, **kwargs)              gm compiled as the user's module is (same
      │                                     backend, options); or, mon.model compiled later,
      │                                     as the compiled call it runs in
      └─ CompiledRun(bank)                  the run's summaries: forward ones at once,
                                            gradients' in the slots after the backward

The copy has one compiled graph (per graph break of the model), whatever the step: nothing
it reads changes between logged steps but the values of tensors (new slots, the same shapes).
``CompiledRun`` reads like the ``Records`` the eager copy gives the monitor (``keys()``, ``[key]``,
``.grads``), its values :class:`Summary` (a moment summary, already made).

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
>>> copy = CompiledCopy(net)
>>> out, run = copy.run((torch.randn(4, 3),), {})
>>> out.sum().backward()
>>> run.keys(), run["0"].summary[0].item(), "1" in run.grads
(['0', '1'], 12.0, True)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..distributed.rank_group import unwrap
from ..errors import FxdebugError
from ..instrumenting import instrument
from ..runtime import begin_run, capture, capture_stats, record_grads
from ..compiled.monitor_taps import TapBank, tap_grads, tap_output
from ..stats.moments import summarize_moments
from ..base.torch_compat import (compile_like, compiled_in_place, compiled_inner,
                                 inside_compiled_module)

__all__ = ["CompiledCopy", "CompiledRun", "Summary", "summary_of", "compiled_model",
           "runs_compiled", "BANK_ATTR"]

BANK_ATTR = "fxdebug_monitor_bank"


def compiled_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside ``model`` if ``torch.compile`` returned it, else None; a model compiled
    in place (``model.compile()``) is refused (its calls cannot be told apart from the graphs).

    >>> compiled_model(torch.nn.ReLU()) is None
    True
    """
    if compiled_in_place(model):
        raise FxdebugError(
            f"fxdebug.monitor: {type(model).__name__} was compiled in place (model.compile()), "
            f"which the monitor cannot attach to. Pass the module torch.compile returns: "
            f"fxdebug.monitor(torch.compile(model), ...), and train mon.model.")
    inner = compiled_inner(model)
    wrapped, wrapper = unwrap(inner if inner is not None else model)
    if wrapper and (inner is not None or compiled_inner(wrapped) is not None):
        raise FxdebugError(
            f"fxdebug.monitor: a compiled model under {wrapper} is not supported yet (the logged "
            f"copy would run outside {wrapper}'s gradient synchronization). Monitor the eager "
            f"model under {wrapper}: fxdebug.monitor({wrapper}(model), ...).")
    return inner


def runs_compiled() -> bool:
    """Whether the calling code runs inside a call of a ``torch.compile`` module (``mon.model``
    compiled after the monitor attached); False in eager code.

    >>> runs_compiled()
    False
    """
    return inside_compiled_module()


class Summary:
    """A moment summary already made (10 float64 numbers): what :class:`CompiledRun` holds."""

    __slots__ = ("summary",)

    def __init__(self, summary: torch.Tensor) -> None:
        self.summary = summary

    def __repr__(self) -> str:
        return f"Summary({self.summary.tolist()})"


def summary_of(value) -> torch.Tensor | None:
    """The moment summary of a tensor (:func:`~fxdebug.stats.moments.summarize_moments`)
    or of a :class:`Summary` (its own); None for anything else.

    >>> summary_of(torch.tensor([1.0, 3.0]))[:2].tolist(), summary_of("text")
    ([2.0, 2.0], None)
    """
    if isinstance(value, Summary):
        return value.summary
    if isinstance(value, torch.Tensor):
        return summarize_moments(value)
    return None


class CompiledRun:
    """The summaries of one forward of a :class:`CompiledCopy` (gradients: after its backward)."""

    def __init__(self, pending: tuple, slots: list[torch.Tensor]) -> None:
        self._out = {name: value for kind, name, value in pending if kind == "out"}
        self._grads = {name: value for kind, name, value in pending if kind == "grad"}
        self._slots = slots
        self.grads = _Grads(self)

    def keys(self) -> list[str]:
        return list(self._out)

    def __getitem__(self, key: str) -> Summary:
        return Summary(self._out[key])

    def _grad_row(self, key: str) -> torch.Tensor | None:
        place = self._grads.get(key)
        if place is None:
            return None
        node, part = place
        grad = self._slots[node].grad
        if grad is None:
            return None
        return grad[part]


class _Grads:
    """``run.grads``: the gradients' summaries of a :class:`CompiledRun`, by key."""

    def __init__(self, run: CompiledRun) -> None:
        self._run = run

    def __contains__(self, key: str) -> bool:
        row = self._run._grad_row(key)
        return row is not None and bool(row[-1] != 0)

    def __getitem__(self, key: str) -> Summary:
        row = self._run._grad_row(key)
        if row is None or row[-1] == 0:
            raise KeyError(key)
        if row[-1] != 1:
            raise FxdebugError(
                f"fxdebug.monitor: the gradient of {key!r} was summed over {int(row[-1])} "
                f"backwards of one forward (retain_graph=True, or several losses backed through "
                f"one forward); its statistics are not recorded. Call backward once per forward "
                f"on logged steps.")
        return Summary(row[:-1].clone())


class CompiledCopy:
    """The copy of ``target`` the monitor runs on logged steps under ``torch.compile``."""

    def __init__(self, target: torch.nn.Module, compiled: torch.nn.Module | None = None) -> None:
        gm = instrument(target, capture="modules", grads=True, mode="stats")
        if not isinstance(gm, fx.GraphModule) or getattr(gm, "fxdebug_partial", None) is not None:
            raise FxdebugError(
                f"fxdebug.monitor: {type(target).__name__} is compiled, and torch.fx cannot trace "
                f"it as a whole (fxdebug instruments it part by part, which runs Python between "
                f"the parts): the compiled monitor needs one traced graph. Monitor the eager "
                f"model (fxdebug.monitor(model) without torch.compile), or make its forward "
                f"traceable (fxdebug.trace(model) says where it fails).")
        self.nodes = _rewrite(gm)
        self.module = gm
        # compiled like the user's module; else (mon.model compiled later) dynamo compiles gm's
        # forward frame as it runs under the user's compiled call
        self.call = gm if compiled is None else compile_like(compiled, gm)
        self.bank: TapBank = getattr(gm, BANK_ATTR)
        self._device = next((p.device for p in target.parameters()), torch.device("cpu"))

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> "CompiledCopy":
        self.module.train(mode)
        return self

    def begin(self, args: tuple, kwargs: dict):
        """Ready a logged forward (new slots on the inputs' device): the callable to run it."""
        self.bank.start(_device_of(args, kwargs, self._device))
        return self.call

    def end(self) -> CompiledRun:
        """The summaries of the forward just run (gradients': after its backward)."""
        bank = self.bank
        run = CompiledRun(bank.pending, bank.slots)
        bank.pending, bank.slots = (), []
        return run

    def run(self, args: tuple, kwargs: dict) -> tuple[object, CompiledRun]:
        """One logged forward: ``(output, CompiledRun)``."""
        out = self.begin(args, kwargs)(*args, **kwargs)
        return out, self.end()


def _device_of(args: tuple, kwargs: dict, default: torch.device) -> torch.device:
    """The device of the first floating-point input (where the activations' gradients live)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.device
    return default


def _rewrite(gm: fx.GraphModule) -> int:
    """Capture and gradient nodes of ``gm`` -> taps (see the module docstring); the number of
    gradient nodes (one slot each)."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    cloned = {node.args[1] for node in graph.nodes
              if node.op == "call_function" and node.target in (capture, capture_stats)
              and node.kwargs.get("clone")}
    bank = TapBank(0)
    gm.add_submodule(BANK_ATTR, bank)
    bank_node = None
    grad_nodes = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is begin_run:
            graph.erase_node(node)
            continue
        if node.target not in (capture, capture_stats, record_grads):
            continue
        if bank_node is None:
            with graph.inserting_before(node):
                bank_node = graph.get_attr(BANK_ATTR)
        value, key = node.args[1], node.args[2]
        with graph.inserting_before(node):
            if node.target is record_grads:
                tapped = graph.call_function(tap_grads, (bank_node, value, key, grad_nodes),
                                             {"clone": True} if value in cloned else {})
                grad_nodes += 1
                later = order[node]
                if isinstance(value, fx.Node):
                    value.replace_all_uses_with(
                        tapped, delete_user_cb=lambda user: user is not tapped
                        and order.get(user, -1) > later)
            else:
                graph.call_function(tap_output, (bank_node, value, key))
        graph.erase_node(node)
    for node in list(graph.nodes):  # the recorder is read by nothing now
        if node.op == "get_attr" and node.target != BANK_ATTR and not node.users \
                and isinstance(getattr(gm, str(node.target), None), torch.nn.Module):
            graph.erase_node(node)
    bank.nodes = grad_nodes
    graph.lint()
    gm.recompile()
    return grad_nodes
