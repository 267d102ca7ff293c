"""``watch_nonfinite``: a NaN/Inf check cheap enough to leave on in a training loop.

Call tree::

    watch = NonfiniteWatch(model)     (what fxdebug.watch_nonfinite(model) returns)
    out = watch(*args, **kwargs)      model(...); keeps the step's inputs (copies), RNG state
      │                               and buffers (for DistributedDataParallel: as its module
      │                               receives them, after DDP's buffer broadcast), and the
      │                               sum of the outputs, as a tensor (nothing read back);
      │                               one walk of the module tree finds the parameters and
      │                               buffers, exact whatever changed them since the last step
    loss.backward()
    watch.check(loss_fn)              one read per step: the output sum and the gradients'
      │                               flags (gradient_flags.py: on the CPU a sum per large
      │                               gradient and per group of small ones concatenated,
      │                               elsewhere one fused max|g|),
      │                               finite?
      │   under torch.distributed:    each rank puts its two numbers in its slot of a
      │                               2 x world vector, one all_reduce (watch_ranks.RankFlags),
      │                               one read: every rank learns on the same step which
      │                               ranks went non-finite
      └─ first non-finite step:       confirmed on the values, then replayed node by node
           find_nonfinite(module, *args)      same inputs, RNG state, buffers; keyword and
                                              non-tensor arguments traced as constants
           (a model torch.fx cannot trace: watch_modules.replay_by_modules, forward hooks)
           -> WatchReport (a NonfiniteReport): the node that created the NaN/Inf, forward
              or backward, with the user's file:line; distributed:
              watch_ranks.RankNonfiniteReport (every rank's finding, gathered, on every rank)
           a replay that is finite: NOT REPRODUCED (watch_report.py), and for a
              torch.compile'd model (replayed eagerly) the check_compiled it was given,
              on the step's inputs: the first node where the compiled code differs

Call ``check`` after ``backward()`` and before ``optimizer.step()``: the replay
needs the parameters the step used. Only the step's outputs and parameter
gradients are checked each step; a non-finite value that reaches neither
(masked out, say) is not reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import weakref
from typing import Any, Callable

import torch
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from ..errors import FxdebugError, TraceFailure, deprecated
from ..runtime import clone_inputs, flatten_tensors
from ..base.report import REPR_LIMIT
from ..base.torch_compat import (compiled_backend, compiled_inner, foreach_copy_,
                                 parameters_and_buffers)
from ..frontend import trace
from .gradient_flags import GradientFlags, flag_sum
from .nonfinite import NonfiniteReport, find_nonfinite
from ..distributed.rank_group import RankGroup, distributed_ready, unwrap
from .watch_modules import replay_by_modules
from ..distributed.sharded_replay import kept_parameters, sharded_parameter
from .watch_ranks import RankFlags, RankNonfiniteReport
from .watch_report import WatchReport

__all__ = ["NonfiniteWatch"]


def _is_float(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class NonfiniteWatch:
    """What :func:`fxdebug.watch_nonfinite` returns: call it like the model, then :meth:`check`
    each step; :meth:`remove` (or leaving a ``with`` block) takes its hooks off.

    ``report`` is the report of the first non-finite step (None until then): a
    :class:`~fxdebug.NonfiniteReport`, or under ``torch.distributed`` a
    :class:`~fxdebug.nonfinite.watch_ranks.RankNonfiniteReport`; ``steps`` counts the forwards.
    """

    def __init__(self, model: torch.nn.Module, ignore=None, group=None,
                 check_compiled: Callable | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch_nonfinite expects an nn.Module, got {type(model).__name__}.")
        self.model = model
        self.module, self.wrapper = unwrap(model)
        # torch.compile(model): the replay runs the module inside, eagerly
        self.eager_module = compiled_inner(self.module) or self.module
        self.check_compiled = check_compiled
        self.ignore = ignore
        self.group = group
        self.report: NonfiniteReport | RankNonfiniteReport | None = None
        self.steps = 0
        self._flags: RankFlags | None = None
        self._args: tuple = ()
        self._kwargs: dict[str, Any] = {}
        self._rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._buffers: list[torch.Tensor] | None = []
        self._kept: list[torch.Tensor] = []  # the buffer snapshot's tensors, reused
        self._kept_groups: list[list[int]] = []  # their indices, by dtype and device
        self._outputs: list[torch.Tensor] = []
        self._out_sum: torch.Tensor | None = None
        self._parameters: list[torch.Tensor] | None = None  # the model's, as the step began
        self._gradient_flags = GradientFlags()
        self._registrations = _Registrations()
        weakref.finalize(self, self._registrations.close)

    def __repr__(self) -> str:
        """One line: the model, the steps watched, the first non-finite report's verdict.

        >>> NonfiniteWatch(torch.nn.Linear(2, 2))
        <NonfiniteWatch Linear, 0 step(s), all finite so far>
        """
        report = self.report
        state = "all finite so far" if report is None else \
            f"{report.verdict_words[1]}: {' '.join(report._finding().split())}"
        name = type(self.eager_module).__name__ + (
            " (compiled)" if self.eager_module is not self.module else "")
        text = f"<NonfiniteWatch {name}, {self.steps} step(s), {state}"
        return (text[:REPR_LIMIT - 2] + "…>") if len(text) > REPR_LIMIT - 1 else text + ">"

    def __call__(self, *args, **kwargs):
        self.steps += 1
        if self._flags is None and (self.group is not None or distributed_ready()):
            self._flags = RankFlags(RankGroup.of(self.group, what="watch_nonfinite"))
        self._args = _copied(args)
        self._kwargs = clone_inputs(kwargs) if kwargs else {}
        self._rng = (torch.get_rng_state(),  # is_initialized: no CUDA call without CUDA
                     torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])
        # DDP averages this step's gradients (identical on every rank) unless in no_sync()
        synced = (self.wrapper == "DistributedDataParallel" and torch.is_grad_enabled()
                  and getattr(self.model, "require_backward_grad_sync", False) is True)
        # one walk of the module tree per step: the parameters whose gradients check() reads
        # (a module or parameter registered from here to check(): check() walks again);
        # exact, whatever changed the tree (direct writes to a module's registries too)
        self._registrations.start()
        parameters, buffers = parameters_and_buffers(self.model)
        self._parameters = parameters
        if self.wrapper:  # DDP broadcasts buffers before its module runs: snapshot them there
            self._buffers = None
            handle = self.module.register_forward_pre_hook(self._snapshot_buffers)
            try:
                output = self.model(*args, **kwargs)
            finally:
                handle.remove()
            if self._buffers is None:  # the wrapper called its module's forward directly
                self._snapshot_buffers()
        else:
            self._snapshot(buffers)
            output = self.model(*args, **kwargs)
        # kept detached (same values): the step's autograd graph goes when the user drops it
        outputs = ([output] if type(output) is torch.Tensor else
                   [t for _, t in flatten_tensors(output)])
        self._outputs = [t.detach() for t in outputs if _is_float(t)]
        sums = [flag_sum(t) for t in self._outputs]
        self._out_sum = sums[0] if len(sums) == 1 else (
            torch.stack([s.to(sums[0].device) for s in sums]).sum() if sums else None)
        if self._flags is not None:
            self._flags.after_forward(self._out_sum, synced)
        return output

    def _snapshot_buffers(self, *_) -> None:
        """Copy the buffers into tensors kept from step to step (a forward pre-hook)."""
        self._snapshot(list(self.module.buffers()))

    def _snapshot(self, buffers: list[torch.Tensor]) -> None:
        """Copy ``buffers`` (``self.module.buffers()``) into tensors kept from step to step: one
        fused copy per dtype and device (given a mixed list, torch copies tensor by tensor: a
        launch per BatchNorm buffer)."""
        buffers = [b.detach() for b in buffers]
        kept = self._kept
        if len(kept) != len(buffers) or any(
                k.shape != b.shape or k.dtype != b.dtype or k.device != b.device
                for k, b in zip(kept, buffers)):
            kept = self._kept = [torch.empty_like(b) for b in buffers]
            groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
            for index, buffer in enumerate(buffers):  # (insertion order: deterministic)
                groups.setdefault((buffer.dtype, buffer.device), []).append(index)
            self._kept_groups = list(groups.values())
        for group in self._kept_groups:
            foreach_copy_([kept[i] for i in group], [buffers[i] for i in group])
        self._buffers = kept

    def _grads(self, parameters: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The float gradients of ``parameters`` (default: the model's, walked now)."""
        grads = []
        for p in self.model.parameters() if parameters is None else parameters:
            grad = p.grad
            if grad is not None and _is_float(grad):
                if type(grad) is not torch.Tensor and hasattr(grad, "to_local"):
                    grad = grad.to_local()  # a DTensor (FSDP2): its local shard
                if grad.numel():  # max|g| of nothing has no value (an empty shard)
                    grads.append(grad)
        return grads

    def sharded_parameter(self) -> str:
        """The name of a DTensor parameter (FSDP2 shards, tensor parallel), or ``""``: such
        a model's forward runs collectives, so every rank replays its step together."""
        return sharded_parameter(self.module)

    def _grad_max(self, parameters: list[torch.Tensor] | None = None
                  ) -> torch.Tensor | list[torch.Tensor] | None:
        """Numbers that are all finite when every parameter gradient is (gradient_flags.py):
        on the CPU a sum of each large gradient and of small ones concatenated, cheaper to
        read one by one than to stack; elsewhere one fused max|g|."""
        return self._gradient_flags(list(self.model.parameters()) if parameters is None
                                    else parameters)

    def _confirmed(self) -> bool:
        return any(not bool(torch.isfinite(_local(t)).all())
                   for t in self._outputs + self._grads())

    def _flagged(self) -> tuple[str, str]:
        """What is non-finite in the step: ``("outputs NaN, gradients NaN", the same with
        counts and parameter names)``; ``("", "")`` when nothing is."""
        short, long = [], []
        outputs = self._outputs
        nan = sum(int(torch.isnan(t).sum()) for t in outputs)
        inf = sum(int(torch.isinf(t).sum()) for t in outputs)
        if nan or inf:
            short.append(f"outputs {_kinds(nan, inf)}")
            long.append(f"outputs: {nan} NaN, {inf} Inf of {sum(t.numel() for t in outputs)}")
        bad = [(name, p.grad) for name, p in self.eager_module.named_parameters()
               if p.grad is not None and _is_float(p.grad)
               and not bool(torch.isfinite(_local(p.grad)).all())]
        if bad:
            grad_nan = any(bool(torch.isnan(_local(g)).any()) for _, g in bad)
            grad_inf = any(bool(torch.isinf(_local(g)).any()) for _, g in bad)
            short.append(f"gradients {_kinds(grad_nan, grad_inf)}")
            names = [name for name, _ in bad]
            long.append(f"gradients of {len(names)} parameter(s): {', '.join(names[:4])}"
                        + (", ..." if len(names) > 4 else ""))
        return ", ".join(short), "; ".join(long)

    def inputs(self) -> tuple[tuple, dict[str, Any]]:
        """Copies of the latest step's ``(args, kwargs)``, as the model received them.

        >>> watch = NonfiniteWatch(torch.nn.Linear(2, 2))
        >>> _ = watch(torch.ones(1, 2))
        >>> watch.inputs()
        ((tensor([[1., 1.]]),), {})
        """
        return clone_inputs(self._args), clone_inputs(self._kwargs)

    def remove(self) -> None:
        """Remove the two global registration hooks of torch (``torch.nn.modules.module``'s
        parameter and module registration hooks) the watch holds from its first step, as
        torch's hook handles' ``remove()``; leaving a ``with`` block and the watch being
        garbage collected do the same. A later step registers them again.

        >>> with NonfiniteWatch(torch.nn.Linear(2, 2)) as watch:
        ...     _ = watch(torch.ones(1, 2))
        ...     len(watch._registrations.handles)
        2
        >>> watch._registrations.handles
        []
        """
        self._registrations.close()

    def close(self) -> None:
        """Deprecated: :meth:`remove`, as torch's hook handles."""
        deprecated("NonfiniteWatch.close()", "NonfiniteWatch.remove()")
        self.remove()

    def __enter__(self) -> "NonfiniteWatch":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def check(self, loss: Callable[[Any], torch.Tensor] | None = None
              ) -> NonfiniteReport | RankNonfiniteReport | None:
        """None while the step's outputs and parameter gradients are finite; on the first step
        where they are not, the report of that step replayed node by node (and the same
        report on every later call).

        Under ``torch.distributed`` this is a collective (every rank calls it every step):
        the flags of all ranks are all-reduced, every rank returns a
        :class:`~fxdebug.nonfinite.watch_ranks.RankNonfiniteReport` on the same step, naming
        the ranks; the ranks that went non-finite replay their own step.

        ``loss`` maps the model's output to the scalar the step differentiated
        (default: the sum of the outputs); the replay's backward uses it.
        """
        if self.report is not None:
            return self.report
        if self._rng is None:
            raise FxdebugError("NonfiniteWatch.check() before any step: call watch(inputs) "
                               "(instead of model(inputs)), then backward(), then check().")
        parameters = self._parameters
        if self._registrations.seen or parameters is None:
            parameters = None  # the module tree may have changed since the step began: walk it
        grads = self._grad_max(parameters)
        if self._flags is not None:
            flagged = self._flags.flagged(self._out_sum, grads)
            if flagged:
                self.report = self._flags.gather_report(self, flagged, loss)
            return self.report
        if all(math.isfinite(v) for v in _read(self._out_sum, grads)) or not self._confirmed():
            return None
        self.report = self.replay(loss)
        return self.report

    def replay(self, loss=None, lockstep: bool = False) -> WatchReport:
        """find_nonfinite on the last step's inputs, from its RNG state and buffers; the
        model's current buffers and RNG state are put back afterwards. A data-parallel
        wrapper's module is replayed (no collective runs), a torch.compile'd model's
        module runs eagerly. When the replay is finite while the step was not, the
        report says NOT REPRODUCED, and for a compiled model holds ``check_compiled``'s
        report on the step's inputs (``report.compiled``).

        ``lockstep``: every rank replays at once (a sharded model, whose step runs
        collectives): the same runs on every rank (``find_nonfinite(lockstep=True)``),
        each parameter's local values and gradient kept as they were."""
        if self._rng is None:
            raise FxdebugError("NonfiniteWatch.replay() before any step: call watch(inputs) "
                               "(instead of model(inputs)) first.")
        flagged, detail = self._flagged()
        cpu_state, cuda_states = self._rng
        now_buffers = [b.detach().clone() for b in self.module.buffers()]
        devices = list(range(len(cuda_states)))
        kept = kept_parameters(self.module) if lockstep else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices), kept:
            torch.set_rng_state(cpu_state)
            if cuda_states:
                torch.cuda.set_rng_state_all(cuda_states)
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), self._buffers or []):
                    buffer.copy_(saved)
            try:
                try:
                    target, positional = _replay_call(self.eager_module, self._args,
                                                      self._kwargs)
                    report = find_nonfinite(target, *positional, loss=loss, ignore=self.ignore,
                                            lockstep=lockstep)
                except TraceFailure as failure:  # untraceable: module by module instead
                    if lockstep:  # module by module, the ranks' collectives could not match
                        raise
                    target, positional = self.eager_module, ()
                    report = replay_by_modules(self.eager_module, clone_inputs(self._args),
                                               clone_inputs(self._kwargs), loss,
                                               f"torch.fx cannot trace "
                                               f"{type(self.eager_module).__name__} "
                                               f"({failure.kind})")
                report = WatchReport(**{field.name: getattr(report, field.name)
                                        for field in dataclasses.fields(report)},
                                     step=self.steps, flagged=flagged, flagged_detail=detail)
                if flagged and not report.reproduced and self.eager_module is not self.module:
                    self._check_compiled(report, target, positional, flagged)
            except Exception as exc:
                exc.add_note(f"fxdebug: watch_nonfinite found non-finite values at step "
                             f"{self.steps} and replayed it node by node with find_nonfinite, "
                             f"which failed; the watch's own flag needs no tracing, the replay "
                             f"does (fxdebug.trace({type(self.module).__name__}))")
                raise
            finally:
                with torch.no_grad():
                    for buffer, saved in zip(self.module.buffers(), now_buffers):
                        buffer.copy_(saved)
        report.notes.append(f"replayed step {self.steps} of the watch"
                            + (f" (the module inside {self.wrapper}, keys without 'module.')"
                               if self.wrapper else "")
                            + (" (the module torch.compile wrapped, run eagerly)"
                               if self.eager_module is not self.module else ""))
        return report

    def _check_compiled(self, report: WatchReport, target: torch.nn.Module, positional: tuple,
                        flagged: str) -> None:
        """``report.compiled``: check_compiled on the step's inputs with the model's backend
        (under the step's RNG state and buffers, which the caller has put back)."""
        found = compiled_backend(self.module)
        backend, report.compiled_backend = found if found is not None else (
            "inductor", "inductor (torch.compile's default; the model's own was not found)")
        if self.check_compiled is None:
            return
        if not positional:
            report.compiled_error = (f"{type(self.eager_module).__name__} was replayed module "
                                     f"by module (torch.fx cannot trace it); check_compiled "
                                     f"needs positional inputs")
            return
        try:
            report.compiled = self.check_compiled(
                target, *positional, backend=backend,
                grads="outputs" not in flagged)  # only gradients flagged: compare them
        except Exception as exc:  # reported, with its type: the watch's finding stands
            report.compiled_error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class _Registrations:
    """Whether torch registered a module or a parameter anywhere (every module's
    ``register_parameter``, ``add_module``, ``setattr``) since :meth:`start`: the watch then
    walks the model again instead of using the walk the step began with. torch's public
    global registration hooks, registered by the first step and held until :meth:`close`
    (the watch's ``close()``, or the watch garbage collected)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.seen = False

    def __call__(self, *_) -> None:  # a registration hook: changes nothing
        self.seen = True

    def start(self) -> None:
        self.seen = False
        if not self.handles:
            self.handles = [register_module_parameter_registration_hook(self),
                            register_module_module_registration_hook(self)]

    def close(self) -> None:
        """Remove the hooks (a later :meth:`start` registers them again); until then, a
        registration cannot be seen: :attr:`seen` (walk again) holds."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.seen = True


def _copied(args: tuple) -> tuple:
    """``clone_inputs(args)``; positional tensors alone (the usual step) without its walk."""
    if all(type(arg) is torch.Tensor for arg in args):
        return tuple(_copied_tensor(arg) for arg in args)
    return clone_inputs(args)


def _copied_tensor(tensor: torch.Tensor) -> torch.Tensor:
    copied = tensor.detach().clone()
    return copied.requires_grad_(True) if tensor.requires_grad else copied


def _kinds(nan, inf) -> str:
    return "NaN and Inf" if nan and inf else "NaN" if nan else "Inf"


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local values (a DTensor's shard; a sparse gradient's stored values)."""
    if type(grad) is not torch.Tensor and hasattr(grad, "to_local"):
        grad = grad.to_local()
    if grad.layout is torch.sparse_coo:  # Embedding(sparse=True)
        return grad.coalesce().values()
    return grad


def _read(outputs: torch.Tensor | None, grads) -> list[float]:
    """The step's numbers on the host: one read (off the CPU, one stacked tensor)."""
    if isinstance(grads, list):  # on the CPU: reading each costs less than stacking them
        return ([] if outputs is None else [outputs.item()]) + [g.item() for g in grads]
    terms = [t for t in (outputs, grads) if t is not None]
    if not terms:
        return []
    device = terms[-1].device
    return torch.stack([t.to(device, torch.float64) for t in terms]).tolist()


def _replay_call(module: torch.nn.Module, args: tuple,
                 kwargs: dict) -> tuple[torch.nn.Module, tuple]:
    """What find_nonfinite replays, ``(module or graph, positional arguments)``: every
    argument bound to its place in ``forward``'s signature (defaults filled in), the
    module traced with the non-tensor ones as constants (``concrete_args``), so that a
    flag (``if flip:``) or a ``None`` default does not stop the trace.
    """
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        if not kwargs:
            return module, args
        raise FxdebugError(f"watch_nonfinite: the step's arguments do not fit "
                           f"{type(module).__name__}.forward{_signature(module)}: {exc}") from None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not kwargs and any(p.kind is inspect.Parameter.VAR_POSITIONAL
                          for p in signature.parameters.values()):
        return module, args  # forward(self, *args): positional as given
    bound.apply_defaults()
    names = [name for name, p in signature.parameters.items() if p.kind in kinds]
    extra = [name for name in bound.arguments if name not in names and bound.arguments[name]]
    if extra:
        raise FxdebugError(f"watch_nonfinite: the replay passes arguments by position, and "
                           f"{type(module).__name__}.forward{_signature(module)} takes "
                           f"{', '.join(extra)} as *args/**kwargs; give the step's tensors as "
                           f"named parameters of forward.")
    values = [bound.arguments[name] for name in names]
    constant = {name: value for name, value in zip(names, values)
                if not any(True for _ in flatten_tensors(value))}
    if not constant:
        return module, tuple(values)
    return trace(module, concrete_args=constant), tuple(values)


def _signature(module: torch.nn.Module) -> str:
    try:
        return str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        return "(...)"
