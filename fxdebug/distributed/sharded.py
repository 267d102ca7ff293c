"""Sharded runs on disk: every rank's captures in ``path/rank-R``, full values assembled on read.

``instrument(model, folder=path)`` and ``save_records(rec, path)`` on every rank of a
process group write ``path/rank-R/...`` (R: the global rank), each capture with its
placement (placements, mesh dims, global shape, this rank's coordinate and the global
ranks of its mesh). :func:`~fxdebug.load_records` of ``path``, in any process (no process
group), gives :class:`ShardedRecords`: ``rec[key]`` is the full tensor, assembled when first
read::

    ranks grouped by their mesh      a DTensor on the "tp" mesh of a 2-D world: each tp group
    within a group, by coordinate    Shard(d): concatenated along d, in mesh-coordinate order;
                                     Replicate: one copy; Partial: summed (avg, max, min too)
    across groups / no placement     every group must hold the same bytes (ranks that run the
                                     same data), else the key cannot be assembled

A key whose pieces cannot be assembled (placement unknown and the ranks' pieces differ,
a rank missing, placements that disagree) raises :class:`~fxdebug.errors.FxdebugError`
when read, naming the key and which ranks hold which value (no one rank's is shown);
``rec.shards(key)`` gives every rank's piece. A run in statistics mode (``mode="stats"``)
gives the full tensor's statistics, from the pieces' summaries (:mod:`.sharded_stats`:
shards combined exactly, replicas checked equal, a pending sum ``Partial`` not assembled:
the statistics of a sum are not its terms'); so do the parameter gradients (DTensor pieces
under FSDP2 and tensor parallelism).

>>> import torch
>>> pieces = {(0,): torch.tensor([1., 2.]), (1,): torch.tensor([3.])}
>>> assemble(pieces, ("S(0)",))
tensor([1., 2., 3.])
>>> assemble({(0,): torch.ones(2), (1,): torch.ones(2)}, ("P",))
tensor([2., 2.])
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from ..equivalence.compare import default_tolerances
from ..errors import FxdebugError
from ..runtime.placement import Placement, agreement_text, assemble, same_tensor
from ..runtime.records import PLACEMENT_NOTE, Record, Records
from ..stats.summary import Stats, combine, stats_from_summary
from .sharded_stats import PARTIAL_STATS, assemble_summaries, same_summary
from .unknown_placement import Resolution, resolve, resolve_stats

__all__ = ["ShardedRecords", "ShardedRecord", "placement_entry", "placement_of",
           "unassembled", "holding_ranks", "align_wrapped", "RANK_FOLDER"]

RANK_FOLDER = "rank-"
SHARDED_NOTE = ("placement: how the ranks' pieces were assembled (S(d)@mesh dim: concatenated "
                "along dim d, R: one copy, checked equal, P: summed); shape and statistics are "
                "the full tensor's; rec.shards(key) gives each rank's piece")


# -- the manifest entry ------------------------------------------------------------------
def placement_entry(placement: Placement, local_shape: tuple[int, ...]) -> dict:
    """What a manifest keeps of a capture's placement (``local_shape``: the bytes saved)."""
    mesh_ranks = None
    mesh = placement.mesh
    if mesh is not None and hasattr(mesh, "mesh"):
        mesh_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    return {"placements": list(placement.placements),
            "mesh_dims": [[name, size] for name, size in placement.mesh_dims],
            "global_shape": None if placement.global_shape is None else
            list(placement.global_shape),
            "local": placement.local, "source": placement.source,
            "coordinate": list(placement.coordinate), "mesh_ranks": mesh_ranks,
            "local_shape": list(local_shape)}


def placement_of(entry: dict) -> tuple[Placement, tuple[int, ...] | None]:
    """The :class:`Placement` of a manifest entry (no mesh) and its mesh's global ranks.

    >>> p, ranks = placement_of(placement_entry(Placement(("S(0)",), (("tp", 2),), None, True,
    ...                                                   "DTensor", (1,)), (3,)))
    >>> p.text, p.coordinate, ranks
    ('S(0)@tp', (1,), None)
    """
    shape = entry.get("global_shape")
    ranks = entry.get("mesh_ranks")
    return (Placement(tuple(entry["placements"]),
                      tuple((str(name), int(size)) for name, size in entry["mesh_dims"]),
                      None if shape is None else tuple(int(s) for s in shape),
                      bool(entry["local"]), str(entry["source"]),
                      tuple(int(c) for c in entry["coordinate"])),
            None if ranks is None else tuple(int(r) for r in ranks))


# -- assembling ------------------------------------------------------------------------
@dataclasses.dataclass
class _Plan:
    """How one key's pieces make its full value: groups of ranks assembled on their mesh."""

    groups: list[list[int]]                  # ranks per mesh group, each in coordinate order
    placements: tuple[str, ...]              # empty: each group is one rank's piece as it is
    coordinates: dict[int, tuple[int, ...]]  # rank -> coordinate on its group's mesh
    problem: str = ""                        # why the pieces cannot be assembled


def _plan(key: str, pieces: dict[int, Record], mesh_ranks: dict[int, Any], ranks: list[int]
          ) -> _Plan:
    holders = sorted(pieces)
    if holders != ranks:
        return _Plan([], (), {}, f"held by rank(s) {_ranks_text(holders)} only, of ranks "
                                 f"{_ranks_text(ranks)}")
    placements = {r: pieces[r].placement for r in holders}
    known = {r: p for r, p in placements.items() if p is not None and p.known}
    if not known:  # no placement (data parallel, unsharded) or unknown: copies must agree
        return _Plan([[r] for r in holders], (), {})
    if len(known) != len(holders):
        return _Plan([], (), {}, f"ranks {_ranks_text(sorted(known))} say where their piece "
                                 f"sits, ranks {_ranks_text(sorted(set(holders) - set(known)))} "
                                 f"do not")
    texts = {(p.placements, p.mesh_dims) for p in known.values()}
    if len(texts) > 1:
        said = "; ".join(f"rank {r}: {p.text} on {p.mesh_dims}" for r, p in known.items())
        return _Plan([], (), {}, f"the ranks place it differently ({said})")
    first = known[holders[0]]
    size = math.prod(n for _, n in first.mesh_dims)
    by_mesh: dict[Any, list[int]] = {}
    for r in holders:
        by_mesh.setdefault(mesh_ranks.get(r) or tuple(holders), []).append(r)
    groups = []
    for members in by_mesh.values():
        coordinates = sorted(known[r].coordinate for r in members)
        expected = sorted(_all_coordinates(first.mesh_dims))
        if len(members) != size or coordinates != expected:
            return _Plan([], (), {}, f"ranks {_ranks_text(members)} hold coordinates "
                                     f"{coordinates} of a mesh {first.describe()} that needs "
                                     f"{size} pieces")
        groups.append(sorted(members, key=lambda r: known[r].coordinate))
    return _Plan(groups, first.placements, {r: known[r].coordinate for r in holders})


def _all_coordinates(mesh_dims) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = [()]
    for _, size in mesh_dims:
        found = [c + (i,) for c in found for i in range(size)]
    return found


def _ranks_text(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


class ShardedRecord(Record):
    """One key of a sharded run: ``value`` is the full tensor, assembled when first read from
    the ranks' pieces (``pieces``: rank -> that rank's :class:`Record`)."""

    def __init__(self, key: str, pieces: dict[int, Record], mesh_ranks: dict[int, Any],
                 ranks: list[int]) -> None:
        first = pieces[min(pieces)]
        self.pieces = pieces
        self.plan = _plan(key, pieces, mesh_ranks, ranks)
        self._assembled = False
        self._problem = self.plan.problem
        self.disagrees = False  # the groups hold different values (see resolve_against)
        self.pooled = False     # statistics pooled over ranks holding different batches
        shape = tuple(first.shape)
        stale = any(p.stale for p in pieces.values())
        stats_only = all(p.value is None for p in pieces.values())
        if not self._problem and not stale:
            try:  # the full shape, from the pieces' shapes alone (no bytes read)
                shape = tuple(self._group_value(self.plan.groups[0], meta=True).shape)
            except (RuntimeError, ValueError) as exc:
                self._problem = f"its pieces do not fit together ({exc})"
        placement = first.placement
        if placement is not None:
            placement = dataclasses.replace(placement, global_shape=shape, coordinate=(),
                                            assembled=True)
        super().__init__(key, first.op, shape, first.dtype, None, first.copied, via=first.via,
                         placement=placement)
        if stale:  # a piece was written in place after its capture: never shown
            self._value, self.version, self._assembled = torch.empty(0, dtype=first.dtype), -1, True
        elif stats_only:  # statistics mode: the full tensor's, from the pieces' summaries
            self._assembled = True
            if not self._problem:
                self.summary, self._problem = self._assemble_stats()
        elif any(p.value is None for p in pieces.values()):
            self._assembled = True
            self._problem = self._problem or (
                f"ranks {_ranks_text(r for r, p in pieces.items() if p.value is None)} saved "
                f"statistics only, the others tensors")

    _value: torch.Tensor | None

    @property
    def value(self) -> torch.Tensor | None:
        if not self._assembled:
            self._value = self._assemble()
            self._assembled = True
        return self._value

    @value.setter
    def value(self, value: torch.Tensor | None) -> None:
        self._value = value

    @property
    def stats(self) -> Stats:
        if self._stats is None:
            if self.problem():
                nan = float("nan")
                self._stats = Stats(nan, nan, nan, nan, nan, 0, math.prod(self.shape))
            else:
                return Record.stats.fget(self)  # type: ignore[attr-defined]
        return self._stats

    def __repr__(self) -> str:
        if self.problem():
            return (f"ShardedRecord({self.key!r}, {self.op}, not assembled from ranks "
                    f"{_ranks_text(sorted(self.pieces))}: {self._problem})")
        return super().__repr__().replace("Record(", "ShardedRecord(", 1)

    def problem(self) -> str:
        """Why the full value cannot be assembled ("" where it can); reads the pieces where
        copies must be compared."""
        _ = self.value
        return self._problem

    def error(self) -> FxdebugError:
        """What reading a key that cannot be assembled raises."""
        if PARTIAL_STATS in self._problem:
            hint = ("instrument with mode='tensor' (the pieces are then summed), or read the "
                    "statistics where the sum is reduced (RowwiseParallel's output)")
        else:
            hint = ("for a tensor-parallel model give the ParallelStyle use_local_output=False, "
                    "or capture the ParallelStyle module's output, so its placement is known")
        return FxdebugError(
            f"the capture of {self.key!r} cannot be assembled from its ranks' pieces: "
            f"{self._problem}. Read each rank's piece with rec.shards({self.key!r}); {hint}.")

    def _group_value(self, group: list[int], meta: bool = False) -> torch.Tensor:
        def piece(rank: int) -> torch.Tensor:
            record = self.pieces[rank]
            if meta:  # the shape of the piece saved (statistics mode: of the piece summarized)
                return torch.empty(record.shape, dtype=record.dtype, device="meta")
            assert record.value is not None  # checked by the caller: statistics-only stop before
            return record.value
        if not self.plan.placements:
            return piece(group[0])
        return assemble({self.plan.coordinates[r]: piece(r) for r in group}, self.plan.placements)

    def _assemble(self) -> torch.Tensor | None:
        if not self._problem:
            values = [self._group_value(group) for group in self.plan.groups]
            if all(same_tensor(value, values[0]) for value in values[1:]):
                return values[0]
            self.disagrees = True
            self._problem = self._disagreement(values, same_tensor)
        return None

    def _disagreement(self, values: list, equal) -> str:
        """Which ranks hold which value, where the groups' values (one per mesh group, or per
        rank) must be equal and are not: no one rank's is shown."""
        by_rank = {r: value for group, value in zip(self.plan.groups, values) for r in group}
        how = ("its placement is unknown (data parallel, or a local tensor)"
               if self.plan.placements == () else "its mesh groups must hold the same value")
        held = agreement_text(by_rank, equal)
        return f"{how}, and the ranks hold {held.count(' | ') + 1} different values: {held}"

    def _assemble_stats(self) -> tuple[torch.Tensor | None, str]:
        """The full tensor's summary from the pieces' (statistics mode), or why none."""
        summaries = {r: p.summary for r, p in self.pieces.items() if p.summary is not None}
        if len(summaries) < len(self.pieces):
            return None, ("statistics without their summaries (saved by an older fxdebug, or a "
                          "gradient missing on some ranks): they cannot be combined")
        values: list[torch.Tensor] = []
        for group in self.plan.groups:
            if not self.plan.placements:
                values.append(summaries[group[0]])
                continue
            coordinates = {self.plan.coordinates[r]: r for r in group}
            names = tuple(name for name, _ in (self.placement.mesh_dims if self.placement
                                               else ()))
            try:
                values.append(assemble_summaries({c: summaries[r] for c, r in coordinates.items()},
                                                 self.plan.placements, coordinates, names))
            except ValueError as exc:
                return None, f"{exc} (ranks {_ranks_text(group)})"
        if all(same_summary(value, values[0]) for value in values[1:]):
            return values[0], ""
        if all(p.placement is None for p in self.pieces.values()):
            # no mesh places it: a data-parallel run, each rank its own batch; the statistics of
            # the global batch are the ranks' merged exactly, whatever dim the batch is split on
            pooled = values[0]
            for value in values[1:]:
                pooled = combine(pooled, value)
            self.pooled = True
            return pooled, ""
        self.disagrees = True
        return None, self._disagreement(values, same_summary)

    def resolve_against(self, other: Record, rtol=None, atol=None
                        ) -> tuple[Resolution, Record] | None:
        """Where the groups hold different values and nothing says how they make the whole
        (:attr:`disagrees`): the layout that holds ``other`` (the other run's full value of this
        key, :mod:`.unknown_placement`), and a Record of the value it assembles; None where no
        layout fits (or ``other`` has no value to test against)."""
        if not self.disagrees:
            return None
        firsts = {group[0]: group for group in self.plan.groups}
        if other.value is not None and all(p.value is not None for p in self.pieces.values()):
            found = resolve({r: self._group_value(g) for r, g in firsts.items()},
                            other.value, rtol, atol)
            if found is None:
                return None
            value, summary = found.value, None
        elif other.summary is not None or other.value is None:
            summaries = {r: p.summary for r, p in self.pieces.items() if p.summary is not None}
            if other.value is not None or len(summaries) < len(self.pieces) \
                    or self.plan.placements:
                return None
            target = other.stats
            rtol_d, atol_d = default_tolerances(self.dtype, other.dtype)

            def close(x: Stats, y: Stats) -> bool:
                return x.nonfinite == y.nonfinite and all(
                    u == v or (math.isnan(u) and math.isnan(v)) or
                    abs(u - v) <= (atol_d if atol is None else atol)
                    + (rtol_d if rtol is None else rtol) * abs(v) for u, v in zip(x[:4], y[:4]))
            stats = resolve_stats({r: summaries[g[0]] for r, g in firsts.items()}, target,
                                  close, stats_from_summary, combine)
            if stats is None:
                return None
            layout, ok, summary, failing = stats
            found = Resolution(layout, ok, None, {}, failing, 0.0, 0.0)
            value = None
        else:
            return None
        found.ranks = tuple(sorted(r for first in found.ranks for r in firsts.get(first, [first])))
        found.errors = {r: e for first, e in found.errors.items() for r in firsts.get(first, [first])}
        shape = tuple(value.shape) if value is not None else tuple(other.shape)
        record = Record(self.key, self.op, shape, self.dtype, value, False, via=self.via,
                        summary=summary)
        return found, record

    def holding_ranks(self, elements: torch.Tensor) -> list[int]:
        """The ranks whose piece holds any of ``elements`` (a bool mask of the full tensor)."""
        found = []
        for group in self.plan.groups:
            for rank in group:
                if not self.plan.placements:
                    found.append(rank)
                    continue
                masks = {self.plan.coordinates[r]: torch.full(
                    tuple(self.pieces[r].shape), r == rank, dtype=torch.bool) for r in group}
                if (assemble(masks, self.plan.placements, masks=True) & elements).any():
                    found.append(rank)
        return sorted(found)


class ShardedRecords(Records):
    """The records of a run saved by several ranks (``path/rank-R``), read in one process:
    ``rec[key]`` is the full value (assembled on first read), ``rec.shards(key)`` every
    rank's piece, ``rec.ranks`` each rank's own records."""

    def __init__(self, path: str, ranks: dict[int, Records], context: dict,
                 mesh_ranks: dict[int, dict], section: str = "records",
                 _of: Records | None = None) -> None:
        first = ranks[min(ranks)]
        super().__init__(first._grads_recorded, _of=_of)
        self.path, self.context, self.ranks = path, context, ranks
        self._parameters_assembled: dict[str, ShardedRecord] | None = None
        order: list[str] = []
        for rank in sorted(ranks):
            order.extend(k for k in ranks[rank].keys() if k not in ranks[min(ranks)] or
                         rank == min(ranks))
        listed = sorted(ranks)
        for key in dict.fromkeys(order):
            pieces = {r: rec.record(key) for r, rec in sorted(ranks.items()) if key in rec}
            self._records[key] = ShardedRecord(
                key, pieces, {r: mesh_ranks.get(r, {}).get((section, key)) for r in pieces},
                listed)
        self.locations = dict(getattr(first, "locations", {}))
        self.notes.extend(dict.fromkeys(f"rank {r}: {note}" for r, rec in sorted(ranks.items())
                                        for note in rec.notes))
        self.step = getattr(first, "step", None)
        if section == "records" and any(rec._grads is not None and len(rec._grads)
                                        for rec in ranks.values()):
            self._grads = ShardedRecords(path, {r: rec._grads if rec._grads is not None
                                                else Records() for r, rec in ranks.items()},
                                         context, mesh_ranks, "grads", _of=self)

    def __getitem__(self, key: str):
        record = self.record(key) if isinstance(key, str) else None
        if isinstance(record, ShardedRecord) and record.problem():
            raise record.error()
        return super().__getitem__(key)

    def shards(self, key: str) -> dict[int, Any]:
        """``{rank: that rank's piece}`` of the capture under ``key`` (statistics mode: the
        piece's :class:`Stats`)."""
        record = self.record(key)
        if not isinstance(record, ShardedRecord):
            raise KeyError(key)
        return {rank: piece.value if piece.value is not None else piece.stats
                for rank, piece in record.pieces.items()}

    def parameter_grads(self) -> list[tuple[str, tuple[int, ...], Stats | None]]:
        """Every parameter gradient's full shape and statistics, from the ranks' pieces
        (a DTensor gradient's assembled by its placement; any other's, checked equal on every
        rank); NaN statistics where they cannot be known (see :meth:`table`)."""
        return [(name, record.shape, record.stats)
                for name, record in self._parameter_records().items()]

    def _parameter_records(self) -> dict[str, ShardedRecord]:
        if self._parameters_assembled is None:
            pieces: dict[str, dict[int, Record]] = {}
            mesh: dict[str, dict[int, Any]] = {}
            for rank, records in sorted(self.ranks.items()):
                saved = getattr(records, "parameter_pieces", {})
                for name, shape, stats in records.parameter_grads():
                    summary, placement, mesh_ranks = saved.get(name, (None, None, None))
                    pieces.setdefault(name, {})[rank] = Record(
                        name, "parameter gradient", shape, torch.float32, None, False,
                        _stats=stats, summary=summary, placement=placement)
                    mesh.setdefault(name, {})[rank] = mesh_ranks
            self._parameters_assembled = {
                name: ShardedRecord(name, by_rank, mesh[name], sorted(self.ranks))
                for name, by_rank in pieces.items()
                if any(p.summary is not None for p in by_rank.values())}
        return self._parameters_assembled

    def table(self, wide: bool | None = None, floatfmt: str = ".4g") -> str:
        """:meth:`Records.table` of the full values, then every key (and parameter gradient)
        whose pieces cannot be assembled, and why."""
        lines = [SHARDED_NOTE if line == PLACEMENT_NOTE else line
                 for line in super().table(wide, floatfmt).split("\n")]
        sections = [("", self), ("grad ", self._grads if self._grads is not None else Records())]
        for prefix, records in sections:
            for record in records.records():
                if isinstance(record, ShardedRecord) and record.problem():
                    lines.append(f"not assembled: {prefix}{record.key}: {record.problem()}")
        for name, record in self._parameter_records().items():
            if record.problem():
                lines.append(f"not assembled: parameter gradient {name}: {record.problem()}")
        return "\n".join(lines)

    def full(self, key: str) -> torch.Tensor:
        """The full value (already assembled: ``rec[key]``)."""
        return self[key]

    def __repr__(self) -> str:
        return (f"ShardedRecords({len(self)} tensors from {self.path}, ranks "
                f"{_ranks_text(sorted(self.ranks))})")


# -- compare_runs ------------------------------------------------------------------------
def unassembled(a: Record, b: Record) -> str:
    """Why a key of two runs cannot be compared because a sharded run cannot assemble it."""
    for name, record in (("a", a), ("b", b)):
        if isinstance(record, ShardedRecord) and record.problem():
            return f"not assembled in run {name}: {record.problem()}"
    return ""


def holding_ranks(entries: list, a: Records, b: Records, rtol, atol) -> list:
    """``entries`` of :func:`compare_runs`, each divergent one with ``ranks``: the ranks whose
    shard holds the differing elements (in either sharded run): those beyond the tolerances,
    or where every element is within them (a reference judged the key), the elements holding
    the largest differences. Entries that already name ranks are kept as they are."""
    out = []
    for entry in entries:
        ra = a.record(entry.key) if entry.key in a else None
        rb = b.record(entry.key) if entry.key in b else None
        sharded = [r for r in (ra, rb) if isinstance(r, ShardedRecord) and not r.problem()]
        # a run that places its pieces says which rank holds what; copies say "every rank"
        sharded = [r for r in sharded if r.plan.placements] or sharded
        if entry.status not in ("differs", "beyond") or entry.ranks or not sharded \
                or ra is None or rb is None or ra.value is None or rb.value is None \
                or tuple(ra.shape) != tuple(rb.shape):
            out.append(entry)
            continue
        va, vb = ra.value, rb.value
        wider = torch.promote_types(va.dtype, vb.dtype)
        va, vb = va.to(wider), vb.to(wider).to(va.device)
        if va.is_floating_point() or va.is_complex():
            rtol_d, atol_d = default_tolerances(ra.dtype, rb.dtype)
            differing = ~torch.isclose(va, vb, rtol=rtol_d if rtol is None else float(rtol),
                                       atol=atol_d if atol is None else float(atol),
                                       equal_nan=True)
            if not bool(differing.any()):
                gap = torch.nan_to_num((va - vb).abs(), nan=0.0)
                differing = gap >= 0.5 * gap.max() if bool((gap > 0).any()) else differing
        else:
            differing = va != vb
        ranks = sorted({r for record in sharded for r in record.holding_ranks(differing)})
        out.append(dataclasses.replace(entry, ranks=tuple(ranks)))
    return out


WRAPPER_PREFIX = "module."  # DistributedDataParallel / DataParallel hold the model as .module


def align_wrapped(a: Records, b: Records) -> tuple[Records, Records]:
    """Runs of a model with and without a DDP wrapper: the wrapped run's keys lose the
    wrapper's ``module.`` (every key of that run has it, no key of the other does).

    >>> from fxdebug.runtime.records import Records
    >>> a, b = Records(), Records()
    >>> a.add("fc", "Linear", torch.ones(1)); b.add("module.fc", "Linear", torch.ones(1))
    >>> [r.keys() for r in align_wrapped(a, b)]
    [['fc'], ['fc']]
    """
    def wrapped(records: Records) -> bool:
        return len(records) > 0 and all(k.startswith(WRAPPER_PREFIX) or k == "module"
                                        for k in records.keys())

    if wrapped(a) == wrapped(b):
        return a, b
    return (_unwrapped(a), b) if wrapped(a) else (a, _unwrapped(b))


def _unwrapped(records: Records) -> Records:
    out = copy.copy(records)
    out._records = {}
    for key, record in records._records.items():
        moved = copy.copy(record)  # the wrapper's own output keeps its key "module"
        moved.key = key[len(WRAPPER_PREFIX):] if key.startswith(WRAPPER_PREFIX) else key
        out._records[moved.key] = moved
    out.locations = {k[len(WRAPPER_PREFIX):] if k.startswith(WRAPPER_PREFIX) else k: v
                     for k, v in getattr(records, "locations", {}).items()}
    if records._grads is not None:
        out._grads = _unwrapped(records._grads) if len(records._grads) else records._grads
    return out
