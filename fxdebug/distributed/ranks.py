"""``compare_ranks``: which rank went out of sync, and at which key.

A collective: every rank of the group calls it with the same kind of object. Ranks
exchange small fingerprints, never tensors, and each builds the same report::

    compare_ranks(obj, group=None)            obj: Records, or a module
      ├─ fingerprints(obj)                    this rank's keys, in execution order
      │    ├─ Records: captures (rec.keys()), then rec.grads in backward order
      │    └─ module (DistributedDataParallel unwrapped): parameters and buffers module
      │         by module, then each parameter's .grad
      │       each: shape, dtype, blake2b of its bytes (bitwise equality), L2 norm,
      │       max|x|, non-finite count; a DTensor (FSDP2): its local shard and the
      │       replicas that must hold the same shard; stats-mode Records: their statistics
      ├─ RankGroup.gather(payload)            one all_gather_object of every rank's list
      └─ _entry(key, fingerprints)            per key: ranks grouped by fingerprint; the
                                              largest group is the majority (a tie: the
                                              group of the lowest rank); the rest differ
           -> RankReport: ok, first_divergence (.key, .ranks), table(), same on every rank

Keys present on some ranks only are merged into one order (each rank's own order
kept), and reported MISSING on the ranks that lack them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from typing import Any

import torch

from ..errors import FxdebugError
from ..runtime import Records
from ..runtime.placement import UNKNOWN_PLACEMENT
from ..base.formatting import dtype_text, format_location, shape_text
from ..tracing.locations import user_location
from .rank_group import RankGroup, local_view, on_ranks, unwrap
from .ranks_report import RankEntry, RankReport, tolerance_text

__all__ = ["compare_ranks", "Fingerprint", "fingerprints"]


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """One key on one rank: what is sent to the other ranks instead of the tensor.

    ``digest`` is a blake2b hash of the tensor's bytes (of its statistics for a
    stats-mode capture; empty where the value cannot be compared, ``state`` says why);
    ``replica`` names the ranks that must hold equal data (see
    :func:`fxdebug.distributed.rank_group.local_view`).
    """

    key: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    digest: str
    norm: float
    max_abs: float
    nonfinite: int
    replica: tuple = ()
    placement: str = ""
    state: str = ""  # "", "stale" (written after its capture), "stats" (statistics only),
    #                  "broadcast" (a buffer DDP copies from rank 0 at every forward)


@dataclasses.dataclass(frozen=True)
class _Payload:
    what: str
    kind: str
    where: str
    fingerprints: tuple[Fingerprint, ...]
    notes: tuple[str, ...] = ()


def _digest(tensor: torch.Tensor) -> str:
    """Hex blake2b (64 bits) of the tensor's bytes, in its memory layout made contiguous."""
    data = tensor.detach()
    if data.layout != torch.strided or data.is_quantized or data.device.type == "meta":
        return ""
    flat = data.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    # an ndarray has the buffer protocol; numpy's stubs do not declare it (typeshed's Buffer)
    return hashlib.blake2b(raw.numpy(), digest_size=8).hexdigest()  # type: ignore[arg-type]


def _numbers(tensor: torch.Tensor) -> torch.Tensor:
    """``[L2 norm, max|x|, non-finite count]`` in float64, on the tensor's device (no read)."""
    x = tensor.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    if x.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=x.device)
    return torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64),
                        x.abs().max().to(torch.float64),
                        (~torch.isfinite(x)).sum().to(torch.float64)])


class _Builder:
    """Fingerprints of one rank, numbers read from each device at once at the end."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.pending: list[tuple[int, torch.Tensor]] = []

    def tensor(self, key: str, kind: str, tensor: torch.Tensor, state: str = "",
               placed=None) -> None:
        local, replica, placement = local_view(tensor)
        if placed is not None and placed.local:  # a TP model's plain tensor: its Record knows
            found = placed.replica_class()
            # unknown: a class of its own on every rank, so never compared
            replica = found if found is not None else (("rank", torch.distributed.get_rank()),)
            placement = placed.text
        self.pending.append((len(self.rows), _numbers(local)))
        self.rows.append(dict(key=key, kind=kind, shape=tuple(tensor.shape),
                              dtype=dtype_text(tensor.dtype), digest=_digest(local),
                              replica=replica, placement=placement, state=state))

    def stats(self, key: str, kind: str, record) -> None:
        stats = record.stats
        packed = struct.pack(f"<{len(stats)}d", *(float(v) for v in stats))
        self.rows.append(dict(key=key, kind=kind, shape=tuple(record.shape),
                              dtype=dtype_text(record.dtype),
                              digest=hashlib.blake2b(packed, digest_size=8).hexdigest(),
                              norm=float(stats.norm), nonfinite=int(stats.nonfinite),
                              max_abs=max(abs(float(stats.min)), abs(float(stats.max))),
                              state="stats"))

    def stale(self, key: str, kind: str, record) -> None:
        nan = float("nan")
        self.rows.append(dict(key=key, kind=kind, shape=tuple(record.shape),
                              dtype=dtype_text(record.dtype), digest="", norm=nan, max_abs=nan,
                              nonfinite=0, state="stale"))

    def finish(self) -> tuple[Fingerprint, ...]:
        by_device: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for index, numbers in self.pending:
            by_device.setdefault(str(numbers.device), []).append((index, numbers))
        for items in by_device.values():
            values = torch.stack([numbers for _, numbers in items]).cpu().tolist()
            for (index, _), (norm, max_abs, nonfinite) in zip(items, values):
                self.rows[index].update(norm=norm, max_abs=max_abs, nonfinite=int(nonfinite))
        return tuple(Fingerprint(**row) for row in self.rows)


def fingerprints(obj) -> tuple[str, tuple[Fingerprint, ...], tuple[str, ...]]:
    """``(what, fingerprints in execution order, notes)`` of a Records or a module, on this rank.

    >>> what, found, _ = fingerprints(torch.nn.Linear(2, 1))
    >>> what, [(f.key, f.kind, f.shape) for f in found]
    ('Linear: parameters, buffers', [('weight', 'parameter', (1, 2)), ('bias', 'parameter', (1,))])
    """
    builder = _Builder()
    notes: list[str] = []
    if isinstance(obj, Records):
        grads = obj.grads
        for records, kind in ((obj, "activation"), (grads, "grad")):
            for key in records.keys():
                record = records.record(key)
                if record.stale:
                    builder.stale(key, kind, record)
                elif record.value is None:
                    builder.stats(key, kind, record)
                else:
                    builder.tensor(key, kind, record.value, placed=record.placement)
        what = f"Records: {len(obj)} captures" + (f", {len(grads)} gradients" if len(grads) else "")
        return what, builder.finish(), tuple(notes)
    module, wrapper = unwrap(obj)
    if wrapper:
        notes.append(f"{wrapper}: the parameters of the module it wraps ({type(module).__name__}), "
                     f"named without the 'module.' prefix")
    broadcast = "broadcast" if getattr(obj, "broadcast_buffers", False) is True else ""
    seen: set[int] = set()
    owned: list[tuple[str, torch.nn.Parameter]] = []
    for prefix, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owned.append((f"{prefix}.{name}" if prefix else name, param))
                builder.tensor(owned[-1][0], "parameter", param)
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                builder.tensor(f"{prefix}.{name}" if prefix else name, "buffer", buffer, broadcast)
    with_grad = [(name, param.grad) for name, param in owned if param.grad is not None]
    for name, grad in with_grad:
        builder.tensor(name, "grad", grad)
    what = f"{wrapper + '(' if wrapper else ''}{type(module).__name__}{')' if wrapper else ''}: " \
           f"parameters, buffers{', gradients' if with_grad else ''}"
    return what, builder.finish(), tuple(notes)


def compare_ranks(obj, group=None, *, rtol: float | None = None,
                  atol: float | None = None) -> RankReport:
    """Compare activations or weights across the ranks of a group: which rank differs, where.

    A collective: every rank of ``group`` calls it (with the same kind of object).
    Each rank hashes its tensors and sends the hashes and norms (never the tensors);
    every rank returns the same :class:`~fxdebug.distributed.ranks_report.RankReport`.

    Args:
        obj: a :class:`fxdebug.Records` (the activations and recorded gradients of one
            forward, e.g. ``fxdebug.records(gm)`` after the same input on every rank),
            or an ``nn.Module`` (its parameters, buffers and ``.grad``, module by module;
            ``DistributedDataParallel`` is unwrapped).
        group: the process group (default: every rank).
        rtol: None compares bits. A float also accepts values whose bits differ but
            whose L2 norm and max|x| agree within ``rtol`` (status ``close``), for
            kernels that are not deterministic.
        atol: with or without ``rtol``: ``|a - b| <= atol + rtol * |b|`` for the norm and
            max|x| (as ``torch.isclose``), for values near zero.

    Returns:
        ``RankReport``: ``ok`` (every key compared and equal); ``verdict_text`` (``EQUAL``,
        ``DIFFERENT``, ``INCOMPLETE`` where some keys have no second copy, e.g. sharded
        parameters, ``NOTHING TO COMPARE`` where none has); ``first_divergence`` (``.key``, ``.kind``, ``.ranks``:
        the ranks that differ from the majority, ``.detail``); ``entries`` (every
        key, in execution order); ``table()``; ``to_dict()``.

    Example (a world of one rank; under ``torchrun`` every rank runs the same)::

        >>> import torch, torch.distributed as dist, fxdebug
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> report = fxdebug.compare_ranks(torch.nn.Linear(2, 2))
        >>> report.verdict_text, report.ok, [e.key for e in report.entries]
        ('NOTHING TO COMPARE', False, ['weight', 'bias'])
        >>> dist.destroy_process_group()
    """
    where = format_location(user_location(sys._getframe(1)))
    if not isinstance(obj, (Records, torch.nn.Module)):
        raise TypeError(f"compare_ranks compares a fxdebug.Records (activations: "
                        f"fxdebug.records(gm) after the same input on every rank) or an "
                        f"nn.Module (parameters, buffers, .grad); got {type(obj).__name__} "
                        f"(at {where}).")
    ranks = RankGroup.of(group, what="fxdebug.compare_ranks", where=where)
    kind = "records" if isinstance(obj, Records) else "module"
    what, found, notes = fingerprints(obj)
    payloads: list[_Payload] = ranks.gather(_Payload(what, kind, where, found, notes))
    kinds = [p.kind for p in payloads]
    if any(k != kinds[0] for k in kinds):
        calls = "; ".join(f"rank {rank}: {p.what} at {p.where}"
                          for rank, p in zip(ranks.members, payloads))
        raise FxdebugError(f"compare_ranks: the ranks passed different kinds of objects ({calls}). "
                           f"Every rank must pass a Records, or every rank a module.")
    import torch.distributed as dist
    report_notes = list(dict.fromkeys(note for p in payloads for note in p.notes))
    indexed = _indexed(payloads)
    tolerance = None if rtol is None and atol is None else (rtol or 0.0, atol or 0.0)
    entries = [_entry(key, kind_, [by.get((key, kind_)) for by in indexed], ranks.members,
                      tolerance)
               for key, kind_ in _merged_order([p.fingerprints for p in payloads])]
    report_notes.extend(_notes(entries, ranks.size))
    return RankReport(what=payloads[0].what, world=ranks.members, entries=entries,
                      backend=str(dist.get_backend(ranks.group)), rtol=rtol, atol=atol,
                      notes=report_notes)


def _indexed(payloads: list[_Payload]) -> list[dict[tuple[str, str], Fingerprint]]:
    return [{(fp.key, fp.kind): fp for fp in payload.fingerprints} for payload in payloads]


def _merged_order(per_rank: list[tuple[Fingerprint, ...]]) -> list[tuple[str, str]]:
    """Every ``(key, kind)`` once: the first rank's order, each other rank's extra keys
    inserted after the key that precedes them on that rank.

    >>> fp = lambda key: Fingerprint(key, "activation", (), "float32", "", 0.0, 0.0, 0)
    >>> [key for key, _ in _merged_order([(fp("a"), fp("d")), (fp("a"), fp("b"), fp("c"), fp("d")),
    ...                                   (fp("x"), fp("a"), fp("d"))])]
    ['x', 'a', 'b', 'c', 'd']
    """
    order: list[tuple[str, str]] = [(fp.key, fp.kind) for fp in per_rank[0]] if per_rank else []
    for fps in per_rank[1:]:
        idents = [(fp.key, fp.kind) for fp in fps]
        if idents == order:
            continue
        known = set(order)
        after: dict[tuple[str, str] | None, list[tuple[str, str]]] = {}
        anchor = None  # the last key of this rank already in the order
        for ident in idents:
            if ident in known:
                anchor = ident
            else:
                known.add(ident)
                after.setdefault(anchor, []).append(ident)
        if after:
            merged = list(after.get(None, []))
            for ident in order:
                merged.append(ident)
                merged.extend(after.get(ident, []))
            order = merged
    return order


def _groups(signatures: list, slots: list[int]) -> list[list[int]]:
    """Slots grouped by equal signature, groups in order of their first slot."""
    groups: dict[Any, list[int]] = {}
    for slot in slots:
        groups.setdefault(signatures[slot], []).append(slot)
    return list(groups.values())


def _majority(groups: list[list[int]]) -> tuple[list[int], bool]:
    """The largest group (the first, i.e. the lowest rank's, on a tie) and whether it tied."""
    best = max(groups, key=len)  # max keeps the first of equal lengths
    return best, sum(len(g) == len(best) for g in groups) > 1


def _number(value: float) -> str:
    return format(value, ".6g")


def _entry(key: str, kind: str, fps: list[Fingerprint | None], world: tuple[int, ...],
           tolerance: tuple[float, float] | None) -> RankEntry:
    present = [fp for fp in fps if fp is not None]
    first = present[0]
    shape, dtype = shape_text(first.shape), first.dtype
    norms = tuple(None if fp is None else fp.norm for fp in fps)

    def make(status, differ=(), majority=(), detail=""):
        return RankEntry(key, kind, shape, dtype, status, tuple(world[s] for s in differ),
                         tuple(world[s] for s in majority), norms, detail, first.placement)

    slots = list(range(len(fps)))
    if len(present) < len(fps):
        best, tie = _majority(_groups([fp is not None for fp in fps], slots))
        differ = [s for s in slots if s not in best]
        missing = [world[s] for s in slots if fps[s] is None]
        text = (f"missing on {on_ranks(missing)}" if fps[differ[0]] is None
                else f"only on {on_ranks(world[s] for s in differ)}")
        return make("missing", differ, best, text + (" (a tie: the lowest rank is the "
                                                     "reference)" if tie else ""))
    every = present  # from here on, every rank has a fingerprint (the same list as fps)
    stale = [s for s in slots if every[s].state == "stale"]
    if stale:
        return make("stale", stale, [], f"written in place after its capture on "
                                        f"{on_ranks(world[s] for s in stale)}: not compared")
    if all(fp.placement == UNKNOWN_PLACEMENT for fp in every) and len(world) > 1 and all(
            (fp.shape, fp.dtype, fp.digest) == (first.shape, first.dtype, first.digest)
            for fp in every):  # placement unknown, yet every rank holds the same bits
        return make("equal", (), slots)
    classes: dict[tuple, list[int]] = {}
    for slot in slots:
        classes.setdefault(every[slot].replica, []).append(slot)
    signatures = [(fp.shape, fp.dtype, fp.digest) for fp in every]
    differ = []
    majority: list[int] = []
    found: list[tuple[str, list[int], list[int], str, bool]] = []  # status, group, best, ...
    for members in classes.values():
        if len(members) < 2:
            continue
        groups = _groups(signatures, members)
        best, tie = _majority(groups)
        majority += best
        for group in groups:
            if group is not best:
                status, detail = _difference(every[best[0]], every[group[0]], tolerance)
                found.append((status, group, best, detail, tie))
                if status != "close":
                    differ += group
    if not majority and first.placement == UNKNOWN_PLACEMENT and len(world) > 1:
        return make("one copy", (), (), "a local tensor whose placement is unknown (tensor "
                                        "parallelism): not compared")
    if not majority:
        return make("one copy", (), (),
                    "a world of one rank: no other copy" if len(world) == 1 else
                    f"sharded ({first.placement or 'DTensor'}): each element on one rank only, "
                    f"nothing to compare")
    if not found:
        return make("equal", (), sorted(majority))
    details = []
    for _, group, best, detail, tie in found:
        against = f"on {on_ranks(world[s] for s in best)}" + (
            " (a tie: the lowest rank is the reference)" if tie else "")
        details.append((f"{on_ranks(world[s] for s in group)}: " if len(found) > 1
                        else "") + f"{detail} {against}")
    status = next(s for s in ("shape", "differs", "close") if any(f[0] == s for f in found))
    if status == "differs" and all(fp.state == "broadcast" for fp in every):
        return make("resynced", sorted(differ), sorted(majority), "; ".join(details))
    return make(status, sorted(differ), sorted(majority), "; ".join(details))


def _difference(ref: Fingerprint, other: Fingerprint,
                tolerance: tuple[float, float] | None) -> tuple[str, str]:
    """``(status, detail)`` of ``other`` against the majority's ``ref`` (their bits differ)."""
    if (other.shape, other.dtype) != (ref.shape, ref.dtype):
        return "shape", (f"{shape_text(other.shape)} {other.dtype} vs {shape_text(ref.shape)} "
                         f"{ref.dtype}")
    detail = (f"norm {_number(other.norm)} vs {_number(ref.norm)}" if _number(other.norm)
              != _number(ref.norm) else f"bits differ, norm {_number(ref.norm)} vs the same")
    if other.max_abs != ref.max_abs:
        detail += f", max|x| {_number(other.max_abs)} vs {_number(ref.max_abs)}"
    if other.nonfinite != ref.nonfinite:
        detail += f", {other.nonfinite} vs {ref.nonfinite} non-finite"
    if tolerance is not None and other.nonfinite == ref.nonfinite and all(
            abs(a - b) <= tolerance[1] + tolerance[0] * abs(b)
            for a, b in ((other.norm, ref.norm), (other.max_abs, ref.max_abs))):
        return "close", detail + f" (within {tolerance_text(*tolerance)})"
    return "differs", detail


def _first(keys: list[str]) -> str:
    return keys[0] + (", ..." if len(keys) > 1 else "")


def _notes(entries: list[RankEntry], size: int) -> list[str]:
    notes = []
    if size == 1:
        notes.append("a world of one rank: nothing to compare against")
    sharded = [e.key for e in entries if e.status == "one copy"]
    if sharded:
        notes.append(
            f"{len(sharded)} sharded tensor(s) ({_first(sharded)}; "
            f"DTensor, e.g. FSDP2's parameters and gradients) hold each element on one rank "
            f"only: there is no second copy to compare, and the full tensor each rank would "
            f"gather is the same one on every rank. Compared instead: replicas of a shard "
            f"(HSDP's replicate dimension), buffers and unsharded parameters, and, with the "
            f"same input on every rank, activations")
    resynced = [e.key for e in entries if e.status == "resynced"]
    if resynced:
        notes.append(f"{len(resynced)} buffer(s) differ ({_first(resynced)}) "
                     f"that DistributedDataParallel(broadcast_buffers=True) copies from rank 0 "
                     f"at the start of every forward: between steps each rank holds its own "
                     f"last update (BatchNorm statistics of its own batch), so they are not "
                     f"counted as out of sync")
    stale = [e.key for e in entries if e.status == "stale"]
    if stale:
        notes.append(f"{len(stale)} stale capture(s) not compared ({_first(stale)}): read "
                     f"fxdebug.records(gm) before anything writes to the model's tensors")
    return notes
