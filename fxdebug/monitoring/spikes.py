"""When a training step is a spike: the rules ``fxdebug.monitor(spikes=...)`` checks at ``step()``.

A rule watches one *metric* per step and fires when the step's value leaves what the
window before it makes expected::

    NonFinite()                      the loss or the global gradient norm is NaN or Inf
    Factor("loss", 10, window=100)   above 10x the largest |value| of the last 100 steps
                                     (Megatron's check on the loss)
    Sigma("grad_norm", 6, window=128)  above mean + 6 std of the last 128 steps
                                     (OLMo's stability monitor)

The metrics: ``"loss"`` (what ``step(loss)`` is given), ``"grad_norm"`` (the L2 norm of
every parameter's ``.grad`` at ``step()``), or a series name ``"<key>.<kind>.<stat>"``
(``"transformer.h.0.attn.out.absmax"``), known on logged steps only. A window rule waits
for ``min_steps`` values before it fires, and a step that fired does not enter the window
(one spike does not hide the next). ``spikes=True`` is :data:`DEFAULT_RULES`.

>>> rule = Factor("loss", 10, window=4, min_steps=2)
>>> [rule.check(v) for v in (1.0, 2.0, 1.5, 30.0, 1.0)]
[None, None, None, 'loss 30 > 10x the window max 2 (steps seen: 3)', None]
>>> NonFinite().check(float("nan"), "loss")
'loss is nan'
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

from ..errors import FxdebugError
from .statistics import KINDS, STATS, UPDATE_STATS

__all__ = ["Rule", "NonFinite", "Factor", "Sigma", "DEFAULT_RULES", "check_rules"]


def _check_metric(metric: str, rule: str) -> None:
    if metric in ("loss", "grad_norm"):
        return
    parts = metric.rsplit(".", 2) if isinstance(metric, str) else []
    if len(parts) == 3 and parts[1] in KINDS and parts[2] in (
            UPDATE_STATS if parts[1] == "update" else STATS):
        return
    raise FxdebugError(
        f"fxdebug.monitor: {rule}({metric!r}): the metric is 'loss', 'grad_norm' or a series "
        f"name '<key>.<kind>.<stat>' (kinds {', '.join(KINDS)}; stats {', '.join(STATS)}), "
        f"e.g. 'fc1.out.absmax'.")


def _number(value: float) -> str:
    return f"{value:.4g}"


class Rule:
    """A spike rule on one metric (subclasses: :class:`NonFinite`, :class:`Factor`, :class:`Sigma`)."""

    metric: str = ""

    def check(self, value: float) -> str | None:
        """The reason this value is a spike, or None (and the value enters the window)."""
        raise NotImplementedError

    def copy(self) -> "Rule":
        """The same rule with an empty window (one per monitor)."""
        raise NotImplementedError


class NonFinite(Rule):
    """Fires when the loss or the global gradient norm is NaN or Inf (no window)."""

    metric = "nonfinite"

    def check(self, value: float, metric: str = "value") -> str | None:
        return None if math.isfinite(value) else f"{metric} is {_number(value)}"

    def copy(self) -> "NonFinite":
        return NonFinite()

    def __repr__(self) -> str:
        return "NonFinite()"


class _Window(Rule):
    def __init__(self, metric: str, threshold: float, window: int, min_steps: int | None) -> None:
        _check_metric(metric, type(self).__name__)
        if not isinstance(threshold, (int, float)) or not threshold > 0:
            raise FxdebugError(f"fxdebug.monitor: {type(self).__name__}({metric!r}, ...) needs a "
                               f"positive threshold, got {threshold!r}.")
        if not isinstance(window, int) or window < 2:
            raise FxdebugError(f"fxdebug.monitor: {type(self).__name__}(window=) must be an int "
                               f">= 2 (steps), got {window!r}.")
        self.metric, self.threshold, self.window = metric, float(threshold), window
        self.min_steps = min(window, 8) if min_steps is None else min_steps
        self._seen: collections.deque[float] = collections.deque(maxlen=window)

    def check(self, value: float) -> str | None:
        if not math.isfinite(value):
            return None  # NonFinite's finding, not a window's
        reason = self._reason(value) if len(self._seen) >= self.min_steps else None
        if reason is None:
            self._seen.append(value)
        return reason

    def _reason(self, value: float) -> str | None:
        raise NotImplementedError

    def copy(self):
        return type(self)(self.metric, self.threshold, window=self.window,
                          min_steps=self.min_steps)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.metric!r}, {self.threshold:g}, window={self.window}, "
                f"min_steps={self.min_steps})")


class Factor(_Window):
    """Fires when ``|value|`` exceeds ``factor`` times the largest ``|value|`` of the window."""

    def __init__(self, metric: str, factor: float = 10.0, window: int = 100,
                 min_steps: int | None = None) -> None:
        super().__init__(metric, factor, window, min_steps)

    def _reason(self, value: float) -> str | None:
        top = max(abs(v) for v in self._seen)
        if abs(value) > self.threshold * top:
            return (f"{self.metric} {_number(value)} > {self.threshold:g}x the window max "
                    f"{_number(top)} (steps seen: {len(self._seen)})")
        return None


class Sigma(_Window):
    """Fires when the value exceeds the window's mean plus ``k`` standard deviations."""

    def __init__(self, metric: str, k: float = 6.0, window: int = 128,
                 min_steps: int | None = None) -> None:
        super().__init__(metric, k, window, min_steps)

    def _reason(self, value: float) -> str | None:
        seen = list(self._seen)
        mean = math.fsum(seen) / len(seen)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in seen) / max(len(seen) - 1, 1))
        if value > mean + self.threshold * std and value != mean:
            return (f"{self.metric} {_number(value)} > mean + {self.threshold:g} sigma of the "
                    f"window ({_number(mean)} + {self.threshold:g} x {_number(std)}, "
                    f"steps seen: {len(seen)})")
        return None


DEFAULT_RULES: tuple[Rule, ...] = (NonFinite(), Factor("loss", 10.0), Sigma("grad_norm", 6.0))
"""``spikes=True``: a non-finite loss or gradient, Megatron's 10x loss, OLMo's 6 sigma gradient norm."""


def check_rules(spikes) -> list[Rule]:
    """The rules of ``monitor(spikes=...)``: None/False none, True :data:`DEFAULT_RULES`, or
    a Rule or a sequence of them (each copied: a window per monitor).

    >>> check_rules(True)
    [NonFinite(), Factor('loss', 10, window=100, min_steps=8), Sigma('grad_norm', 6, window=128, min_steps=8)]
    """
    if spikes is None or spikes is False:
        return []
    if spikes is True:
        spikes = DEFAULT_RULES
    if isinstance(spikes, Rule):
        spikes = [spikes]
    if not isinstance(spikes, Sequence) or isinstance(spikes, str) or not all(
            isinstance(rule, Rule) for rule in spikes):
        raise FxdebugError(
            f"fxdebug.monitor: spikes= takes True (the default rules), a rule or a list of "
            f"rules from fxdebug.monitoring.spikes (NonFinite(), Factor('loss', 10), "
            f"Sigma('grad_norm', 6)); got {spikes!r}.")
    return [rule.copy() for rule in spikes]
