"""What :func:`~fxdebug.find_nonfinite` reports: the first forward and backward hits, as a table.

>>> hit = BackwardHit("relu", "torch.relu", ("net.py", 3), "4", 2, 4, ())
>>> hit.location
'net.py:3'
"""

from __future__ import annotations

import dataclasses

from ..runtime import Stats
from ..runtime.formatting import format_location
from ..tables.fit_to_width import fit_table, table_width
from ..tables.report import Report

__all__ = ["NonfiniteReport", "ForwardHit", "BackwardHit", "ValueStats"]

@dataclasses.dataclass(frozen=True)
class ValueStats:
    """Statistics of one tensor a node received (an input node's value or a module parameter)."""

    name: str
    shape: str
    dtype: str
    stats: Stats

    @property
    def finite(self) -> bool:
        return self.stats.nonfinite == 0


@dataclasses.dataclass(frozen=True)
class ForwardHit:
    """The first node, in execution order, whose output holds a NaN or an Inf.

    ``inputs`` are the node's inputs as it received them, ``parameters`` the
    parameters and buffers of the module it calls (``call_module`` nodes).
    ``created`` is True when all of them were finite: this node made the
    non-finite values; False when it received them (from a parameter, a
    buffer, or a value no node of the graph produced). ``kind`` is
    ``"input"`` when the hit is an input of forward (the data already held
    NaN/Inf), ``"parameter"``, ``"buffer"`` or ``"attribute"`` for a tensor of
    the model read as it is, else ``"node"``: then no node created them.
    ``position`` is the node's place in the graph's execution order (the same on
    every rank of a sharded model: ranks compare where their values went non-finite).
    """

    key: str
    op: str
    source: tuple[str, int] | None
    shape: str
    dtype: str
    nan: int
    inf: int
    numel: int
    inputs: tuple[ValueStats, ...]
    parameters: tuple[ValueStats, ...]
    kind: str = "node"
    position: int = -1

    @property
    def created(self) -> bool:
        return self.kind == "node" and all(v.finite for v in self.inputs + self.parameters)

    def came_in(self) -> str:
        """What held the values before forward ran (``"input x"``), or ``""`` for a node."""
        return "" if self.kind == "node" else f"{self.kind} {self.key}"

    @property
    def location(self) -> str:
        return format_location(self.source)


@dataclasses.dataclass(frozen=True)
class BackwardHit:
    """The first node, in backward order, whose output's gradient holds a NaN or an Inf.

    ``made_by`` lists the users of that node whose own output gradients were
    finite: the backward of one of them turned the gradient non-finite (for
    ``torch.sqrt(relu(x))`` the hit is the relu and ``made_by`` is the sqrt).
    ``position`` is the gradient's place among the activation gradients in the order
    the backward computed them.
    """

    key: str
    op: str
    source: tuple[str, int] | None
    shape: str
    nonfinite: int
    numel: int
    made_by: tuple[tuple[str, str, str], ...]  # (key, op, location)
    position: int = -1

    @property
    def location(self) -> str:
        return format_location(self.source)


@dataclasses.dataclass(repr=False)
class NonfiniteReport(Report):
    """What :func:`find_nonfinite` found; ``ok`` when every value and gradient is finite."""

    verdict_words = ("all finite", "NON-FINITE")

    forward: ForwardHit | None
    backward: BackwardHit | None
    later_forward: list[str]
    later_backward: list[str]
    parameter_grads: list[tuple[str, int, int]]  # (name, non-finite, numel)
    backward_ran: bool
    model_name: str
    inputs: str
    mode: str
    loss: str
    notes: list[str] = dataclasses.field(default_factory=list)
    creators: list[str] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)  # inputs, parameters... with NaN/Inf
    # under torch.distributed: the ranks whose values this rank's received (watch_ranks.py)
    received_from: str = ""

    @property
    def ok(self) -> bool:
        return self.forward is None and self.backward is None and not self.parameter_grads

    def _size(self) -> str:
        return self.model_name

    def _finding(self) -> str:
        if self.forward is not None and self.forward.came_in():
            return f"{self.forward.came_in()} already holds NaN/Inf (no node created them)"
        if self.forward is not None:
            return f"first non-finite output at {self.forward.key} ({self.forward.location})"
        if self.backward is not None:
            return f"first non-finite gradient at {self.backward.key} ({self.backward.location})"
        if self.parameter_grads:
            return f"non-finite parameter gradient {self.parameter_grads[0][0]}"
        return ""

    def table(self, wide: bool | None = None, floatfmt: str = ".4g") -> str:
        """The first forward and backward hits, what the forward hit received, what followed."""
        verdict = "verdict: all finite" if self.ok else "verdict: NON-FINITE values found"
        return "\n".join(self._lines(wide, floatfmt) + [verdict]
                         + [f"note: {note}" for note in self.notes])

    def _lines(self, wide: bool | None, floatfmt: str) -> list[str]:
        """The table's lines above its verdict."""
        what = f"forward + backward of {self.loss}" if self.backward_ran else "forward only"
        lines = [f"find_nonfinite: {self.model_name}, inputs {self.inputs}, {self.mode} mode, "
                 f"{what}"]
        hit = self.forward
        if hit is None:
            lines.append("forward: every node output is finite")
        elif hit.came_in():
            lines += _came_in_lines(hit)
        else:
            lines.append(f"forward: first non-finite output at {hit.key} ({hit.op}, "
                         f"{hit.location}): {hit.shape} {hit.dtype}, {hit.nan} NaN and {hit.inf} "
                         f"Inf of {hit.numel}")
            if hit.created and self.received_from:  # finite here, NaN after its collective
                lines.append(f"  it RECEIVED them from {self.received_from}: everything this rank "
                             f"fed it was finite, and a collective inside it carried them in")
            else:
                lines.append("  it CREATED them: everything it received was finite" if
                             hit.created else
                             "  it RECEIVED them: a value it read was already non-finite")
        if hit is not None:
            received = [("input", v) for v in hit.inputs] + [("parameter", v)
                                                             for v in hit.parameters]
            if received:
                rows = [[kind, v.name, v.shape, v.dtype,
                         *(format(x, floatfmt) for x in v.stats[:4]), str(v.stats.nonfinite)]
                        for kind, v in received]
                width = table_width(wide)
                body = fit_table(rows, ["", "name", "shape", "dtype", "mean", "std", "min", "max",
                                        "non-finite"], width=None if width is None else width - 2,
                                 drop=("std", "mean"), truncate=("name",),
                                 colalign=("left",) * 4 + ("right",) * 5)
                lines.extend("  " + line for line in body.splitlines())
            lines.append(_later("  later nodes with non-finite outputs", self.later_forward))
            if not self.received_from:
                lines.append(_later("  every node that CREATED non-finite values (all it "
                                    "received was finite)", self.creators))
            if self.sources:
                lines.append(_later("  non-finite before forward ran (inputs, parameters, "
                                    "buffers)", self.sources))
        if self.backward_ran:
            grad = self.backward
            if grad is None:
                lines.append("backward: every activation gradient is finite")
            else:
                lines.append(f"backward: first non-finite gradient (backward order) is that of "
                             f"{grad.key} ({grad.op}, {grad.location}): {grad.shape}, "
                             f"{grad.nonfinite} non-finite of {grad.numel}")
                if grad.made_by:
                    made = ", ".join(f"{key} ({op}, {where})" for key, op, where in grad.made_by)
                    lines.append(f"  made by the backward of: {made} (their output gradients "
                                 f"were finite)")
                lines.append(_later("  later gradients (backward order) non-finite",
                                    self.later_backward))
            if self.parameter_grads:
                lines.append(_later("parameter gradients with non-finite values",
                                    [f"{name} ({count}/{numel})"
                                     for name, count, numel in self.parameter_grads]))
            else:
                lines.append("parameter gradients: all finite")
        return lines



def _came_in_lines(hit: ForwardHit) -> list[str]:
    """A hit on an input, parameter or buffer: the values were non-finite before forward ran."""
    counts = f"{hit.nan} NaN and {hit.inf} Inf of {hit.numel} ({hit.shape} {hit.dtype})"
    if hit.kind == "input":
        return [f"forward: the input {hit.key} of forward already holds non-finite values: "
                f"{counts}",
                f"  no node created them: they came in with the data. Check the batch "
                f"(torch.isfinite({hit.key}).all()) and the code or data loader that made it; "
                f"ignore=[{hit.key!r}] if they are there on purpose"]
    return [f"forward: {hit.kind} {hit.key} of the model already holds non-finite values: "
            f"{counts}",
            "  no node created them: it was non-finite before this forward (an optimizer step, "
            "a checkpoint load, a write into it); fxdebug.watch_nonfinite(model) names the "
            "step that made it so"]


def _later(title: str, keys: list[str]) -> str:
    if not keys:
        return f"{title}: none"
    if len(keys) <= 6:
        return f"{title}: {len(keys)} ({', '.join(keys)})"
    return f"{title}: {len(keys)} ({', '.join(keys[:3])}, ..., {', '.join(keys[-2:])})"
