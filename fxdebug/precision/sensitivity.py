"""precision_sensitivity: each candidate node alone in a lower precision, measured against float64.

::

    precision_sensitivity(model, *inputs, loss=None, dtypes=(...), select=None)
      ├─ a sharded model (FSDP2, tensor parallel): a collective, every rank its own batch
      │    ├─ unsharded_copy(model): full parameters, plain modules  (distributed/)
      │    ├─ eval_outputs, relative_error: the copy computes what the model computes on
      │    │    each rank's batch, or an error (a plan that changed module attributes)
      │    └─ every step's numbers combined over the ranks           (world.py)
      ├─ gm = fxdebug.trace(model, *inputs, frontend="auto"), on a private copy
      ├─ reference: the step in float64 (float64_copy)        steps.py
      ├─ float32: the step as the model is, float8 range statistics of every candidate
      ├─ autocast: the step under torch.autocast(bfloat16)
      ├─ for each candidate node and dtype: fake_precision(gm, [node], dtype), the step,
      │    the node's own output error, the loss and gradient errors     (a progress bar)
      └─ for each dtype: every candidate at once
    -> SensitivityReport (report.py); report.choose(budget) -> PrecisionChoice (choice.py)
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from ..distributed.agreement import attempt
from ..distributed.rank_group import RankGroup
from ..distributed.unsharded_copy import eval_outputs, sharded_reason, unsharded_copy
from ..errors import FxdebugError, renamed_arguments
from ..passes.fake_precision import (FakePrecision, copy_graph_module, fake_output_key,
                                     owning_module, precision_nodes)
from ..runtime.fake_casts import FLOAT8, check_dtype, range_stats
from ..base.progress import progress
from ..tracing.keys import META_KEY, node_key
from .report import SensitivityEntry, SensitivityReport
from .steps import (Step, as_float64, default_loss, float64_copy, relative_error, run_step,
                    step_errors)
from .world import World, global_error, squared_norms

__all__ = ["precision_sensitivity", "Measurer"]


def _seeded() -> contextlib.AbstractContextManager:
    """Every run draws the same random numbers (dropout), and the caller's RNG is left alone
    (the CPU's and, where CUDA is in use, the current device's: manual_seed seeds both)."""
    stack = contextlib.ExitStack()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stack.enter_context(torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda
                                              else []))
    if cuda:
        torch.cuda.manual_seed(0)
    torch.random.default_generator.manual_seed(0)
    return stack


class Measurer:
    """Runs the step with a set of nodes in a lower precision and measures it against float64;
    on a sharded model (``world``) every step is the global one (see :mod:`.world`)."""

    def __init__(self, gm: fx.GraphModule, inputs: tuple, loss: Callable[[Any], torch.Tensor],
                 scaling: str, backward: bool, world: World | None = None) -> None:
        self.gm, self.inputs, self.loss = gm, inputs, loss
        self.scaling, self.backward, self.world = scaling, backward, world
        names = [name for name, p in gm.named_parameters() if p.requires_grad]
        if not names:
            raise FxdebugError("fxdebug.precision_sensitivity: the model has no parameter that "
                               "requires grad, so there are no gradients to measure.")
        self.params = [gm.get_parameter(name) for name in names]
        self.names = names
        self.reference64 = float64_copy(gm)
        self.params64 = [self.reference64.get_parameter(name) for name in names]
        self.inputs64 = as_float64(inputs)
        self.runs = 0

    def _run(self, run: Callable[[], Step], extras: Callable[[Step], list[float]] | None = None,
             count: int = 0) -> tuple[Step, list[float]]:
        """``run()`` seeded, with the numbers ``extras(step)``: this rank's, or on a sharded
        model the global step's (loss and gradients averaged, extras summed over ranks)."""
        def seeded() -> Step:
            with _seeded():
                return run()
        if self.world is None:
            step = seeded()
            return step, (extras(step) if extras is not None else [])
        return self.world.step(seeded, [p.shape for p in self.params], extras, count)

    def reference(self, watch: list[str]) -> Step:
        return self._run(lambda: run_step(self.reference64, self.inputs64, self.loss,
                                          self.params64, watch))[0]

    def float32(self, watch: list[str], grads_of: list[str], context=None) -> Step:
        return self._run(lambda: run_step(self.gm, self.inputs, self.loss, self.params, watch,
                                          grads_of, context=context))[0]

    def converted(self, keys: list[str], dtype: str, watch_key: str | None = None,
                  reference: torch.Tensor | None = None) -> tuple[Step, float]:
        """The step with the nodes ``keys`` in ``dtype``; and the error of ``watch_key``'s
        output after the conversion against ``reference`` (NaN where either is missing)."""
        fake = copy_graph_module(self.gm)
        nodes = {node_key(n): n for n in fake.graph.nodes}
        FakePrecision([nodes[key] for key in keys], dtype, self.scaling, self.backward)(fake)
        name = None
        if watch_key is not None:
            by_key = {n.meta.get(META_KEY): n.name for n in fake.graph.nodes}
            name = by_key.get(fake_output_key(watch_key), by_key.get(watch_key))
        self.runs += 1
        watched = name is not None and reference is not None

        def norms(step: Step) -> list[float]:  # and whether the value is missing
            if name not in step.values or reference is None:
                return [0.0, 0.0, 1.0]
            return squared_norms(step.values[name], reference) + [0.0]
        step, found = self._run(lambda: run_step(fake, self.inputs, self.loss, self.params,
                                                 [name] if name else []),
                                norms if watched else None, 3 if watched else 0)
        error = global_error(found[:1], found[1:2]) if watched and not found[2] else float("nan")
        return step, error

    def errors(self, keys: list[str], dtype: str, reference: Step) -> dict[str, float]:
        """``{"loss": ..., "grad": ...}`` of the step with ``keys`` in ``dtype``."""
        if not keys:
            return step_errors(self._run(lambda: run_step(self.gm, self.inputs, self.loss,
                                                          self.params))[0], reference)
        return step_errors(self.converted(keys, dtype)[0], reference)


def _operand_values(gm: fx.GraphModule, node: fx.Node, dtype: str, scaling: str,
                    values: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    """The tensors the pass rounds for ``node`` (its operands' values from the float32 run,
    its module's parameters) with their row-wise axes."""
    operands, params = FakePrecision(None, dtype, scaling).operands(gm, node)
    found = []
    for index, axis in operands:
        arg = node.args[index] if index < len(node.args) else None
        if isinstance(arg, fx.Node) and arg.name in values:  # get_attr values included
            found.append((values[arg.name], axis))
    for name, axis in params.items():
        found.append((gm.get_submodule(str(node.target)).get_parameter(name), axis))
    return [(t, axis if scaling == "rowwise" and dtype in FLOAT8 else None) for t, axis in found
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _range_counts(gm, node, dtype, scaling, values, grad) -> tuple[list[float], list[float]]:
    """What the node rounds, as numbers to add over ranks: (underflowing, saturating, size)
    of each tensor rounded, then (underflowing, size) of its output gradient; and the
    amaxes (to take the largest of)."""
    counts: list[float] = []
    amaxes: list[float] = []
    for tensor, axis in _operand_values(gm, node, dtype, scaling, values):
        stats, size = range_stats(tensor, dtype, axis), tensor.numel()
        counts += [round(stats["underflow"] * size), round(stats["overflow"] * size), size]
        amaxes.append(stats["amax"])
    grad_dtype, grad_axis = FakePrecision(None, dtype, scaling).grad_precision()
    if grad is not None and grad_dtype is not None:
        counts += [round(range_stats(grad, grad_dtype, grad_axis)["underflow"] * grad.numel()),
                   grad.numel()]
    else:
        counts += [0, 0]
    return counts, amaxes


def _range(counts: list[float], amaxes: list[float]) -> dict[str, float]:
    """Worst underflow / overflow over what the node rounds, its output gradient's
    underflow, and amax, from :func:`_range_counts` (summed over ranks where sharded)."""
    def fraction(count: float, size: float) -> float:
        return count / size if size else 0.0
    tensors = [counts[i:i + 3] for i in range(0, len(counts) - 2, 3)]
    return {"underflow": max((fraction(u, n) for u, _, n in tensors), default=0.0),
            "overflow": max((fraction(o, n) for _, o, n in tensors), default=0.0),
            "grad_underflow": fraction(counts[-2], counts[-1]),
            "amax": max(amaxes, default=0.0)}


def _agreed(world: World | None, work: Callable[[], Any]) -> Any:
    """``work()``; on a sharded model, an error on any rank raised on every rank."""
    if world is None:
        return work()
    value, error = attempt(work)
    world.agree(error)
    return value


def _checked(dtypes, inputs: tuple) -> list[str]:
    names = [check_dtype(d, "fxdebug.precision_sensitivity") for d in
             ([dtypes] if isinstance(dtypes, str) else dtypes)]
    if not names:
        raise FxdebugError("fxdebug.precision_sensitivity: dtypes=() names no precision to try; "
                           "pass e.g. dtypes=('bfloat16', 'float8_e4m3fn').")
    if not inputs:
        raise FxdebugError("fxdebug.precision_sensitivity(model, *inputs): no inputs given; pass "
                           "one batch as the model takes it.")
    return names


def _traced(model: torch.nn.Module, inputs: tuple) -> fx.GraphModule:
    """A private copy of the model's graph (train-mode buffers of the user's model stay)."""
    from ..frontend import trace

    if isinstance(model, fx.GraphModule):
        traced: torch.nn.Module = model
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fx failed, export was used" is not news here
            traced = trace(model, *inputs, frontend="auto")
    if not isinstance(traced, fx.GraphModule):
        raise FxdebugError(f"fxdebug.precision_sensitivity: {type(model).__name__} could not be "
                           f"traced into one graph (by torch.fx nor torch.export), so its nodes "
                           f"cannot be converted one by one; see fxdebug.trace(model, *inputs, "
                           f"frontend='export') for why.")
    return copy.deepcopy(traced)


@renamed_arguments({"backward": "grads"})
def precision_sensitivity(model: torch.nn.Module, *inputs: Any, loss: Callable | None = None,
                          dtypes=("bfloat16", "float8_e4m3fn"), select=None,
                          scaling: str = "tensorwise", grads: bool = True
                          ) -> SensitivityReport:
    """Each candidate node alone in each of ``dtypes``, against a float64 run of the same step.

    Args:
        model: the module (traced with ``fxdebug.trace(model, *inputs, frontend="auto")``)
            or a GraphModule from :func:`fxdebug.trace`; it is not changed (the analysis
            runs on copies, and no ``.grad`` is written). A sharded model (FSDP2
            ``fully_shard``, DTensor parameters from ``parallelize_module``) makes this a
            collective: every rank calls it at once, each with the batch it trains on; the
            analysis runs on an unsharded copy, the errors are those of the global step
            (the mean loss over ranks, full values), and every rank gets the same report,
            whose ``choose()`` and ``first_beyond()`` are collectives too. An error on one
            rank is raised on every rank, naming it.
        inputs: one batch, as the model takes it (on a sharded model, this rank's batch).
        loss: ``output -> scalar``; default: the output's ``loss`` where it has one, else
            the sum of its floating tensors.
        dtypes: names from ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``,
            ``"float8_e5m2"``.
        select: keys, globs or module classes (see :mod:`fxdebug.passes.fake_precision`);
            ``None``: every matrix product (Linear, convolution, matmul).
        scaling / grads: as :func:`fxdebug.fake_precision`.

    Returns a :class:`SensitivityReport` sorted by impact; ``report.choose(budget)`` finds
    the largest set within a budget.

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> rep = fxdebug.precision_sensitivity(net, torch.randn(4, 8))
    >>> sorted({(e.key, e.dtype) for e in rep.entries})[:2]
    [('0', 'bfloat16'), ('0', 'float8_e4m3fn')]
    >>> all(e.loss_error >= 0 and e.grad_error >= 0 for e in rep.entries)
    True
    """
    started = time.perf_counter()
    sharded = sharded_reason(model)
    world = World(RankGroup.of(None, what="fxdebug.precision_sensitivity on a sharded model",
                               where=sharded)) if sharded else None
    names = _agreed(world, lambda: _checked(dtypes, inputs))
    if world is not None:
        sharded_model, model = model, unsharded_copy(model, world.group.group)
        _check_copy(world, sharded_model, model, inputs)
    loss_fn = loss if loss is not None else default_loss

    def setup() -> tuple[fx.GraphModule, Measurer, list[fx.Node]]:
        gm = _traced(model, inputs)
        return gm, Measurer(gm, inputs, loss_fn, scaling, grads, world), \
            precision_nodes(gm, select)
    gm, measurer, candidates = _agreed(world, setup)
    keys = [node_key(n) for n in candidates]
    watch = [n.name for n in candidates] + sorted({a.name for n in candidates for a in n.args
                                                   if isinstance(a, fx.Node)})
    reference = measurer.reference([n.name for n in candidates])
    float32 = measurer.float32(watch, [n.name for n in candidates])
    base = step_errors(float32, reference)
    device = measurer.params[0].device.type
    autocast = measurer.float32([], [], context=lambda: torch.autocast(device, torch.bfloat16))
    out32 = _float32_out_errors(candidates, float32, reference, world)
    jobs = [(node, dtype) for dtype in names for node in candidates]
    ranges = _ranges(gm, jobs, scaling, float32, world)
    entries: list[SensitivityEntry] = []
    for (node, dtype), found in zip(progress(jobs, "precision sensitivity", unit="node"), ranges):
        key = node_key(node)
        step, out_error = measurer.converted([key], dtype, key, reference.values.get(node.name))
        errors = step_errors(step, reference)
        entries.append(SensitivityEntry(
            key=key, dtype=dtype, module=owning_module(gm, node),
            module_type=type(gm.get_submodule(owning_module(gm, node))).__name__,
            out_error=out_error,
            loss_error=errors["loss"], grad_error=errors["grad"], float32_out_error=out32[key],
            float32_loss_error=base["loss"], float32_grad_error=base["grad"], **found))
    everything = {dtype: measurer.errors(keys, dtype, reference) for dtype in names}
    seconds = time.perf_counter() - started
    if world is not None:  # the slowest rank's: every rank's report is the same
        seconds = world.max([seconds])[0]
    return SensitivityReport(
        entries=sorted(entries, key=lambda e: (-e.impact, keys.index(e.key), e.dtype)),
        dtypes=tuple(names), keys=tuple(keys), float32=base,
        autocast=step_errors(autocast, reference), everything=everything,
        seconds=seconds, scaling=scaling,
        _measurer=measurer, _reference=reference, _candidates=tuple(candidates))


def _check_copy(world: World, sharded: torch.nn.Module, copy: torch.nn.Module,
                inputs: tuple) -> None:
    """Raise on every rank unless the unsharded copy's output is the sharded model's (to
    1e-3 in float32 and float64, 5e-2 in 16 bits: collectives sum in another order) on every
    rank's batch."""
    copied = _agreed(world, lambda: eval_outputs(copy, inputs))  # local: a bad batch fails here
    wanted = eval_outputs(sharded, inputs)
    same_layout = len(copied) == len(wanted) and all(
        a.shape == b.shape for a, b in zip(copied, wanted))
    floating = [(a, b) for a, b in zip(copied, wanted) if b.is_floating_point()]
    difference = relative_error([a for a, _ in floating], [b for _, b in floating]) \
        if same_layout else float("inf")
    group = world.group
    per_rank = group.gather(difference)
    dtype = next((p.dtype for p in copy.parameters() if p.is_floating_point()), torch.float32)
    tolerance = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    worst = max(range(len(per_rank)), key=lambda i: (per_rank[i] != per_rank[i], per_rank[i]))
    if not per_rank[worst] <= tolerance:
        raise FxdebugError(
            f"fxdebug.precision_sensitivity: the unsharded copy of {type(sharded).__name__} "
            f"does not compute what the sharded model computes: on rank "
            f"{group.members[worst]}'s batch their outputs differ by {per_rank[worst]:.3g} "
            f"(relative; allowed {tolerance:g}). A sharding plan that also changes module "
            f"attributes (a per-rank head count, a hidden size) makes the full-weight copy "
            f"another function, and its errors would be another model's. Run the what-if on "
            f"the unsharded model instead: build it unsharded on one rank and load the full "
            f"state dict (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True))).")


def _float32_out_errors(candidates: list[fx.Node], float32: Step, reference: Step,
                        world: World | None) -> dict[str, float]:
    """Each candidate's output error in the float32 model (over every rank's values)."""
    found = [n for n in candidates if n.name in float32.values and n.name in reference.values]
    norms = [x for n in found for x in squared_norms(float32.values[n.name],
                                                     reference.values[n.name])]
    if world is not None:
        norms = world.sum(norms)
    errors = {node_key(n): global_error(norms[2 * i:2 * i + 1], norms[2 * i + 1:2 * i + 2])
              for i, n in enumerate(found)}
    return {node_key(n): errors.get(node_key(n), float("nan")) for n in candidates}


def _ranges(gm: fx.GraphModule, jobs: list, scaling: str, float32: Step,
            world: World | None) -> list[dict[str, float]]:
    """Each job's range numbers (:func:`_range`), from every rank's values where sharded."""
    parts = [_range_counts(gm, node, dtype, scaling, float32.values,
                           float32.value_grads.get(node.name)) for node, dtype in jobs]
    counts = [x for c, _ in parts for x in c]
    amaxes = [x for _, a in parts for x in a]
    if world is not None:
        counts, amaxes = world.sum(counts), world.max(amaxes)
    found, at, top = [], 0, 0
    for c, a in parts:
        found.append(_range(counts[at:at + len(c)], amaxes[top:top + len(a)]))
        at, top = at + len(c), top + len(a)
    return found
