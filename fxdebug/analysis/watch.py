"""``watch_nonfinite``: a NaN/Inf check cheap enough to leave on in a training loop.

Call tree::

    watch = watch_nonfinite(model)
    out = watch(x)                    model(x); keeps the step's inputs (copies), RNG state
      │                               and buffers; one finiteness flag of the outputs,
      │                               kept as a tensor (nothing read back)
    loss.backward()
    watch.check(loss_fn)              one read per step: outputs and parameter gradients
      │                               finite? (one fused norm over all gradients)
      └─ first non-finite step:       confirmed on the values, then replayed node by node
           find_nonfinite(model, *inputs, loss=loss_fn)   same inputs, RNG state, buffers
           -> NonfiniteReport: the node that created the NaN/Inf, forward or backward,
              with the user's file:line

Call ``check`` after ``backward()`` and before ``optimizer.step()``: the replay
needs the parameters the step used. Only the step's outputs and parameter
gradients are checked each step; a non-finite value that reaches neither
(masked out, say) is not reported.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import FxdebugError
from ..runtime import clone_inputs
from .compare import iter_tensors
from .nonfinite import NonfiniteReport, find_nonfinite

__all__ = ["watch_nonfinite", "NonfiniteWatch"]


def _sum_flag(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-dim bool tensor, False when a value may be non-finite (a sum is non-finite if any
    value is; it can overflow on finite values, so a False is confirmed before it is reported)."""
    sums = [t.detach().sum() for t in tensors if t.is_floating_point() or t.is_complex()]
    if not sums:
        return None
    return torch.isfinite(torch.stack([s.to(torch.float32) for s in sums]).sum())


class NonfiniteWatch:
    """What :func:`watch_nonfinite` returns: call it like the model, then :meth:`check` each step.

    ``report`` is the :class:`~fxdebug.NonfiniteReport` of the first
    non-finite step (None until then); ``steps`` counts the forwards.
    """

    def __init__(self, model: torch.nn.Module, ignore=None) -> None:
        self.model = model
        self.ignore = ignore
        self.report: NonfiniteReport | None = None
        self.steps = 0
        self._inputs: tuple = ()
        self._rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._buffers: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor] = []
        self._flag: torch.Tensor | None = None

    def __call__(self, *inputs):
        self.steps += 1
        self._inputs = clone_inputs(inputs)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else [])
        self._buffers = [b.detach().clone() for b in self.model.buffers()]
        output = self.model(*inputs)
        self._outputs = [t for _, t in iter_tensors(output)]
        self._flag = _sum_flag(self._outputs)
        return output

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _flagged(self) -> bool:
        flags = [] if self._flag is None else [self._flag]
        grads = [g for g in self._grads() if g.is_floating_point()]
        if grads:
            norms = torch._foreach_norm(grads)  # one fused kernel over every gradient
            flags.append(torch.isfinite(torch.stack([n.to(torch.float32) for n in norms]).sum()))
        if not flags:
            return False
        return not bool(torch.stack([f.to(flags[0].device) for f in flags]).all())

    def _confirmed(self) -> bool:
        return any(not bool(torch.isfinite(t.detach()).all())
                   for t in self._outputs + self._grads()
                   if t.is_floating_point() or t.is_complex())

    def check(self, loss: Callable[[Any], torch.Tensor] | None = None) -> NonfiniteReport | None:
        """None while the step's outputs and parameter gradients are finite; on the first step
        where they are not, the :class:`~fxdebug.NonfiniteReport` of that step replayed node by
        node (and the same report on every later call).

        ``loss`` maps the model's output to the scalar the step differentiated
        (default: the sum of the outputs); the replay's backward uses it.
        """
        if self.report is not None:
            return self.report
        if self._rng is None:
            raise FxdebugError("NonfiniteWatch.check() before any step: call watch(inputs) "
                               "(instead of model(inputs)), then backward(), then check().")
        if not self._flagged() or not self._confirmed():
            return None
        self.report = self._replay(loss)
        return self.report

    def _replay(self, loss) -> NonfiniteReport:
        """find_nonfinite on the step's inputs, from the step's RNG state and buffers; the
        model's current buffers and RNG state are put back afterwards."""
        cpu_state, cuda_states = self._rng
        now_buffers = [b.detach().clone() for b in self.model.buffers()]
        devices = list(range(len(cuda_states)))
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_state)
            if cuda_states:
                torch.cuda.set_rng_state_all(cuda_states)
            with torch.no_grad():
                for buffer, saved in zip(self.model.buffers(), self._buffers):
                    buffer.copy_(saved)
            try:
                report = find_nonfinite(self.model, *self._inputs, loss=loss,
                                        ignore=self.ignore)
            finally:
                with torch.no_grad():
                    for buffer, saved in zip(self.model.buffers(), now_buffers):
                        buffer.copy_(saved)
        report.notes.append(f"replayed step {self.steps} of the watch")
        return report


def watch_nonfinite(model: torch.nn.Module, ignore=None) -> NonfiniteWatch:
    """Watch a training loop for NaN/Inf; name the node that made it on the first bad step.

    Each step costs one finiteness flag (a sum of the outputs, a fused norm of
    the parameter gradients) and one read in :meth:`NonfiniteWatch.check`;
    the model runs eagerly, untouched. The first step whose outputs or
    parameter gradients hold a NaN or an Inf is replayed node by node with
    :func:`fxdebug.find_nonfinite` (same inputs, random-number state and
    buffers), which names the node that created it, forward or backward,
    with the user's ``file:line``.

    Args:
        model: the ``nn.Module`` the loop trains.
        ignore: keys or globs whose outputs may be non-finite on purpose.

    Example::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         return torch.log(self.fc(x))
        >>> _ = torch.manual_seed(0); net = Net(); watch = fxdebug.watch_nonfinite(net)
        >>> for step in range(20):
        ...     out = watch(torch.randn(4, 2))
        ...     out.nan_to_num().sum().backward()
        ...     report = watch.check()
        ...     if report is not None:
        ...         break
        >>> report.forward.key, report.forward.created
        ('log', True)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"watch_nonfinite expects an nn.Module, got {type(model).__name__}.")
    return NonfiniteWatch(model, ignore=ignore)
