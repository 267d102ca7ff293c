"""SensitivityReport: what each node costs in a lower precision, sorted by impact.

Every error is relative to the float64 run of the same step (``||x - x64|| / ||x64||``),
and compared with the error the whole model already has in float32 (``x f32``)::

    key    dtype       out    loss    x f32    grad    x f32     range%    cause
    -----  -------  ------  ------  -------  ------  --------  --------  -------
    big    e4m3     9.6e-1  5.1e-2     3e6x  9.8e-1      2e6x       97%    range
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report
from .choice import PrecisionChoice, choose, first_beyond

__all__ = ["SensitivityEntry", "SensitivityReport", "plural", "short_dtype", "short_error", "short_ratio"]

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
RANGE = 0.01
"""A node's cause is ``range`` when more than this fraction of the elements of one tensor it
rounds (an input, a weight, its output gradient) underflow or saturate, else ``resolution``."""


def plural(count: int, noun: str) -> str:
    """``1 node``, ``3 nodes``.

    >>> plural(1, "node"), plural(3, "node")
    ('1 node', '3 nodes')
    """
    return f"{count} {noun}{'' if count == 1 else 's'}"


def short_dtype(dtype: str) -> str:
    """``e4m3`` for ``float8_e4m3fn``, as tables write it.

    >>> short_dtype("bfloat16")
    'bf16'
    """
    return _SHORT.get(dtype, dtype)


def short_error(value: float) -> str:
    """An error in 6 characters or fewer: ``1.2e-7``; ``0`` for exact.

    >>> short_error(1.234e-07), short_error(0.0), short_error(float("inf"))
    ('1.2e-7', '0', 'inf')
    """
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def short_ratio(value: float) -> str:
    """A ratio to float32's error: ``3.2x``, ``41x``, ``4e6x``.

    >>> short_ratio(3.21), short_ratio(41.2), short_ratio(4.2e6)
    ('3.2x', '41x', '4e6x')
    """
    if not math.isfinite(value):
        return str(value)
    if value < 10:
        return f"{value:.1f}x"
    if value < 1000:
        return f"{value:.0f}x"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}x"


def _ratio(error: float, float32: float) -> float:
    if float32 > 0:
        return error / float32
    return math.inf if error > 0 else 1.0


def _percent(fraction: float) -> str:
    return "0" if fraction == 0 else f"{100 * fraction:.2g}%"


@dataclasses.dataclass(frozen=True)
class SensitivityEntry:
    """One node alone in one dtype: its errors (relative to float64), the float32 model's
    errors at the same places, and how the values it rounds fit the dtype's range.

    ``module``: the module the node belongs to, ``module_type`` its class name.
    ``underflow`` / ``overflow``: the worst fraction, over the tensors the node rounds,
    of elements that become zero / saturate (float16: become inf); ``grad_underflow``:
    the same for the gradient at its output; ``amax``: the largest magnitude rounded;
    """

    key: str
    dtype: str
    module: str
    module_type: str
    out_error: float
    loss_error: float
    grad_error: float
    float32_out_error: float
    float32_loss_error: float
    float32_grad_error: float
    underflow: float
    overflow: float
    grad_underflow: float
    amax: float

    @property
    def loss_vs_float32(self) -> float:
        """The loss error over the float32 model's loss error."""
        return _ratio(self.loss_error, self.float32_loss_error)

    @property
    def grad_vs_float32(self) -> float:
        """The parameter gradients' error over the float32 model's."""
        return _ratio(self.grad_error, self.float32_grad_error)

    @property
    def out_vs_float32(self) -> float:
        """The node's own output error over the float32 model's at that node."""
        return _ratio(self.out_error, self.float32_out_error)

    @property
    def impact(self) -> float:
        """What the report sorts by: the larger of the loss and gradient ratios to float32."""
        return max(self.loss_vs_float32, self.grad_vs_float32)

    @property
    def cause(self) -> str:
        """``"range"`` (underflow / overflow carry the error) or ``"resolution"``."""
        return "range" if max(self.underflow, self.overflow, self.grad_underflow) > RANGE \
            else "resolution"

    def as_dict(self) -> dict[str, Any]:
        """The fields and the derived numbers (ratios, impact, cause)."""
        out = dataclasses.asdict(self)
        out.update(loss_vs_float32=self.loss_vs_float32, grad_vs_float32=self.grad_vs_float32,
                   out_vs_float32=self.out_vs_float32, impact=self.impact, cause=self.cause)
        return out


_HEADERS = ["key", "dtype", "out", "loss", "x f32", "grad", "x f32 ", "range%", "cause"]


def _tail(key: str, width: int) -> str:
    """``key`` cut at the front to ``width`` characters (the end names the node)."""
    return key if len(key) <= width else "…" + key[len(key) - width + 1:]


@dataclasses.dataclass(repr=False)
class SensitivityReport(Report):
    """The result of :func:`fxdebug.precision_sensitivity`: ``entries`` sorted by impact,
    the float32 model's and bfloat16 autocast's errors, every candidate converted at once
    (``everything``), and :meth:`choose`."""

    entries: list[SensitivityEntry]
    dtypes: tuple[str, ...]
    keys: tuple[str, ...]
    float32: dict[str, float]
    autocast: dict[str, float]
    everything: dict[str, dict[str, float]]
    seconds: float
    scaling: str
    _measurer: Any = None
    _reference: Any = None
    _candidates: tuple = ()

    def entry(self, key: str, dtype: str) -> SensitivityEntry:
        """The entry of ``key`` in ``dtype``."""
        for found in self.entries:
            if found.key == key and found.dtype == dtype:
                return found
        raise KeyError(f"no entry for {key!r} in {dtype!r}; keys: {', '.join(self.keys[:5])}"
                       f"{'...' if len(self.keys) > 5 else ''}; dtypes: {', '.join(self.dtypes)}")

    def choose(self, budget: float, relative_to: str | None = None, metric: str = "loss",
               dtype: str | None = None) -> PrecisionChoice:
        """The largest set of nodes to run in ``dtype`` within ``budget``, measured.

        ``budget``: the largest error allowed, relative to float64 (``metric``: ``"loss"``
        or ``"grad"``), as a number or, with ``relative_to="autocast"`` / ``"float32"``,
        as a multiple of bfloat16 autocast's / the float32 model's error. ``dtype``: one of
        the report's (default: its last, the lowest precision asked). See
        :mod:`fxdebug.precision.choice`. On a sharded model's report it measures on every
        rank at once: a collective, every rank calls it.
        """
        return choose(self, budget, relative_to, metric, dtype)

    def first_beyond(self, budget: float, relative_to: str | None = None,
                     metric: str = "loss", dtype: str | None = None):
        """Converting every candidate in graph order: the first node at which the
        measured error passes ``budget`` (None if converting all stays within it), with
        its cause. See :func:`fxdebug.precision.choice.first_beyond`. On a sharded model's
        report, a collective like :meth:`choose`."""
        return first_beyond(self, budget, relative_to, metric, dtype)

    def _size(self) -> str:
        return f"{plural(len(self.keys), 'node')} x {plural(len(self.dtypes), 'dtype')}"

    def _finding(self) -> str:
        if not self.entries:
            return ""
        top = self.entries[0]
        return (f"most sensitive {top.key} in {short_dtype(top.dtype)} (loss "
                f"{short_ratio(top.loss_vs_float32)}, grad {short_ratio(top.grad_vs_float32)} "
                f"float32's error)")

    def _fields(self) -> dict[str, Any]:
        return {"dtypes": list(self.dtypes), "keys": list(self.keys), "float32": self.float32,
                "autocast": self.autocast, "everything": self.everything,
                "seconds": self.seconds, "scaling": self.scaling,
                "entries": [entry.as_dict() for entry in self.entries]}

    def table(self, wide: bool | None = None) -> str:
        """Header lines, one row per (node, dtype) by impact, and what the columns mean."""
        runs = len(self.entries) + len(self.dtypes)
        width = None if wide else (table_width() or 80)
        summary = [["float32 model", short_error(self.float32["loss"]),
                    short_error(self.float32["grad"])],
                   ["bf16 autocast", short_error(self.autocast["loss"]),
                    short_error(self.autocast["grad"])]]
        summary += [[f"every node in {short_dtype(d)}", short_error(e["loss"]),
                     short_error(e["grad"])] for d, e in self.everything.items()]
        lines = [f"precision sensitivity: {self._size()} ({self.scaling}), {self.seconds:.1f} s, "
                 f"{self.seconds / max(runs, 1):.2f} s a run", "",
                 fit_table(summary, ["vs float64", "loss err", "grad err"], width=width,
                           colalign=["left", "right", "right"]), ""]
        rows = [[e.key, short_dtype(e.dtype), short_error(e.out_error), short_error(e.loss_error),
                 short_ratio(e.loss_vs_float32), short_error(e.grad_error),
                 short_ratio(e.grad_vs_float32),
                 _percent(max(e.underflow, e.overflow, e.grad_underflow)),
                 "range" if e.cause == "range" else "resol"] for e in self.entries]
        if width is not None and rows:
            others = sum(max(len(h), *(len(r[i]) for r in rows)) + 2
                         for i, h in enumerate(_HEADERS) if i)
            for row in rows:
                row[0] = _tail(row[0], max(width - others, 16))
        lines.append(fit_table(rows, _HEADERS, width=width, truncate=("key",),
                               drop=("out", "cause", "range%"),
                               colalign=["left", "left"] + ["right"] * 7))
        lines += ["", "out, loss, grad: errors of the node's output, the loss and the parameter",
                  "gradients relative to float64; x f32: over the float32 model's error; "
                  "range%:", "the largest fraction of a rounded tensor (input, weight, output "
                  "gradient)", "that underflows to zero or overflows; cause: range when "
                  "that is over 1%,", "else resol(ution)."]
        return "\n".join(lines)
