"""precision_sensitivity: each candidate node alone in a lower precision, measured against float64.

::

    precision_sensitivity(model, *inputs, loss=None, dtypes=(...), select=None)
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

from ..errors import FxdebugError, renamed_arguments
from ..passes.fake_precision import (FakePrecision, copy_graph_module, fake_output_key,
                                     owning_module, precision_nodes, refuse_sharded)
from ..runtime.fake_casts import FLOAT8, check_dtype, range_stats
from ..base.progress import progress
from ..tracing.keys import META_KEY, node_key
from .report import SensitivityEntry, SensitivityReport
from .steps import (Step, as_float64, default_loss, float64_copy, relative_error, run_step,
                    step_errors)

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
    """Runs the step with a set of nodes in a lower precision and measures it against float64."""

    def __init__(self, gm: fx.GraphModule, inputs: tuple, loss: Callable[[Any], torch.Tensor],
                 scaling: str, backward: bool) -> None:
        self.gm, self.inputs, self.loss = gm, inputs, loss
        self.scaling, self.backward = scaling, backward
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

    def reference(self, watch: list[str]) -> Step:
        with _seeded():
            return run_step(self.reference64, self.inputs64, self.loss, self.params64, watch)

    def float32(self, watch: list[str], grads_of: list[str], context=None) -> Step:
        with _seeded():
            return run_step(self.gm, self.inputs, self.loss, self.params, watch, grads_of,
                            context=context)

    def converted(self, keys: list[str], dtype: str, watch_key: str | None = None
                  ) -> tuple[Step, str | None]:
        """The step with the nodes ``keys`` in ``dtype``; and the graph name of the node
        whose value is ``watch_key``'s output after the conversion."""
        fake = copy_graph_module(self.gm)
        nodes = {node_key(n): n for n in fake.graph.nodes}
        FakePrecision([nodes[key] for key in keys], dtype, self.scaling, self.backward)(fake)
        name = None
        if watch_key is not None:
            by_key = {n.meta.get(META_KEY): n.name for n in fake.graph.nodes}
            name = by_key.get(fake_output_key(watch_key), by_key.get(watch_key))
        self.runs += 1
        with _seeded():
            step = run_step(fake, self.inputs, self.loss, self.params, [name] if name else [])
        return step, name

    def errors(self, keys: list[str], dtype: str, reference: Step) -> dict[str, float]:
        """``{"loss": ..., "grad": ...}`` of the step with ``keys`` in ``dtype``."""
        if not keys:
            with _seeded():
                return step_errors(run_step(self.gm, self.inputs, self.loss, self.params),
                                   reference)
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


def _range(gm, node, dtype, scaling, values, grad) -> dict[str, float]:
    """Worst underflow / overflow over what the node rounds, its output gradient's
    underflow, and amax."""
    tensors = _operand_values(gm, node, dtype, scaling, values)
    stats = [range_stats(t, dtype, axis) for t, axis in tensors]
    grad_stats = None
    if grad is not None:
        grad_dtype, grad_axis = FakePrecision(None, dtype, scaling).grad_precision()
        if grad_dtype is not None:
            grad_stats = range_stats(grad, grad_dtype, grad_axis)
    return {"underflow": max((s["underflow"] for s in stats), default=0.0),
            "overflow": max((s["overflow"] for s in stats), default=0.0),
            "grad_underflow": grad_stats["underflow"] if grad_stats else 0.0,
            "amax": max((s["amax"] for s in stats), default=0.0)}


@renamed_arguments({"backward": "grads"})
def precision_sensitivity(model: torch.nn.Module, *inputs: Any, loss: Callable | None = None,
                          dtypes=("bfloat16", "float8_e4m3fn"), select=None,
                          scaling: str = "tensorwise", grads: bool = True
                          ) -> SensitivityReport:
    """Each candidate node alone in each of ``dtypes``, against a float64 run of the same step.

    Args:
        model: the module (traced with ``fxdebug.trace(model, *inputs, frontend="auto")``)
            or a GraphModule from :func:`fxdebug.trace`; it is not changed (the analysis
            runs on copies, and no ``.grad`` is written).
        inputs: one batch, as the model takes it.
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
    from ..frontend import trace

    started = time.perf_counter()
    names = [check_dtype(d, "fxdebug.precision_sensitivity") for d in
             ([dtypes] if isinstance(dtypes, str) else dtypes)]
    if not names:
        raise FxdebugError("fxdebug.precision_sensitivity: dtypes=() names no precision to try; "
                           "pass e.g. dtypes=('bfloat16', 'float8_e4m3fn').")
    if not inputs:
        raise FxdebugError("fxdebug.precision_sensitivity(model, *inputs): no inputs given; pass "
                           "one batch as the model takes it.")
    refuse_sharded(model, "fxdebug.precision_sensitivity")
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
    gm = copy.deepcopy(traced)  # a private copy: train-mode buffers of the user's model stay
    loss_fn = loss if loss is not None else default_loss
    measurer = Measurer(gm, inputs, loss_fn, scaling, grads)
    candidates = precision_nodes(gm, select)
    keys = [node_key(n) for n in candidates]
    watch = [n.name for n in candidates] + sorted({a.name for n in candidates for a in n.args
                                                   if isinstance(a, fx.Node)})
    reference = measurer.reference([n.name for n in candidates])
    float32 = measurer.float32(watch, [n.name for n in candidates])
    base = step_errors(float32, reference)
    device = measurer.params[0].device.type
    autocast = measurer.float32([], [], context=lambda: torch.autocast(device, torch.bfloat16))
    entries: list[SensitivityEntry] = []
    jobs = [(node, dtype) for dtype in names for node in candidates]
    for node, dtype in progress(jobs, "precision sensitivity", unit="node"):
        key = node_key(node)
        step, name = measurer.converted([key], dtype, key)
        ref_value = reference.values.get(node.name)
        out_error = relative_error(step.values[name], ref_value) \
            if name in step.values and ref_value is not None else float("nan")
        out32 = relative_error(float32.values[node.name], ref_value) \
            if node.name in float32.values and ref_value is not None else float("nan")
        errors = step_errors(step, reference)
        entries.append(SensitivityEntry(
            key=key, dtype=dtype, module=owning_module(gm, node),
            module_type=type(gm.get_submodule(owning_module(gm, node))).__name__,
            out_error=out_error,
            loss_error=errors["loss"], grad_error=errors["grad"], float32_out_error=out32,
            float32_loss_error=base["loss"], float32_grad_error=base["grad"],
            **_range(gm, node, dtype, scaling, float32.values, float32.value_grads.get(node.name))))
    everything = {dtype: measurer.errors(keys, dtype, reference) for dtype in names}
    return SensitivityReport(
        entries=sorted(entries, key=lambda e: (-e.impact, keys.index(e.key), e.dtype)),
        dtypes=tuple(names), keys=tuple(keys), float32=base,
        autocast=step_errors(autocast, reference), everything=everything,
        seconds=time.perf_counter() - started, scaling=scaling,
        _measurer=measurer, _reference=reference, _candidates=tuple(candidates))
