"""``compare_runs(a, b)``: two runs of a model (saved or in memory), key by key.

Every key of run ``a`` is compared, in ``a``'s execution order, with the same
key of run ``b`` (then the gradients, in backward order); keys only one run
has are listed. Tensors are compared in the wider of their two dtypes with the
tolerances ``torch.testing.assert_close`` uses for the narrower one (float32
against bfloat16: bfloat16's), so a run on another device or in another
precision is judged by what that precision can hold. Statistics-only captures
(``mode="stats"``) compare their mean, std, min, max and non-finite count.

When the runs differ in dtype (a key's, or the runs' as a whole: a float32 run
against a bfloat16 one), each key is also measured against what the rounding of
the less precise dtype can explain (:mod:`.rounding`: error norm within
``16 x eps(dtype) x`` the key's norm in run ``a``), and the report says whether
rounding explains every difference, or names the keys it cannot.

With ``reference=r`` (a run of the same model and input in a more precise
dtype, typically float64: :mod:`.reference`), each key's errors against ``r``
are measured, ``err(x, r) = ||x - r|| / ||r||`` (Frobenius, in float64), and a
key diverges only where ``err(b, r) > reference_factor * err(a, r) +
reference_floor``: run b may differ from run a in every last bit (another
parallelism, another reduction order) and still be ``ok``. Without a reference,
runs of one dtype that differ by a few eps are reported as possibly rounding
(``report.last_bits``).

    RunComparison
      ├─ entries / grad_entries   one RunEntry per key: status, max abs / rel error
      ├─ first_divergence         the first entry that differs (key, op, file:line)
      ├─ rounding                 across dtypes: RoundingCheck, .explained, .beyond keys
      ├─ reference                with reference=: ReferenceCheck, .beyond keys, the rule
      ├─ last_bits                without it: LastBits, keys of one dtype within a few eps
      ├─ table()                  verdict, first divergence, every key (80 columns)
      └─ to_dict(), HTML          from fxdebug's Report

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
>>> gm = fxdebug.instrument(model)
>>> x = torch.randn(4, 3)
>>> _ = gm(x); a = fxdebug.records(gm)
>>> with torch.no_grad(): _ = model[2].weight.add_(1.0)
>>> _ = gm(x); b = fxdebug.records(gm)
>>> report = fxdebug.compare_runs(a, b)
>>> report.ok, report.first_divergence.key
(False, '2')
"""

from __future__ import annotations

import dataclasses
import html
import os
import warnings

import torch

from ..errors import FidelityWarning, renamed_arguments
from ..base.fit_to_width import ELLIPSIS, fit_line, fit_table, table_width
from ..runtime.records import Records
from ..base.report import Report
from .saved_runs import load_records
from ..equivalence.compare import dtype_text, format_error
from .key_compare import NOT_COMPARED, STATUS_TEXT, RunEntry, compare_all
from .reference import (REFERENCE_FACTOR, REFERENCE_FLOOR_EPS, STATS_FLOOR_EPS, LastBits,
                        ReferenceCheck, check_reference_keys, reference_errors, reference_floor)
from ..distributed.live_shards import gathered
from ..distributed.sharded import align_wrapped, holding_ranks
from .rounding import ROUNDING_FACTOR, RoundingCheck, rounding_dtype

__all__ = ["compare_runs", "RunComparison", "RunEntry", "STATUS_TEXT"]


@dataclasses.dataclass(repr=False)
class RunComparison(Report):
    """What :func:`compare_runs` found: ``ok`` when every key of either run was compared and is
    equal or close in both; ``verdict_text`` ``"EQUAL"``, ``"DIFFERENT"`` (a compared key
    differs, or a key is only in one run) or ``"INCOMPLETE"`` (nothing compared differs, but
    :attr:`not_compared` lists keys whose values could not be compared)."""

    a: str
    b: str
    entries: list[RunEntry]
    grad_entries: list[RunEntry]
    rtol: float | None = None
    atol: float | None = None
    rounding: RoundingCheck | None = None  # set when the runs differ in dtype
    reference: ReferenceCheck | None = None  # set with reference=
    last_bits: LastBits | None = None  # without a reference: keys of one dtype within a few eps

    verdict_words = ("EQUAL", "DIFFERENT")

    @property
    def ok(self) -> bool:
        """Every key compared, and equal or close (a verdict covers only what it compared)."""
        return all(entry.ok and entry.compared for entry in self.entries + self.grad_entries)

    @property
    def not_compared(self) -> list[RunEntry]:
        """Entries whose values were not compared: not assembled, stale, or in one run only."""
        return [entry for entry in self.entries + self.grad_entries if not entry.compared]

    @property
    def complete(self) -> bool:
        """Whether every key of either run was compared."""
        return not self.not_compared

    @property
    def verdict_text(self) -> str:
        """``"EQUAL"``, ``"DIFFERENT"`` or ``"INCOMPLETE"`` (see the class docstring)."""
        if self.divergences:
            return "DIFFERENT"
        return "EQUAL" if self.complete else "INCOMPLETE"

    def __repr__(self) -> str:
        text = super().__repr__()
        return text.replace(", DIFFERENT", ", INCOMPLETE", 1) \
            if self.verdict_text == "INCOMPLETE" else text

    def coverage(self) -> str:
        """``"43 of 45 keys compared; 2 not: 2 not assembled"``."""
        total = len(self.entries) + len(self.grad_entries)
        missing = self.not_compared
        text = f"{total - len(missing)} of {total} keys compared"
        if not missing:
            return text
        counts: dict[str, int] = {}
        for entry in missing:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        why = ", ".join(f"{counts[s]} {STATUS_TEXT[s]}" for s in NOT_COMPARED if s in counts)
        return f"{text}; {len(missing)} not: {why}"

    @property
    def divergences(self) -> list[RunEntry]:
        """Entries that differ, forward (execution order) then gradients (backward order)."""
        return [entry for entry in self.entries + self.grad_entries if not entry.ok]

    @property
    def first_divergence(self) -> RunEntry | None:
        """The first key, in execution order, whose values differ beyond the tolerances; across
        dtypes (no reference), the first whose difference rounding cannot explain, where one is
        (a key that differs only as the less precise dtype rounds is not where a bug is)."""
        divergences = self.divergences
        beyond = [e for e in divergences if e.beyond_rounding]
        return next(iter(beyond or divergences), None)

    def _size(self) -> str:
        grads = f" and {len(self.grad_entries)} gradient(s)" if self.grad_entries else ""
        return f"{len(self.entries)} key(s){grads}"

    def _finding(self) -> str:
        first = self.first_divergence
        return "" if first is None else f"first divergence {first.describe()}"

    def _fields(self) -> dict:
        return {"a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol,
                "verdict": self.verdict_text, "complete": self.complete,
                "compared": sum(e.compared for e in self.entries + self.grad_entries),
                "not_compared": [{"key": ("grad " if e.section == "grad" else "") + e.key,
                                  "status": e.status, "why": e.detail}
                                 for e in self.not_compared],
                "keys": len(self.entries), "gradients": len(self.grad_entries),
                "first_divergence": self.first_divergence, "divergences": self.divergences,
                "rounding": self.rounding, "reference": self.reference,
                "last_bits": self.last_bits}

    def _tolerances(self) -> str:
        if self.rtol is None and self.atol is None:
            return "the tolerances per dtype of torch.testing.assert_close"
        rtol = "per dtype" if self.rtol is None else f"{self.rtol:g}"
        atol = "per dtype" if self.atol is None else f"{self.atol:g}"
        return f"rtol={rtol}, atol={atol}"

    def _rows(self) -> list[list[str]]:
        rows = []
        for entry in self.entries + self.grad_entries:
            compared = entry.status in ("equal", "close", "differs", "rounding", "beyond")
            if self.reference is not None:
                judged = entry.err_b is not None
                mark = " s" if entry.by_stats else ""
                errors = [format_error(entry.err_a or 0.0) + mark if judged else "-",
                          format_error(entry.err_b) + mark if entry.err_b is not None else "-"]
            else:
                errors = [format_error(entry.max_abs) if compared else "-",
                          format_error(entry.max_rel) if compared else "-"]
            status = STATUS_TEXT[entry.status] + (f" ({entry.layout})" if entry.layout else "")
            row = [("grad " if entry.section == "grad" else "") + entry.key, entry.op,
                   status, *errors, entry.shape, entry.location or "-"]
            if self.rounding is not None:
                row.insert(5, "-" if entry.rounding is None else
                           f"{'BEYOND ' if entry.beyond_rounding else ''}{entry.rounding:.2g} eps")
            rows.append(row)
        return rows

    def _headers(self) -> list[str]:
        errors = ["err(a,r)", "err(b,r)"] if self.reference is not None else ["max abs", "max rel"]
        headers = ["key", "op", "status", *errors, "shape", "file:line"]
        if self.rounding is not None:
            headers.insert(5, "rounding")
        return headers

    def table(self, wide: bool | None = None) -> str:
        """Verdict, first divergence, then every key with its error."""
        width = table_width(wide)
        lines = [_fit_path("compare_runs: a = ", self.a, width),
                 _fit_path("              b = ", self.b, width)]
        if self.reference is not None:
            lines += [_fit_path("reference: r = ", f"{self.reference.path} ({self.reference.dtype} "
                                                  f"run)", width), *self.reference.describe()[1:]]
            if any(entry.by_stats for entry in self.entries + self.grad_entries):
                lines.append("reference: s: statistics only, err = largest |x - r| of mean, std, "
                             "min, max / max(|min|, |max|, |mean| + std) of r")
        else:
            lines.append(f"compared with {self._tolerances()}")
        counts: dict[str, int] = {}
        for entry in self.entries + self.grad_entries:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        bad = self.divergences
        judged = " beyond rounding, judged by the reference" if self.reference else ""
        compared = sum(e.compared for e in self.entries + self.grad_entries)
        if bad:
            lines.append(f"verdict: DIFFERENT: {len(bad)} key(s) differ{judged} "
                         f"({self.coverage()})")
        elif self.not_compared:
            lines.append(f"verdict: INCOMPLETE: the {compared} keys compared agree, "
                         f"{len(self.not_compared)} could not be compared ({self.coverage()})")
        else:
            lines.append(f"verdict: EQUAL: all {compared} keys compared and agree"
                         + (" within rounding, judged by the reference" if self.reference else ""))
        lines = [fit_line(line, width) for line in lines]
        first = self.first_divergence
        if first is not None:  # one line whatever the width: grep finds key and file:line
            lines.append(f"first divergence: {first.describe()}")
        if self.not_compared:  # one line too: what was not compared, and why
            first = self.not_compared[0]
            lines.append(f"first not compared: {first.describe()}")
        if self.rounding is not None:
            lines.append(fit_line(self.rounding.describe(), width))
            if self.rounding.first_beyond:  # one line, as the first divergence
                lines.append(f"first beyond rounding: {self.rounding.first_beyond}")
        if self.last_bits is not None:
            lines.append(fit_line(self.last_bits.describe(), width))
        lines.append("")
        headers = self._headers()
        lines.append(fit_table(self._rows(), headers,
                               width=width, drop=("file:line", "shape", "op"),
                               truncate=("key", "file:line"),
                               colalign=("left",) * 3 + ("right",) * (len(headers) - 5)
                               + ("left",) * 2))
        summary = ", ".join(f"{counts[s]} {t}" for s, t in STATUS_TEXT.items() if s in counts)
        lines.append(f"keys: {summary or 'none'}")
        if any(entry.layout for entry in self.entries + self.grad_entries):
            lines += ["(layout): placement unknown, the layout that held against the other run:",
                      "  R whole on every rank, S(d) joined along dim d, P summed, A x B: A",
                      "  across groups of ranks, B inside each"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        first = self.first_divergence
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._headers())
        body = []
        entries = self.entries + self.grad_entries
        for entry, row in zip(entries, self._rows()):
            style = ("background:#fdd;" if not entry.ok else "") + \
                    ("outline:2px solid #c00;" if entry is first else "")
            cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
            body.append(f"<tr style=\"{style}\">{cells}</tr>")
        verdict = html.escape("\n".join(self.table(wide=True).split("\n\n")[0].splitlines()))
        return (f"<div><pre>{verdict}</pre><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table></div>")


def _fit_path(prefix: str, path: str, width: int | None) -> str:
    """``prefix + path``; a path too long for ``width`` keeps its end (``…/run-000002``)."""
    if width is None or len(prefix) + len(path) <= width:
        return prefix + path
    return prefix + ELLIPSIS + path[len(prefix) + len(path) + 1 - width:]


@renamed_arguments(keyword_only=("rtol", "atol"))
def compare_runs(a, b, *, rtol: float | None = None, atol: float | None = None,
                 reference=None, reference_factor: float = REFERENCE_FACTOR,
                 reference_floor: float | None = None) -> RunComparison:
    """Compare two runs key by key: Records (``fxdebug.records(gm)``, ``load_records``) or
    folders of saved runs (the latest run in an ``instrument(folder=)`` folder).

    ``rtol`` / ``atol`` default to ``torch.testing.assert_close``'s for the
    narrower dtype of each pair. Relative errors are taken against run ``a``.

    A run of a sharded model is made whole first: a folder saved by every rank
    (``path/rank-R``), or, on every rank of a tensor-parallel job, its live
    ``fxdebug.records(gm)`` (then a collective every rank calls: each rank's pieces are
    gathered, see :mod:`fxdebug.distributed.live_shards`). Each key is assembled on its mesh, and a
    differing entry's ``ranks`` are the ranks whose piece holds the differences.

    ``reference``: a run (Records or folder) of the same model and input in a more
    precise dtype, typically float64. Then a key diverges only where
    ``err(b, r) > reference_factor * err(a, r) + reference_floor``, with
    ``err(x, r) = ||x - r|| / ||r||`` (Frobenius, in float64; statistics-only
    captures: their mean, std, min and max); ``reference_floor`` defaults to
    2 eps of b's dtype at each key. Raises :class:`ReferenceMismatchError` when the
    reference lacks a key that a and b share or holds another shape.

    >>> import torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> _ = gm(torch.ones(1, 2)); a = fxdebug.records(gm)
    >>> _ = gm(torch.ones(1, 2)); b = fxdebug.records(gm)
    >>> fxdebug.compare_runs(a, b).ok
    True
    >>> _ = gm.double()(torch.ones(1, 2, dtype=torch.float64)); r = fxdebug.records(gm)
    >>> fxdebug.compare_runs(a, b, reference=r).reference.explained
    True
    """
    label_a, records_a = _open(a, "a")
    label_b, records_b = _open(b, "b")
    records_a, records_b = align_wrapped(records_a, records_b)  # DDP's "module." (sharded.py)
    judge = reference is not None
    run_rounding = rounding_dtype(_run_dtype(records_a), _run_dtype(records_b))
    resolved: dict = {}  # sharded keys of unknown placement, resolved against the other run
    entries = compare_all(records_a, records_b, "forward", rtol, atol, None, run_rounding,
                          last_bits=not judge, resolved=resolved)
    grads_a = records_a._grads if records_a._grads is not None else Records()
    grads_b = records_b._grads if records_b._grads is not None else Records()
    grad_entries = compare_all(grads_a, grads_b, "grad", rtol, atol,
                               getattr(records_a, "locations", {}), run_rounding,
                               last_bits=not judge, resolved=resolved)
    entries, grad_entries = _pending_sum_hints(entries), _pending_sum_hints(grad_entries)
    report = RunComparison(label_a, label_b, entries, grad_entries, rtol, atol,
                           _rounding_check(entries + grad_entries))
    if not judge:
        report.entries = holding_ranks(entries, records_a, records_b, rtol, atol)
        report.grad_entries = holding_ranks(grad_entries, grads_a, grads_b, rtol, atol)
        report.last_bits = _last_bits(entries + grad_entries)
        return report
    label_r, records_r = _open(reference, "reference")
    factor = float(reference_factor)
    if not factor >= 1.0:
        raise ValueError(f"compare_runs: reference_factor={reference_factor!r}; give a factor of "
                         f"at least 1 (default {REFERENCE_FACTOR:g}): b diverges where its error "
                         f"against the reference exceeds factor x a's.")
    if reference_floor is not None and not float(reference_floor) >= 0.0:
        raise ValueError(f"compare_runs: reference_floor={reference_floor!r}; give a relative "
                         f"error of at least 0, or None for {REFERENCE_FLOOR_EPS:g} eps of b's "
                         f"dtype.")
    check_reference_keys(records_a, records_b, records_r, "forward")
    report.entries = _judge_all(entries, records_a, records_b, records_r, factor, reference_floor,
                                resolved)
    grads_r = records_r._grads if records_r._grads is not None else Records()
    if any(key in grads_b for key in grads_a.keys()):
        if len(grads_r) == 0:
            warnings.warn(f"compare_runs: the reference run {label_r} holds no gradients: the "
                          f"gradients of runs a and b are compared by tolerances only. Run "
                          f"backward in the reference run too (instrument(..., grads=True)).",
                          FidelityWarning, stacklevel=2)
        else:
            check_reference_keys(grads_a, grads_b, grads_r, "grad")
            report.grad_entries = _judge_all(grad_entries, grads_a, grads_b, grads_r, factor,
                                             reference_floor, resolved)
    report.entries = holding_ranks(report.entries, records_a, records_b, rtol, atol)
    report.grad_entries = holding_ranks(report.grad_entries, grads_a, grads_b, rtol, atol)
    judged = report.entries + report.grad_entries
    b_dtypes = [(grads_b if e.section == "grad" else records_b).record(e.key).dtype
                for e in judged if e.err_b is not None]
    report.reference = _reference_check(judged, label_r, _run_dtype(records_r), b_dtypes,
                                        factor, reference_floor)
    return report


def _pending_sum_hints(entries: list[RunEntry]) -> list[RunEntry]:
    """A key that differs after keys whose ranks held unreduced terms of a sum (resolved as
    ``P``): its detail names the last of them, where an all-reduce may be missing."""
    out, pending = [], None
    for entry in entries:
        if entry.compared and entry.ok and "P" in entry.layout.split(" x "):
            pending = entry.key
        elif pending is not None and entry.status == "differs":
            hint = (f"after {pending}, which the ranks hold as unreduced terms of a sum "
                    f"(an all-reduce missing before this key?)")
            entry = dataclasses.replace(entry, detail="; ".join(p for p in (entry.detail, hint)
                                                                if p))
            pending = None
        out.append(entry)
    return out


def _judge_all(entries: list[RunEntry], a: Records, b: Records, r: Records, factor: float,
               floor: float | None, resolved: dict) -> list[RunEntry]:
    """Each entry compared in both runs judged by its errors against the reference (a sharded
    key resolved against the other run: by the value its layout assembles)."""
    judged = []
    for entry in entries:
        if entry.status not in ("equal", "close", "differs"):
            judged.append(entry)
            continue
        ra, rb = resolved.get((entry.section, entry.key),
                              (a.record(entry.key), b.record(entry.key)))
        rr = r.record(entry.key)
        if rr.stale:
            judged.append(dataclasses.replace(entry, status="stale", detail=(
                "stale in the reference run: written in place after its capture, not compared")))
            continue
        err_a, err_b, by_stats = reference_errors(ra, rb, rr)
        bound = factor * err_a + reference_floor(rb.dtype, floor, by_stats)
        status = "equal" if entry.status == "equal" else \
            ("beyond" if err_b > bound else "rounding")
        judged.append(dataclasses.replace(entry, status=status, err_a=err_a, err_b=err_b,
                                          bound=bound, by_stats=by_stats))
    return judged


def _reference_check(entries: list[RunEntry], path: str, dtype: torch.dtype | None,
                     b_dtypes: list[torch.dtype], factor: float,
                     floor: float | None) -> ReferenceCheck:
    judged = [e for e in entries if e.err_b is not None]
    if floor is None:
        floating = sorted({dtype_text(d) for d in b_dtypes if d.is_floating_point})
        values = ", ".join(f"{reference_floor(getattr(torch, d), None):.3g} for {d}"
                           for d in floating)
        floor_text = f"{REFERENCE_FLOOR_EPS:g} x eps(dtype of b)" + (f" ({values})" if values else "")
        if any(e.by_stats for e in judged):
            floor_text += f"; {STATS_FLOOR_EPS:g} x eps for statistics"
    else:
        floor_text = format_error(float(floor))
    ratios = [((e.err_b or 0.0) / e.bound if e.bound else 0.0,
               ("grad " if e.section == "grad" else "") + e.key)
              for e in judged if e.status == "rounding" and e.err_b]
    largest = max(ratios, key=lambda pair: pair[0], default=None)
    return ReferenceCheck(path, "unknown dtype" if dtype is None else dtype_text(dtype), factor,
                          floor, floor_text, len(judged),
                          [("grad " if e.section == "grad" else "") + e.key
                           for e in judged if e.status == "beyond"], largest)


def _last_bits(entries: list[RunEntry]) -> LastBits | None:
    """Keys of one dtype in both runs that differ, and those within a few eps of their norm."""
    differing = [e for e in entries if e.last_bits is not None and e.status in ("close", "differs")]
    within = [e for e in differing if (e.last_bits or 0.0) <= ROUNDING_FACTOR]
    if not within:
        return None
    largest = max(within, key=lambda e: e.last_bits or 0.0)
    return LastBits(len(differing), len(within), ROUNDING_FACTOR,
                    (largest.last_bits or 0.0,
                     ("grad " if largest.section == "grad" else "") + largest.key))


def _run_dtype(records: Records) -> torch.dtype | None:
    """The run's dtype: as saved in its context, else its first floating capture's."""
    saved = (getattr(records, "context", None) or {}).get("dtype")
    if isinstance(saved, str) and isinstance(getattr(torch, saved, None), torch.dtype):
        return getattr(torch, saved)
    return next((r.dtype for r in records.records() if r.dtype.is_floating_point), None)


def _rounding_check(entries: list[RunEntry]) -> RoundingCheck | None:
    """What the rounding of the less precise dtype explains, over the keys compared across dtypes."""
    checked = [e for e in entries if e.rounding is not None]
    if not checked:
        return None
    dtype = max((e.rounding_dtype for e in checked),
                key=lambda name: (torch.finfo(getattr(torch, name)).eps, name))
    beyond = [e for e in checked if e.beyond_rounding]
    within = [e for e in checked if not e.beyond_rounding and e.rounding]
    largest = max(within, key=lambda e: e.rounding or 0.0, default=None)
    return RoundingCheck(
        dtype, torch.finfo(getattr(torch, dtype)).eps,
        [("grad " if e.section == "grad" else "") + e.key for e in beyond], len(checked),
        None if largest is None or largest.rounding is None else (largest.rounding, largest.key),
        _beyond_text(beyond[0]) if beyond else "")


def _beyond_text(entry: RunEntry) -> str:
    """``layer2.0.bn1 (BatchNorm2d, resnet.py:93): error norm 64 eps of bfloat16 (0.5 x norm)``."""
    where = ", ".join(part for part in (entry.op, entry.location) if part)
    ratio = entry.rounding or 0.0
    eps = torch.finfo(getattr(torch, entry.rounding_dtype)).eps
    return (f"{'gradient of ' if entry.section == 'grad' else ''}{entry.key} ({where}): error "
            f"norm {ratio:.3g} eps of {entry.rounding_dtype} ({ratio * eps:.3g} x norm)")


def _open(run, name: str) -> tuple[str, Records]:
    if isinstance(run, Records):
        whole = gathered(run)  # a sharded model's live captures: every rank's pieces (collective)
        label = getattr(whole, "path", None) or "Records in memory"
        if whole is run and not getattr(run, "path", None) and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # data parallel (DDP, FSDP2): each rank compares its own run; say so in the verdict
            label += (f": rank {torch.distributed.get_rank()}'s run only, of "
                      f"{torch.distributed.get_world_size()} ranks")
        return label, whole
    if isinstance(run, (str, os.PathLike)):
        records = load_records(run)
        return records.path, records
    raise TypeError(f"compare_runs: run {name} is a {type(run).__name__}; give Records "
                    f"(fxdebug.records(gm), fxdebug.load_records(path)) or the path of a saved "
                    f"run.")
