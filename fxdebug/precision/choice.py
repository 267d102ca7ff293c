"""The largest set of nodes within a budget, measured; and where converting everything breaks.

``report.choose(budget)``::

    1. the nodes whose error alone is within the budget, lowest measured error first
    2. measure all of them converted at once; over the budget: bisect the length of that
       list, measuring each tried set, down to the longest one measured within the budget
    3. the set, its measured error, and what a trainer takes: a module_filter_fn for
       torchao.float8.convert_to_float8_training, an autocast recipe (bfloat16 / float16)

``report.first_beyond(budget)``: every candidate converted in graph order, the first
node at which the error passes the budget (the graph-order prefixes measured one by one, up
to the first over it: the earliest, whether or not the error grows steadily), and whether
range (underflow, overflow) or resolution causes it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable

import torch

from ..errors import FxdebugError
from ..base.progress import progress
from ..runtime.fake_casts import FLOAT8
from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report

__all__ = ["PrecisionChoice", "Breakpoint", "ModuleFilter", "choose", "first_beyond",
           "resolve_budget"]

_METRICS = ("loss", "grad")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclasses.dataclass(frozen=True)
class Breakpoint:
    """The first node at which converting nodes in graph order passes the budget."""

    key: str
    dtype: str
    module: str
    before: float  # the measured error with the nodes before it converted
    at: float  # ... and with it converted too
    budget: float
    metric: str
    cause: str
    underflow: float
    overflow: float
    grad_underflow: float
    amax: float

    def text(self) -> str:
        """One line: where, by how much, and why."""
        why = (f"range: {100 * self.underflow:.2g}% of its inputs underflow, "
               f"{100 * self.overflow:.2g}% saturate, {100 * self.grad_underflow:.2g}% of its "
               f"output gradient underflows (amax {self.amax:.3g})") if self.cause == "range" \
            else "resolution: its values fit the range; the mantissa is too short"
        return (f"first node beyond the budget: {self.key} ({self.dtype}): {self.metric} "
                f"error {self.before:.3g} -> {self.at:.3g} > {self.budget:.3g}; {why}")


class ModuleFilter:
    """``(module, fqn) -> bool`` for ``torchao.float8.convert_to_float8_training``: True for the
    Linear modules chosen.

    >>> keep = ModuleFilter(["fc1"])
    >>> keep(torch.nn.Linear(16, 16), "fc1"), keep(torch.nn.Linear(16, 16), "fc2")
    (True, False)
    """

    def __init__(self, modules) -> None:
        self.modules = tuple(modules)

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        return fqn in self.modules and isinstance(module, torch.nn.Linear)

    def __repr__(self) -> str:
        return f"ModuleFilter({list(self.modules)!r})"


def resolve_budget(report, budget: float, relative_to: str | None, metric: str) -> float:
    """The budget as an error relative to float64."""
    if metric not in _METRICS:
        raise FxdebugError(f"metric={metric!r}: use 'loss' (the loss's relative error) or 'grad' "
                           f"(the parameter gradients' relative error).")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0:
        raise FxdebugError(f"budget={budget!r}: give a positive number, e.g. budget=1e-2, or "
                           f"budget=2, relative_to='autocast' (twice bf16 autocast's error).")
    if relative_to is None:
        return float(budget)
    if relative_to == "autocast":
        return float(budget) * report.autocast[metric]
    if relative_to == "float32":
        return float(budget) * report.float32[metric]
    raise FxdebugError(f"relative_to={relative_to!r}: use None (budget is an error relative to "
                       f"float64), 'autocast' or 'float32' (a multiple of their error).")


def _dtype(report, dtype: str | None) -> str:
    if dtype is None:
        return report.dtypes[-1]
    name = str(dtype).removeprefix("torch.")
    if name not in report.dtypes:
        raise FxdebugError(f"dtype={dtype!r} was not measured; the report has "
                           f"{', '.join(report.dtypes)} (precision_sensitivity(dtypes=...)).")
    return name


class _Trials:
    """Measured sets, each measured once."""

    def __init__(self, report, dtype: str) -> None:
        self.report, self.dtype = report, dtype
        self.done: dict[tuple[str, ...], dict[str, float]] = {}

    def __call__(self, keys: list[str]) -> dict[str, float]:
        key = tuple(keys)
        if key not in self.done:
            if not keys:
                self.done[key] = dict(self.report.float32)
            else:
                self.done[key] = self.report._measurer.errors(keys, self.dtype,
                                                              self.report._reference)
        return self.done[key]


def _longest_within(keys: list[str], within: Callable[[list[str]], bool]) -> int:
    """The largest ``k`` found by bisection with ``within(keys[:k])``, given ``within([])``."""
    if within(keys):
        return len(keys)
    low, high = 0, len(keys)  # within(keys[:low]), not within(keys[:high])
    while high - low > 1:
        middle = (low + high) // 2
        if within(keys[:middle]):
            low = middle
        else:
            high = middle
    return low


def first_beyond(report, budget: float, relative_to: str | None = None, metric: str = "loss",
                 dtype: str | None = None, trials: _Trials | None = None) -> Breakpoint | None:
    """Every candidate converted, in graph order: the first node past the budget, or None."""
    dtype = _dtype(report, dtype)
    limit = resolve_budget(report, budget, relative_to, metric)
    measure = trials or _Trials(report, dtype)
    if report.float32[metric] > limit:
        raise FxdebugError(f"the budget {limit:.3g} is below the float32 model's own {metric} "
                           f"error ({report.float32[metric]:.3g} vs float64): no node can be "
                           f"converted; raise the budget.")
    keys = list(report.keys)
    if measure(keys)[metric] <= limit:
        return None
    low = next((k - 1 for k in progress(range(1, len(keys) + 1), "first node beyond the budget",
                                        total=len(keys), unit="set")
                if measure(keys[:k])[metric] > limit), len(keys) - 1)
    key = keys[low]
    entry = report.entry(key, dtype)
    return Breakpoint(key, dtype, entry.module, measure(keys[:low])[metric],
                      measure(keys[:low + 1])[metric], limit, metric, entry.cause,
                      entry.underflow, entry.overflow, entry.grad_underflow, entry.amax)


@dataclasses.dataclass(repr=False)
class PrecisionChoice(Report):
    """The nodes to run in ``dtype``, the error measured with all of them converted
    (``measured``: ``{"loss": ..., "grad": ...}`` relative to float64), and the recipe.

    ``modules``: the modules every candidate node of which is chosen (``linear_modules``:
    those that are ``torch.nn.Linear``); ``kept``: the modules left in high precision;
    ``trials``: (set size, measured error) of every set measured; ``first_beyond``: see
    :func:`first_beyond`."""

    dtype: str
    metric: str
    budget: float
    keys: tuple[str, ...]
    modules: tuple[str, ...]
    linear_modules: tuple[str, ...]
    kept: tuple[str, ...]
    measured: dict[str, float]
    trials: list[tuple[int, float]]
    first_beyond: Breakpoint | None
    float32: dict[str, float]

    @property
    def ok(self) -> bool:
        """Whether the measured error of the chosen set is within the budget."""
        return self.measured[self.metric] <= self.budget

    @property
    def module_filter_fn(self) -> ModuleFilter:
        """For ``torchao.float8.convert_to_float8_training(model, module_filter_fn=...)``:
        True for the chosen ``torch.nn.Linear`` modules, the only ones torchao converts
        (it then skips its own size check)."""
        return ModuleFilter(self.linear_modules)

    def autocast_recipe(self, device: str = "cuda") -> str:
        """Python to paste into a training script: ``torch.autocast`` in this dtype, with
        the modules not chosen kept in float32 (their inputs cast back to float32)."""
        if self.dtype in FLOAT8:
            raise FxdebugError(f"autocast_recipe(): the choice is for {self.dtype}, which "
                               f"autocast does not run; use choice.module_filter_fn with "
                               f"torchao, or report.choose(..., dtype='bfloat16').")
        return "\n".join([
            "import torch",
            f"KEEP_FLOAT32 = {list(self.kept)!r}",
            "",
            "def float32_forward(forward):",
            "    def run(*args, **kwargs):",
            f"        with torch.autocast({device!r}, enabled=False):",
            "            args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a",
            "                    for a in args]",
            "            return forward(*args, **kwargs)",
            "    return run",
            "",
            "for name in KEEP_FLOAT32:",
            "    module = model.get_submodule(name)",
            "    module.forward = float32_forward(module.forward)",
            f"with torch.autocast({device!r}, dtype=torch.{self.dtype}):",
            "    loss = loss_fn(model(*inputs))"])

    def _size(self) -> str:
        return f"{_plural(len(self.keys), 'node')} in {self.dtype}"

    def _finding(self) -> str:
        return (f"measured {self.metric} error {self.measured[self.metric]:.3g}, budget "
                f"{self.budget:.3g}")

    def _fields(self) -> dict[str, Any]:
        out = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        out["first_beyond"] = None if self.first_beyond is None else \
            dataclasses.asdict(self.first_beyond)
        out["module_filter_fn"] = list(self.linear_modules)
        return out

    def table(self, wide: bool | None = None) -> str:
        """The measured errors, the chosen keys, and where converting everything breaks."""
        width = None if wide else (table_width() or 80)
        rows = [["float32 model", f"{self.float32['loss']:.3g}", f"{self.float32['grad']:.3g}"],
                [self._size(), f"{self.measured['loss']:.3g}",
                 f"{self.measured['grad']:.3g}"]]
        wrap = width or 80
        lines = [f"{self._size()}, {self.metric} budget "
                 f"{self.budget:.3g}: {'within' if self.ok else 'NOT within'} (measured, "
                 f"{len(self.trials)} sets tried)", "",
                 fit_table(rows, ["vs float64", "loss err", "grad err"], width=width,
                           colalign=["left", "right", "right"]), "",
                 textwrap.fill("converted: " + (", ".join(self.keys) or "(none)"), wrap,
                               subsequent_indent="  ", break_on_hyphens=False),
                 textwrap.fill("kept modules: " + (", ".join(self.kept) or "(none)"), wrap,
                               subsequent_indent="  ", break_on_hyphens=False)]
        if self.first_beyond is not None:
            lines.append(textwrap.fill(self.first_beyond.text(), wrap, subsequent_indent="  ",
                                       break_on_hyphens=False))
        return "\n".join(lines)


def choose(report, budget: float, relative_to: str | None = None, metric: str = "loss",
           dtype: str | None = None) -> PrecisionChoice:
    """See the module doc; ``report.choose`` calls this."""
    dtype = _dtype(report, dtype)
    limit = resolve_budget(report, budget, relative_to, metric)
    measure = _Trials(report, dtype)
    alone = {e.key: (e.loss_error if metric == "loss" else e.grad_error)
             for e in report.entries if e.dtype == dtype}
    order = sorted((key for key in report.keys if alone[key] <= limit),
                   key=lambda key: (alone[key], report.keys.index(key)))
    if report.float32[metric] > limit:
        count = 0
    else:
        count = _longest_within(order, lambda ks: measure(ks)[metric] <= limit)
    chosen = sorted(order[:count], key=report.keys.index)
    measured = measure(order[:count])
    breaks = None if report.float32[metric] > limit else \
        first_beyond(report, budget, relative_to, metric, dtype, _Trials(report, dtype))
    owners = {node_key: report.entry(node_key, dtype).module for node_key in report.keys}
    modules = tuple(dict.fromkeys(owners[k] for k in chosen if all(
        other in chosen for other in report.keys if owners[other] == owners[k]) and owners[k]))
    kept = tuple(dict.fromkeys(owners[k] for k in report.keys if k not in chosen and owners[k]))
    linear = tuple(m for m in modules if any(e.module == m and e.module_type == "Linear"
                                             for e in report.entries))
    trials = [(len(keys), errors[metric]) for keys, errors in measure.done.items()]
    return PrecisionChoice(dtype, metric, limit, tuple(chosen), modules, linear, kept,
                           dict(measured),
                           trials, breaks, dict(report.float32))
