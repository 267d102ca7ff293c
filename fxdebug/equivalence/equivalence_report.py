"""What :func:`~fxdebug.equivalence.equivalence.check_equivalence` returns: the report and its tables.

    EquivalenceReport          verdict, output and gradient comparisons, localized nodes
      ├─ NodeComparison        one matched node: errors, and how it was matched
      └─ table()               verdict, output table, first divergence, node table (fitted)
"""

from __future__ import annotations

import dataclasses

from ..reporting.html import equivalence_html
from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report
from ..base.formatting import format_error, format_location
from .compare import Comparison

__all__ = ["EquivalenceReport", "NodeComparison"]

_HOW = {"key": "key", "inputs": "same inputs", "position": "same place"}


@dataclasses.dataclass(frozen=True)
class NodeComparison:
    """The value of one reference node compared with the candidate's value for it.

    ``key``, ``op``, ``target`` and ``source`` describe the reference node
    (``source`` is the user's ``(file, line)``; ``location`` renders it);
    ``candidate_key`` / ``candidate_op`` the candidate node compared with it.
    ``match`` says why they were paired: ``"key"``, ``"inputs"`` (same
    inputs), ``"position"`` (read in the same argument slot by matched users),
    or ``"in its place"``: the candidate's node ``via`` reads
    ``candidate_key`` where the reference's reads ``key`` (a node a pass
    inserted in between, or what replaced a removed node). ``arguments``,
    where the pass changed the node's arguments, says how (``"(fc2, fc1) ->
    (fc2, fc1_relu)"``: the candidate's node reads, in some argument slot, the
    counterpart of another reference node than the reference's node reads
    there); the change, not the nodes it reads, is then what makes its value
    differ. ``detail`` says what differs besides the numbers.
    """

    key: str
    op: str
    target: str
    source: tuple[str, int] | None
    candidate_key: str
    candidate_op: str
    match: str
    ok: bool
    max_abs: float
    max_rel: float
    shape: str
    dtype: str
    detail: str = ""
    via: str = ""
    arguments: str = ""

    @property
    def location(self) -> str:
        """The user's ``file:line`` of the reference node (``?`` when unknown)."""
        return format_location(self.source)

    def describe(self) -> str:
        """One line naming the node, its op, its source line and its error."""
        text = f"{self.key} ({self.op}, {self.location}): "
        if self.arguments:
            text += f"its arguments changed {self.arguments}; "
        text += f"max abs {format_error(self.max_abs)}, max rel {format_error(self.max_rel)}"
        if self.match == "in its place":
            text += (f"; in the candidate, {self.via!r} reads {self.candidate_key!r} "
                     f"({self.candidate_op}) in its place")
        elif self.match != "key" or self.candidate_key != self.key:
            text += (f"; candidate node {self.candidate_key!r} ({self.candidate_op}, matched by "
                     f"{_HOW[self.match]})")
        elif self.candidate_op != self.op:
            text += f"; the candidate computes it with {self.candidate_op}"
        return text + (f"; {self.detail}" if self.detail else "")

    def candidate_text(self) -> str:
        """The candidate column of the node table."""
        if self.match == "in its place":
            return f"{self.candidate_key} (read by {self.via})"
        if self.match != "key" or self.candidate_key != self.key:
            text = f"{self.candidate_key} ({_HOW[self.match]})"
        else:
            text = "=" if self.candidate_op == self.op else f"= ({self.candidate_op})"
        if not self.arguments:
            return text
        return "= (arguments changed)" if text == "=" else f"{text}, arguments changed"


@dataclasses.dataclass(repr=False)
class EquivalenceReport(Report):
    """What :func:`check_equivalence` found.

    Attributes:
        ok: outputs (and, with ``grads=True``, parameter gradients) agree
            within tolerance.
        outputs: one :class:`~fxdebug.equivalence.compare.Comparison` per output tensor,
            number or structure mismatch (``path`` like ``out/1/logits``).
        grads: the same for parameter gradients (``grad/<name>``).
        nodes: every node value compared while localizing, in the
            reference's execution order (empty when the outputs agree,
            unless ``localize=True``).
        first_divergence: the first of ``nodes`` out of tolerance, or None.
        grad_nodes: with ``grads=True``, when the outputs agree but gradients
            do not: every activation gradient compared, in backward order.
        first_grad_divergence: the first of ``grad_nodes`` out of tolerance.
        unmatched_reference / unmatched_candidate: node keys with no
            counterpart on the other side.
        mode: ``"eval"`` or ``"train"``; notes: anything else worth knowing.
    """

    ok: bool
    outputs: list[Comparison]
    grads: list[Comparison]
    nodes: list[NodeComparison]
    unmatched_reference: list[str]
    unmatched_candidate: list[str]
    mode: str
    rtol: float | None
    atol: float | None
    reference_name: str
    candidate_name: str
    inputs: str
    localized: bool
    notes: list[str] = dataclasses.field(default_factory=list)
    grad_nodes: list[NodeComparison] = dataclasses.field(default_factory=list)

    @property
    def divergences(self) -> list[NodeComparison]:
        """Compared nodes out of tolerance, in the reference's execution order.

        Empty when the outputs agree: a node beyond tolerance whose difference
        does not reach the outputs (the rounding of a reordered computation,
        such as weights a pass folded together) is in :attr:`beyond_tolerance`.
        """
        return [] if self._outputs_agree() else [node for node in self.nodes if not node.ok]

    @property
    def beyond_tolerance(self) -> list[NodeComparison]:
        """Nodes out of tolerance although the outputs agree (not divergences of the model)."""
        return [node for node in self.nodes if not node.ok] if self._outputs_agree() else []

    @property
    def first_divergence(self) -> NodeComparison | None:
        """The first node (reference execution order) whose value differs, or None.

        None whenever the outputs agree: a report never names a divergence of
        a model it calls equivalent.
        """
        return next(iter(self.divergences), None)

    @property
    def first_grad_divergence(self) -> NodeComparison | None:
        """The first node, in backward order, whose output gradient differs, or None
        (None when every parameter gradient agrees)."""
        if self.grads and all(c.ok for c in self.grads):
            return None
        return next((node for node in self.grad_nodes if not node.ok), None)

    def _outputs_agree(self) -> bool:
        return all(c.ok for c in self.outputs)

    @property
    def max_error(self) -> float:
        """Largest max-abs error over outputs and gradients (``inf`` for a structure mismatch)."""
        return max((c.max_abs for c in self.outputs + self.grads), default=0.0)

    def table(self, wide: bool | None = None) -> str:
        """The verdict, the output table, the first divergence and the node error table.

        The node tables fit the terminal unless ``wide=True`` (see :mod:`fxdebug.base.fit_to_width`).
        """
        lines = [f"check_equivalence: {self.reference_name} (reference) vs {self.candidate_name} "
                 f"(candidate), {self.mode} mode, cloned inputs {self.inputs}; training flags "
                 f"restored afterwards",
                 f"tolerance: {_tolerance_text(self.rtol, self.atol)}"]
        failed = [c for c in self.outputs if not c.ok]
        failed_grads = [c for c in self.grads if not c.ok]
        verdict = "EQUIVALENT" if self.ok else "DIFFERENT"
        counts = f"{len(self.outputs) - len(failed)}/{len(self.outputs)} outputs agree"
        if self.grads:
            counts += f", {len(self.grads) - len(failed_grads)}/{len(self.grads)} gradients agree"
        lines.append(f"verdict: {verdict} ({counts})")
        lines.append("")
        lines.append(_comparison_table(self.outputs, "output", wide))
        if self.grads:
            lines.append("")
            worst = max(c.max_abs for c in self.grads)
            if failed_grads:
                lines.append(_comparison_table(failed_grads, "parameter gradient", wide))
                lines.append(f"the other {len(self.grads) - len(failed_grads)} parameter "
                             f"gradients agree")
            else:
                lines.append(f"all {len(self.grads)} parameter gradients agree (max abs error "
                             f"{format_error(worst)})")
        lines.append("")
        first = self.first_divergence
        if first is not None:
            lines.append(f"first divergence: {first.describe()}")
            lines.append("")
        first_grad = self.first_grad_divergence
        if first_grad is not None:
            bad_grads = [node for node in self.grad_nodes if not node.ok]
            lines.append(f"first gradient divergence (backward order): {first_grad.describe()}")
            lines.append("")
            lines.append(f"activation gradients out of tolerance: {len(bad_grads)} of "
                         f"{len(self.grad_nodes)} compared (backward order)")
            lines.append(_node_table(bad_grads, wide))
            lines.append("")
        if self.localized:
            bad, rounding = self.divergences, self.beyond_tolerance
            if rounding:
                lines.append(f"nodes out of tolerance: none that reaches the outputs; "
                             f"{len(rounding)} of {len(self.nodes)} compared differ beyond "
                             f"tolerance while the outputs agree within it (the rounding of a "
                             f"reordered computation, such as folded weights, or a difference "
                             f"the later nodes do not pass on):")
                lines.append(_node_table(rounding, wide))
            else:
                lines.append(f"nodes out of tolerance: {len(bad)} of {len(self.nodes)} "
                             f"compared (reference execution order)")
            if bad:
                lines.append(_node_table(bad, wide))
            if self.unmatched_reference:
                lines.append("no counterpart in the candidate: " +
                             ", ".join(self.unmatched_reference))
            if self.unmatched_candidate:
                lines.append("no counterpart in the reference: " +
                             ", ".join(self.unmatched_candidate))
        else:
            lines.append("nodes out of tolerance: none (node values were not compared: "
                         "the outputs agree)" if not failed else
                         "nodes out of tolerance: not localized (see notes)")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    verdict_words = ("EQUIVALENT", "DIFFERENT")

    def _size(self) -> str:
        size = f"{len(self.outputs)} output(s)"
        if self.grads:
            size += f", {len(self.grads)} gradient(s)"
        return size + (f", {len(self.nodes)} node(s) compared" if self.nodes else "")

    def _finding(self) -> str:
        first = self.first_divergence or self.first_grad_divergence
        if first is not None and first.arguments:  # the change says it best in one line
            return f"first divergence {first.key} ({first.op}): its arguments changed " \
                   f"{first.arguments}"
        if first is not None:
            return f"first divergence {first.describe()}"
        failed = [c for c in self.outputs + self.grads if not c.ok]
        return failed[0].describe() if failed else ""

    def _fields(self) -> dict:
        fields = super()._fields()
        fields["nodes"] = self.divergences
        fields["beyond_tolerance"] = self.beyond_tolerance
        fields["grad_nodes"] = [node for node in self.grad_nodes if not node.ok]
        fields["first_divergence"] = self.first_divergence
        fields["first_grad_divergence"] = self.first_grad_divergence
        return fields

    def _repr_html_(self) -> str:
        """The verdict and node comparisons as HTML for Jupyter, first divergence marked."""
        return equivalence_html(self)


def _tolerance_text(rtol, atol) -> str:
    if rtol is None and atol is None:
        return "dtype defaults of torch.testing.assert_close (float32: rtol=1.3e-06, atol=1e-05)"
    return (f"rtol={'dtype default' if rtol is None else format(rtol, 'g')}, "
            f"atol={'dtype default' if atol is None else format(atol, 'g')}")


def _comparison_table(rows: list[Comparison], what: str, wide: bool | None = None) -> str:
    body = [[c.path, c.shape or "-", c.dtype or "-", format_error(c.max_abs),
             format_error(c.max_rel), f"{c.mismatched}/{c.numel}" if c.numel else "-",
             "ok" if c.ok else "DIFFERS", c.detail] for c in rows]
    return fit_table(body, [what, "shape", "dtype", "max abs", "max rel", "out of tol",
                            "verdict", "detail"], width=table_width(wide),
                     drop=("detail", "out of tol", "max rel"), truncate=(what, "detail"),
                     colalign=("left",) * 3 + ("right",) * 3 + ("left",) * 2)


def _node_table(rows: list[NodeComparison], wide: bool | None = None) -> str:
    body = []
    for row in rows:
        body.append([row.key, row.op, row.location, row.candidate_text(), row.shape,
                     format_error(row.max_abs), format_error(row.max_rel), row.detail])
    return fit_table(body, ["key", "op", "source", "candidate", "shape", "max abs", "max rel",
                            "detail"], width=table_width(wide),
                     drop=("detail", "op", "max rel", "candidate", "source"),
                     truncate=("key", "op", "source", "candidate", "detail"),
                     colalign=("left",) * 5 + ("right",) * 2 + ("left",))
