"""Pieces whose placement is unknown, resolved against the other run: which layout holds.

A rank of a sharded run may hold a capture whose placement nothing recorded: a local tensor
after a ParallelStyle's ``use_local_output=True`` that is not the style's own output (an
activation after ``ColwiseParallel``), an activation inside a part traced with torch.fx, or a
data-parallel rank's batch. Such pieces are never guessed into a full value; when the other run
holds the full value of the key, every layout the pieces could have is tested against it::

    units      one value per rank (or per mesh group whose own placement is known), in rank order
    layouts    R       every unit holds the whole value (replicated)
               S(d)    the units concatenated along dim d (a shard; dim 0: a batch split)
               P       the units summed (a pending sum: an all-reduce not yet run)
               A x B   two levels on a world of g x k units (consecutive units form the inner
                       groups, as a row-major DeviceMesh): B inside each group, A across groups
    checks     each layout says what each unit must hold (a slice of the other run's value, or
               for P the sum of its terms); the layout whose checks all pass is the one that
               held; where none passes, the one nearest the other run is reported, and the
               units whose checks fail are the ranks that hold the differences

>>> import torch
>>> full = torch.arange(6.0).reshape(2, 3)
>>> found = resolve({0: full[:, :2], 1: full[:, 2:]}, full)
>>> found.layout, found.ok, found.value.shape
('S(1)', True, torch.Size([2, 3]))
>>> bad = resolve({0: full, 1: full * 2}, full)
>>> bad.layout, bad.ok, bad.ranks
('R', False, (1,))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from ..equivalence.compare import default_tolerances

__all__ = ["Resolution", "resolve", "resolve_stats"]


@dataclasses.dataclass
class Resolution:
    """The layout that held (or came nearest): ``value`` assembled by it (for a replicated
    layout, the copy furthest from the other run), ``ok`` whether every check passed, and per
    rank the largest absolute error of what it holds (``errors``); ``ranks``: those whose
    check failed."""

    layout: str
    ok: bool
    value: torch.Tensor | None
    errors: dict[int, float]
    ranks: tuple[int, ...]
    max_abs: float
    max_rel: float

    def describe(self) -> str:
        """``placement unknown: S(1) (concatenated along dim 1) holds``."""
        return f"placement unknown, resolved against the other run: {layout_words(self.layout)} " \
               f"{'holds' if self.ok else 'comes nearest and fails'}"

    def errors_text(self) -> str:
        """``rank 0 max abs 0, rank 1 max abs 0.5``."""
        return ", ".join(f"rank {r} max abs {e:.3g}" for r, e in sorted(self.errors.items()))


def layout_words(layout: str) -> str:
    """``"S(1) x R"`` -> ``"S(1) x R (across groups: concatenated along dim 1; inside: ...)"``."""
    def one(part: str) -> str:
        if part.startswith("S("):
            return f"concatenated along dim {part[2:-1]}"
        return {"R": "replicated", "P": "summed"}[part]
    parts = layout.split(" x ")
    if len(parts) == 1:
        return f"{layout} ({one(layout)})"
    return f"{layout} ({one(parts[0])} across groups of ranks, {one(parts[1])} inside each)"


# -- tensors --------------------------------------------------------------------------------
def _layouts(count: int, ndim: int) -> list[list[tuple[str, int]]]:
    """Candidate layouts: one level over every unit, then two levels (outer, inner) for each
    factorisation of ``count``; each level ``(op, groups)``."""
    ops = ["R", *[f"S({d})" for d in range(ndim)], "P"]
    found = [[(op, count)] for op in ops]
    for outer in range(2, count):
        if count % outer:
            continue
        for op_out in ops[:-1]:  # a pending sum across groups of shards: not tried
            for op_in in ops:
                if op_out == op_in == "R":
                    continue
                found.append([(op_out, outer), (op_in, count // outer)])
    return found


def _shape(units: list[torch.Tensor], levels: list[tuple[str, int]]) -> tuple[int, ...] | None:
    """The shape the layout assembles from the units' shapes, or None where they do not fit."""
    op, groups = levels[0]
    size = len(units) // groups
    children = [units[i * size:(i + 1) * size] for i in range(groups)]
    shapes = [tuple(c[0].shape) if len(levels) == 1 else _shape(c, levels[1:]) for c in children]
    if any(s is None for s in shapes):
        return None
    first = shapes[0]
    assert first is not None  # checked above (mypy)
    if op.startswith("S("):
        dim = int(op[2:-1])
        rest = [s[:dim] + s[dim + 1:] for s in shapes if s is not None]
        if any(len(s) != len(first) or r != rest[0] for s, r in zip(shapes, rest)
               if s is not None):
            return None
        return first[:dim] + (sum(s[dim] for s in shapes if s is not None),) + first[dim + 1:]
    return first if all(s == first for s in shapes) else None


def _checks(units: list[tuple[int, torch.Tensor]], target: torch.Tensor,
            levels: list[tuple[str, int]]) -> list[tuple[tuple[int, ...], torch.Tensor,
                                                           torch.Tensor]] | None:
    """``(ranks, what they hold, what they must hold)`` for each check of the layout, or None
    where the units do not fit the target's shape."""
    op, groups = levels[0]
    size = len(units) // groups
    children = [units[i * size:(i + 1) * size] for i in range(groups)]
    if op == "P":  # only innermost: the sum of the terms
        if len(levels) > 1 or any(tuple(v.shape) != tuple(target.shape) for _, v in units):
            return None
        total = torch.stack([v for _, v in units]).sum(dim=0)
        return [(tuple(r for r, _ in units), total, target)]
    targets: list[torch.Tensor]
    if op == "R":
        targets = [target] * groups
    else:
        dim = int(op[2:-1])
        shapes = [tuple(c[0][1].shape) if len(levels) == 1 else
                  _shape([v for _, v in c], levels[1:]) for c in children]
        if any(s is None for s in shapes) or target.ndim <= dim:
            return None
        sizes = [s[dim] for s in shapes if s is not None]
        if sum(sizes) != target.shape[dim]:
            return None
        targets = list(torch.split(target, sizes, dim=dim))
    found: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = []
    for child, part in zip(children, targets):
        if len(levels) == 1:
            rank, value = child[0]
            if tuple(value.shape) != tuple(part.shape):
                return None
            found.append(((rank,), value, part))
            continue
        inner = _checks(child, part, levels[1:])
        if inner is None:
            return None
        found.extend(inner)
    return found


def _assembled(units: list[tuple[int, torch.Tensor]], levels: list[tuple[str, int]],
               errors: dict[int, float]) -> tuple[torch.Tensor, float]:
    """The value the layout assembles, and the largest error of the ranks in it: a replicated
    level takes the copy furthest from the other run (a reference then judges the worst)."""
    op, groups = levels[0]
    size = len(units) // groups
    children = [units[i * size:(i + 1) * size] for i in range(groups)]
    values = [(c[0][1], errors.get(c[0][0], 0.0)) if len(levels) == 1 else
              _assembled(c, levels[1:], errors) for c in children]
    if op == "R":
        return max(values, key=lambda pair: pair[1])
    error = max(e for _, e in values)
    if op == "P":
        return torch.stack([v for v, _ in values]).sum(dim=0), error
    return torch.cat([v for v, _ in values], dim=int(op[2:-1])), error


def _wide(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.is_floating_point() or a.is_complex() or b.is_floating_point() or b.is_complex():
        dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)
        return a.detach().to(dtype), b.detach().to(device=a.device, dtype=dtype)
    return a.detach(), b.detach().to(a.device)


def resolve(pieces: dict[int, torch.Tensor], target: torch.Tensor, rtol: float | None = None,
            atol: float | None = None) -> Resolution | None:
    """The layout of ``pieces`` (rank -> what that rank holds) that holds ``target`` (the other
    run's full value), else the nearest one; None where no layout fits its shape."""
    ranks = sorted(pieces)
    units = [(r, pieces[r]) for r in ranks]
    rtol_d, atol_d = default_tolerances(target.dtype, pieces[ranks[0]].dtype)
    rtol = rtol_d if rtol is None else float(rtol)
    atol = atol_d if atol is None else float(atol)
    best: tuple[float, int, Resolution, list[tuple[str, int]]] | None = None
    for order, levels in enumerate(_layouts(len(units), target.ndim)):
        checks = _checks(units, target, levels)
        if checks is None:
            continue
        errors: dict[int, float] = {}
        failing: set[int] = set()
        worst_abs = worst_rel = worst_norm = 0.0
        for held_by, held, wanted in checks:
            x, y = _wide(held, wanted)
            same = (x == y) | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() \
                else x == y
            difference = torch.where(same, torch.zeros_like(x), (x - y).abs())
            max_abs = float(difference.max()) if difference.numel() else 0.0
            max_abs = math.inf if math.isnan(max_abs) else max_abs
            scale = y.abs()
            rel = torch.where(difference == 0, torch.zeros_like(difference),
                              difference / scale.clamp_min(1e-300))
            max_rel = float(rel.max()) if rel.numel() else 0.0
            close = bool((same | (difference <= atol + rtol * scale)).all())
            norm = float(torch.linalg.vector_norm(torch.where(same, torch.zeros_like(x), x - y)))
            norm = norm / max(float(torch.linalg.vector_norm(y)), 1e-300)
            for r in held_by:
                errors[r] = max(errors.get(r, 0.0), max_abs)
                if not close:
                    failing.add(r)
            worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
            worst_norm = max(worst_norm, math.inf if math.isnan(norm) else norm)
        text = " x ".join(op for op, _ in levels)
        candidate = Resolution(text, not failing, None, errors, tuple(sorted(failing)),
                               worst_abs, worst_rel)
        score = (0.0 if not failing else 1.0 + worst_norm, order)
        if best is None or score < best[:2]:
            best = (score[0], score[1], candidate, levels)
        if not failing:
            break
    if best is None:
        return None
    found, levels = best[2], best[3]
    # the value a reference judges: a replicated level takes its copy furthest from the target
    found.value = _assembled(units, levels, found.errors)[0]
    return found


# -- statistics -----------------------------------------------------------------------------
def resolve_stats(summaries: dict[int, torch.Tensor], target,
                  close: Callable[[Any, Any], bool], stats_of, combine) -> tuple[
                      str, bool, torch.Tensor, tuple[int, ...]] | None:
    """Statistics mode: ``(layout, ok, summary, failing ranks)``. Layouts: ``R`` (every rank's
    statistics are the other run's) or ``S`` (the ranks' values are parts of one tensor: their
    summaries merged exactly, whatever the dim: a data-parallel batch split or a shard), and
    ``S x R`` / ``R x S`` on g x k ranks."""
    ranks = sorted(summaries)
    units = [summaries[r] for r in ranks]
    candidates: list[tuple[str, list[tuple[tuple[int, ...], torch.Tensor]]]] = [
        ("R", [((r,), summaries[r]) for r in ranks])]
    merged = units[0]
    for other in units[1:]:
        merged = combine(merged, other)
    candidates.append(("S", [(tuple(ranks), merged)]))
    count = len(units)
    for outer in range(2, count):
        if count % outer:
            continue
        inner = count // outer
        groups = [ranks[i * inner:(i + 1) * inner] for i in range(outer)]
        pooled = []
        for group in groups:
            value = summaries[group[0]]
            for r in group[1:]:
                value = combine(value, summaries[r])
            pooled.append((tuple(group), value))
        candidates.append(("R x S", pooled))  # each group's pooled value is the whole
    for layout, checks in candidates:
        failing = tuple(r for held_by, s in checks if not close(stats_of(s), target)
                        for r in held_by)
        if not failing:
            return layout, True, checks[0][1], ()
    failing = tuple(r for r in ranks if not close(stats_of(summaries[r]), target))
    return "R", False, units[0], failing
