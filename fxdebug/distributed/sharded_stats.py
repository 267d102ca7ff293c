"""Statistics of sharded captures (``mode="stats"``) and sharded parameter gradients.

Each rank keeps the summary of its own piece (:func:`fxdebug.stats.summary.summarize`: count,
mean, M2, min, max, zeros, non-finite, numel). The full tensor's statistics follow from the
pieces' summaries where the pieces are its parts, never otherwise::

    placement on a mesh dim   the full tensor's summary
    Shard(d)                  the pieces' summaries combined (stats.combine): exact
    Replicate                 one copy's, after checking every copy's summary is the same
    Partial (pending sum)     none: the statistics of a sum are not those of its terms

>>> import torch
>>> from fxdebug.stats.summary import stats_from_summary, summarize
>>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([4.0])
>>> full = assemble_summaries({(0,): summarize(a), (1,): summarize(b)}, ("S(0)",))
>>> stats_from_summary(full).mean == stats_from_summary(summarize(torch.cat([a, b]))).mean
True
>>> assemble_summaries({(0,): summarize(a), (1,): summarize(b)}, ("P",))
Traceback (most recent call last):
...
ValueError: a pending sum (Partial) on mesh dim 0: the statistics of a sum cannot be combined from its terms' statistics
"""

from __future__ import annotations

import torch

from ..runtime.placement import agreement_text
from ..stats.summary import combine

__all__ = ["assemble_summaries", "local_shape", "same_summary",
           "PARTIAL_STATS"]

PARTIAL_STATS = "the statistics of a sum cannot be combined from its terms' statistics"


def same_summary(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same summary (NaN where the other has NaN)."""
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())


def assemble_summaries(pieces: dict[tuple[int, ...], torch.Tensor], placements: tuple[str, ...],
                       ranks: dict[tuple[int, ...], int] | None = None,
                       mesh_names: tuple[str, ...] = ()) -> torch.Tensor:
    """The full tensor's summary from one summary per mesh coordinate (every coordinate present);
    raises ValueError saying why it cannot be known (``ranks``: coordinate -> global rank, to
    name them)."""
    current = {coordinate: (summary, [coordinate]) for coordinate, summary in pieces.items()}
    for dim in reversed(range(len(placements))):
        text = placements[dim]
        name = mesh_names[dim] if dim < len(mesh_names) and mesh_names[dim] else str(dim)
        if text.startswith("P"):
            raise ValueError(f"a pending sum (Partial) on mesh dim {name}: {PARTIAL_STATS}")
        groups: dict[tuple[int, ...], list] = {}
        for coordinate in sorted(current):
            groups.setdefault(coordinate[:dim], []).append(current[coordinate])
        merged = {}
        for rest, parts in groups.items():
            summary, held = parts[0][0], list(parts[0][1])
            for other, other_held in parts[1:]:
                if text == "R" and not same_summary(summary, other):
                    named = {(ranks or {}).get(c[0], i): s for i, (s, c) in enumerate(parts)}
                    raise ValueError(f"replicated on mesh dim {name}, yet its copies differ: "
                                     f"{agreement_text(named, same_summary)}")
                if text != "R":
                    summary = combine(summary, other)
                held += other_held
            merged[rest] = (summary, held)
        current = merged
    return current[()][0]


def local_shape(global_shape: tuple[int, ...], placements: tuple[str, ...],
                mesh_sizes: tuple[int, ...], coordinate: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the piece a DTensor of ``global_shape`` keeps at ``coordinate``: mesh dims
    in order, each ``Shard(d)`` taking its chunk as ``torch.chunk`` does (as DTensor does).

    >>> local_shape((2, 5), ("S(1)",), (2,), (1,))
    (2, 2)
    """
    shape = list(global_shape)
    for dim, text in enumerate(placements):
        if text.startswith("S(") and dim < len(coordinate):
            along, chunks = int(text[2:-1]), mesh_sizes[dim]
            size = shape[along]
            full = -(-size // chunks)
            start = full * coordinate[dim]
            shape[along] = max(0, min(size, start + full) - start)
    return tuple(shape)
