"""Replay a spike step: the same batch, RNG state and parameters, every node captured.

While ``monitor(spikes=...)`` is on, each forward of a step leaves what a replay needs
(:class:`StepForwards`): its inputs (references), the random-number state it began with,
its outputs and, after ``backward()``, the gradient that reached each output. When a rule
fires at ``step()`` (before ``optimizer.step()``: the parameters are those of the
forward), :func:`replay_step` runs::

    replay_step(model, forwards, ...)
      ├─ for each forward of the step (micro-batches)
      │    ├─ same dtype: instrument(model, capture="all", grads=True), RNG restored;
      │    │   backward of sum(<output, kept gradient>): the step's own backward, the
      │    │   loss outside the model included, without touching .grad
      │    └─ float64: a float64 copy of the model, the same inputs, RNG and gradients
      ├─ reproduced? outputs within rounding of the step's, parameter gradients with the
      │   same non-finite places and direction (a clipped gradient is still the same)
      ├─ first non-finite: the first node whose value holds NaN/Inf (forward), else the
      │   first gradient in backward order (or the loss, when the output's gradient is)
      └─ first divergence: the first node whose error against float64 exceeds
          ROUNDING_FACTOR times what reached it (forward, then backward), in eps of its dtype

Buffers (BatchNorm statistics), the random-number state and every ``.grad`` are left as
they were. A model that draws random numbers (dropout in training mode) draws other ones in
float64: then nothing is compared against float64, and the report says so.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import torch

from ..errors import FxdebugError
from ..instrumenting import instrument, records
from ..runs.rounding import ROUNDING_FACTOR, rounding_ratio
from ..runtime.values import flatten_tensors, map_tensors

__all__ = ["StepForwards", "Forward", "ReplayFindings", "replay_step"]


@dataclasses.dataclass
class Forward:
    """One forward of a step: what its replay needs."""

    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: list[tuple[int, torch.Tensor]]
    outputs: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class StepForwards:
    """The forwards of the current step (kept until ``step()``), for a replay."""

    def __init__(self) -> None:
        self.forwards: list[Forward] = []

    def begin(self, args: tuple, kwargs: dict) -> Forward:
        """Before a forward: its inputs and the random-number state it starts from."""
        devices = sorted({t.device.index or 0 for _, t in flatten_tensors((args, kwargs))
                          if t.is_cuda})
        entry = Forward(args, dict(kwargs), torch.get_rng_state(),
                        [(d, torch.cuda.get_rng_state(d)) for d in devices])
        self.forwards.append(entry)
        return entry

    @staticmethod
    def end(entry: Forward, out: Any) -> None:
        """After it: its floating outputs, each with a hook that keeps the gradient it gets."""
        for name, tensor in flatten_tensors(out):
            if not tensor.is_floating_point():
                continue
            entry.outputs.append((name, tensor.detach()))
            if tensor.requires_grad:
                position = len(entry.outputs) - 1
                tensor.register_hook(_keeper(entry.grads, position))

    def clear(self) -> None:
        self.forwards = []


def _keeper(store: dict, position: int):
    def keep(grad):
        found = store.get(position)
        store[position] = grad.detach() if found is None else found + grad.detach()
    return keep


@dataclasses.dataclass
class ReplayFindings:
    """What one rank's replay found (see :func:`replay_step`)."""

    reproduced: bool | None
    reproduced_why: str
    first_nonfinite: str | None
    first_nonfinite_where: str
    first_divergence: str | None
    divergence_eps: float
    compared: bool
    notes: list[str]


def replay_step(model: torch.nn.Module, forwards: list[Forward], same: torch.nn.Module,
                float64: torch.nn.Module | None,
                reduce_grads: Callable[[list], list] | None = None) -> ReplayFindings:
    """Replay the step's ``forwards`` through ``same`` (``instrument(model, capture="all",
    grads=True)``) and ``float64`` (the same of a float64 copy; None: not compared).

    ``reduce_grads`` (under DistributedDataParallel) turns the replay's parameter gradients
    into what the ranks' reduction made of them before they are compared with ``.grad``.
    ``model``'s buffers, every parameter's ``.grad`` and the random-number state are put
    back afterwards. Returns :class:`ReplayFindings`.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    notes: list[str] = []
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_state = torch.get_rng_state()
    devices = sorted({d for f in forwards for d, _ in f.cuda_rng})
    cuda_states = [(d, torch.cuda.get_rng_state(d)) for d in devices]
    try:
        runs, draws = _runs(same, forwards, params, None)
        reproduced, why = _reproduced(forwards, runs, params, reduce_grads)
        nonfinite, where = _first_nonfinite(runs, params, model)
        divergence, eps, compared = None, 0.0, False
        if float64 is None:
            notes.append("not compared against float64 (no float64 copy)")
        elif draws:
            notes.append("not compared against float64: the model draws random numbers in "
                         "this step (dropout in training mode?), which a float64 replay draws "
                         "differently")
        else:
            params64 = [p for p in float64.parameters() if p.requires_grad]
            runs64, _ = _runs(float64, forwards, params64, torch.float64)
            names = [name for name, p in model.named_parameters() if p.requires_grad]
            divergence, eps = _first_divergence(runs, runs64, names)
            compared = True
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_state)
        for device, state in cuda_states:
            torch.cuda.set_rng_state(state, device)
    return ReplayFindings(reproduced, why, nonfinite, where, divergence, eps, compared, notes)


@dataclasses.dataclass
class _Run:
    outputs: list[torch.Tensor]
    values: list[tuple[str, list[torch.Tensor]]]   # forward keys in execution order
    grads: list[tuple[str, list[torch.Tensor]]]    # gradient keys in backward order
    param_grads: list[torch.Tensor | None]
    out_grads: list[torch.Tensor]


def _runs(gm: torch.nn.Module, forwards: list[Forward], params, dtype) -> tuple[list[_Run], bool]:
    """One replay of every forward; whether any of them drew random numbers."""
    runs, draws = [], False
    for entry in forwards:
        torch.set_rng_state(entry.cpu_rng)
        for device, state in entry.cuda_rng:
            torch.cuda.set_rng_state(state, device)
        args, kwargs = entry.args, entry.kwargs
        if dtype is not None:
            args, kwargs = map_tensors(_to(dtype), (args, kwargs))
        with torch.enable_grad():
            out = gm(*args, **kwargs)
            draws = draws or not torch.equal(torch.get_rng_state(), entry.cpu_rng) or any(
                not torch.equal(torch.cuda.get_rng_state(device), state)
                for device, state in entry.cuda_rng)
            leaves = [t for _, t in flatten_tensors(out) if t.is_floating_point()]
            if len(leaves) != len(entry.outputs):
                raise FxdebugError(
                    f"fxdebug.monitor: the replay of the spike step made {len(leaves)} floating "
                    f"outputs, the step made {len(entry.outputs)}: the model's forward depends "
                    f"on more than its inputs, parameters and random state; the spike cannot "
                    f"be replayed faithfully.")
            out_grads = [entry.grads.get(i, torch.zeros_like(o)) for i, (_, o) in
                         enumerate(entry.outputs)]
            if dtype is not None:
                out_grads = [g.to(dtype) for g in out_grads]
            pairs = [(t, g) for t, g in zip(leaves, out_grads) if t.requires_grad]
            param_grads: list[torch.Tensor | None] = [None] * len(params)
            if pairs and params:
                surrogate = torch.stack([(t * g.to(t.dtype)).sum().double() for t, g in pairs]).sum()
                param_grads = list(torch.autograd.grad(surrogate, params, allow_unused=True))
        rec = records(gm)
        values = [(key, _leaves(rec[key])) for key in rec.keys()]
        grads = [(key, _leaves(rec.grads[key])) for key in rec.grads.keys()]
        runs.append(_Run([t.detach() for t in leaves], values, grads,
                         [None if g is None else g.detach() for g in param_grads], out_grads))
    return runs, draws


def _to(dtype):
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(dtype) if tensor.is_floating_point() else tensor
    return convert


def _leaves(value) -> list[torch.Tensor]:
    return [t.detach() for _, t in flatten_tensors(value) if t.is_floating_point()]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return rounding_ratio(a, b, a.dtype) <= ROUNDING_FACTOR


def _reproduced(forwards: list[Forward], runs: list[_Run], params,
                reduce_grads) -> tuple[bool, str]:
    for number, (entry, run) in enumerate(zip(forwards, runs)):
        for (name, kept), again in zip(entry.outputs, run.outputs):
            if not _same(kept, again):
                return False, (f"the replay's output {name or 'out'} (forward {number}) differs "
                               f"from the step's")
    summed: list[torch.Tensor | None] = []
    for index in range(len(params)):
        total: torch.Tensor | None = None
        for run in runs:
            grad = run.param_grads[index]
            if grad is not None:
                total = grad if total is None else total + grad
        summed.append(total)
    if reduce_grads is not None:
        summed = reduce_grads(summed)
    step_grads: list[torch.Tensor | None] = [p.grad for p in params]
    pairs = [(k.detach(), s) for k, s in zip(step_grads, summed) if k is not None and s is not None
             and k.shape == s.shape]
    if not pairs:
        return True, "the replay's outputs equal the step's (no parameter gradient to compare)"
    kept_flat = torch.cat([k.reshape(-1).double() for k, _ in pairs])
    again_flat = torch.cat([s.reshape(-1).double() for _, s in pairs])
    if not torch.equal(torch.isfinite(kept_flat), torch.isfinite(again_flat)):
        return False, ("the replay's parameter gradients hold NaN/Inf in other places than the "
                       "step's")
    finite = torch.isfinite(kept_flat)
    a, b = kept_flat[finite], again_flat[finite]
    norms = float(a.norm() * b.norm())
    cosine = float(a @ b) / norms if norms > 0 else (1.0 if float(a.norm()) == float(b.norm())
                                                      else 0.0)
    if cosine < 1 - 1e-4:
        return False, (f"the replay's parameter gradients point elsewhere than the step's "
                       f"(cosine {cosine:.6f})")
    return True, "the replay's outputs and parameter gradients equal the step's"


def _first_nonfinite(runs: list[_Run], params, model) -> tuple[str | None, str]:
    for number, run in enumerate(runs):
        for key, values in run.values:
            if any(not bool(torch.isfinite(t).all()) for t in values):
                return key, f"forward{_which(number, runs)}"
    for number, run in enumerate(runs):
        if any(not bool(torch.isfinite(g).all()) for g in run.out_grads):
            return "loss", (f"the gradient reaching the model's output{_which(number, runs)}: "
                            f"the loss, outside the model")
        for key, values in run.grads:
            if any(not bool(torch.isfinite(t).all()) for t in values):
                return key, f"backward{_which(number, runs)}"
    names = {id(p): name for name, p in model.named_parameters()}
    for run in runs:
        for param, grad in zip(params, run.param_grads):
            if grad is not None and not bool(torch.isfinite(grad).all()):
                return names.get(id(param), "a parameter"), "parameter gradient"
    return None, ""


def _which(number: int, runs: list) -> str:
    return f" of micro-batch {number}" if len(runs) > 1 else ""


def _first_divergence(runs: list[_Run], runs64: list[_Run],
                      names: list[str]) -> tuple[str | None, float]:
    """The first key whose error against float64 exceeds ROUNDING_FACTOR times what came in
    (forward values, then activation gradients); then the first parameter gradient that is
    non-finite where float64's is finite (a parameter's gradient is a sum over the batch,
    often near 0 by cancellation, where a relative error says nothing)."""
    for run, ref in zip(runs, runs64):
        for section in ("values", "grads"):
            before = 1.0
            reference = dict(getattr(ref, section))
            for key, values in getattr(run, section):
                found = reference.get(key)
                if found is None or len(found) != len(values):
                    continue
                ratio = max((rounding_ratio(r, x, x.dtype) for x, r in zip(values, found)
                             if x.shape == r.shape), default=0.0)
                if ratio > ROUNDING_FACTOR * before:
                    return key, ratio
                if math.isfinite(ratio):
                    before = max(before, ratio)
    for run, ref in zip(runs, runs64):
        for name, grad, grad64 in zip(names, run.param_grads, ref.param_grads):
            if grad is not None and grad64 is not None and not torch.equal(
                    torch.isfinite(grad), torch.isfinite(grad64)):
                return name, math.inf
    return None, 0.0


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` (parameters and buffers; the model is left as it is)."""
    return copy.deepcopy(model).to(torch.float64)


def instrument_all(model: torch.nn.Module) -> torch.nn.Module:
    """Every node captured, with its gradient."""
    return instrument(model, capture="all", grads=True)
