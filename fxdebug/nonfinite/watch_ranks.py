"""``watch_nonfinite`` under ``torch.distributed``: which rank went non-finite, on which step.

Call tree::

    watch(x)                                    every rank, every step
      └─ RankFlags.after_forward(output sum)    under DDP (it averages the gradients): the
                                                outputs' sums in a world-sized vector, an
                                                all_reduce started (async_op), it runs
                                                while the backward does
    watch.check()                               every rank, every step
      └─ RankFlags.flagged(output sum, max|g|)  DDP: wait for that reduce; max|g| of the
           │                                    averaged gradients is the same everywhere.
           │                                    Otherwise: each rank's two numbers in its
           │                                    slots of a 2 x world vector (zeros
           │                                    elsewhere), one all_reduce (SUM: a NaN or
           │                                    Inf stays in its slot). Then one read.
           └─ some slot non-finite, on every rank at once:
              RankFlags.gather_report(watch, flagged)
                ├─ a flagged rank: confirm on the values, replay its own step
                │    (NonfiniteWatch.replay -> find_nonfinite), or the error that stopped it
                ├─ RankGroup.gather(RankFinding)    one all_gather_object, that step only
                └─ RankNonfiniteReport: flagged ranks, the ranks whose own step made the
                   values (their replays found a node), every finding; this rank's replay
              a sharded model (DTensor parameters: FSDP2, tensor parallel), instead:
              RankFlags.replay_together(watch, flagged)
                ├─ OutcomeGroup (distributed/sharded_replay.py): a gloo group of these ranks, made
                │    once, for the replay's own agreement only
                ├─ gather: did any flagged rank confirm on its values?  (else: None)
                ├─ every rank, flagged or not: NonfiniteWatch.replay(lockstep=True), the
                │    same forwards and backwards in the same order (the model's collectives
                │    match), or the error that stopped it
                ├─ gather(RankFinding)
                └─ settle(findings): the earliest hit made the values (forward before
                     backward; by place in the graph, or in backward order); a later hit on
                     another rank received them through a collective of the model

A rank can be flagged without having made the values: DistributedDataParallel
averages gradients, so one rank's NaN gradient reaches every rank. Its own
replay (of the module inside DDP, no collective) is then finite, and the report
says it received them.

>>> finding = RankFinding(1, "outputs", True, "forward", "log", "torch.log", "net.py:12",
...                       "created 2 NaN, 0 Inf of 8")
>>> report = RankNonfiniteReport(step=3, world=(0, 1), flagged=(0, 1), ranks=(1,),
...                              findings=[finding], local=None)
>>> report
<RankNonfiniteReport step 3, 2 ranks, NON-FINITE: made on rank 1: forward log (torch.log, net.py:12)>
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report
from .nonfinite import NonfiniteReport
from ..distributed.rank_group import RankGroup, on_ranks
from ..distributed.sharded_replay import OutcomeGroup
from .watch_report import WatchReport

__all__ = ["RankFlags", "RankFinding", "RankNonfiniteReport"]


@dataclasses.dataclass(frozen=True)
class RankFinding:
    """What one flagged rank found when it replayed its step (plain data, sent between ranks).

    ``made_here``: its own replay found non-finite values (``where`` is ``"forward"``,
    ``"backward"`` or ``"parameter gradient"``; ``key``, ``op``, ``location`` name the
    node); False: its replay was finite, and only its gradients were flagged: they came
    from another rank (``where`` is ``"received"``), or its own outputs were
    (``"not reproduced"``, ``detail`` what its report says), or the replay failed
    (``where`` is ``"replay failed"``, ``detail`` the error). In a sharded model's
    replay every rank has a finding: ``"finite here"`` where its step stayed finite, and
    ``"received"`` for a rank whose values went non-finite only after another rank's had,
    through a collective. ``position``: the hit's place in execution order (forward: in
    the graph; backward: among the gradients, in the order computed), -1 where none.
    """

    rank: int
    nonfinite_in: str
    made_here: bool
    where: str
    key: str = ""
    op: str = ""
    location: str = ""
    detail: str = ""
    position: int = -1

    def describe(self) -> str:
        if self.made_here and self.key:
            return f"{self.where} {self.key} ({self.op}, {self.location})"
        return f"{self.where}{': ' + self.detail if self.detail else ''}"


def _finding(rank: int, nonfinite_in: str, report: NonfiniteReport,
             shared: bool) -> RankFinding:
    if report.forward is not None:
        hit = report.forward
        made = "created" if hit.created else "received from a parameter or input"
        return RankFinding(rank, nonfinite_in, True, "forward", hit.key, hit.op, hit.location,
                           f"{made} {hit.nan} NaN, {hit.inf} Inf of {hit.numel}", hit.position)
    if report.backward is not None:
        back = report.backward
        made = ", ".join(f"{key} ({op}, {where})" for key, op, where in back.made_by)
        return RankFinding(rank, nonfinite_in, True, "backward", back.key, back.op, back.location,
                           f"{back.nonfinite} non-finite of {back.numel} in its gradient"
                           + (f", made by the backward of {made}" if made else ""), back.position)
    if report.parameter_grads:
        name, count, numel = report.parameter_grads[0]
        return RankFinding(rank, nonfinite_in, True, "parameter gradient", name, "parameter",
                           "-", f"{count} non-finite of {numel}")
    if not shared or "outputs" in nonfinite_in:  # its own values: no other rank's reach them
        return RankFinding(rank, nonfinite_in, False, "not reproduced",
                           detail=" ".join(report._finding().split()))
    return RankFinding(rank, nonfinite_in, False, "received",
                       detail="its own step replayed is finite: the values came from another "
                              "rank (a collective, such as DDP's gradient all-reduce)")


class RankFlags:
    """The per-step flag of a distributed watch: one all-reduce, one read.

    Where DistributedDataParallel averages the step's gradients, they are the same on
    every rank, and so is their flag: only the outputs' sums are all-reduced, started
    right after the forward (``async_op``), so the reduction runs while the backward
    does. Elsewhere (no DDP, ``no_sync()``, FSDP2's sharded gradients) check() reduces
    both numbers of every rank at once.
    """

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self._pending: tuple | None = None  # (work, vector) of the outputs' all-reduce
        self.shared_grads = False  # the latest step's gradients were DDP's averages
        self._outcome: OutcomeGroup | None = None  # a sharded model's replays agree there

    def after_forward(self, outputs: torch.Tensor | None, synced: bool) -> None:
        """Start the all-reduce of the outputs' sums when DDP will average the gradients."""
        self._wait()  # a forward whose step was not checked
        if not synced:
            return
        vector = torch.zeros(self.ranks.size, device=self.ranks.backend_device(
            outputs.device if outputs is not None else torch.device("cpu")))
        if outputs is not None:
            vector[self.ranks.slot] = outputs
        self._pending = (self.ranks.all_reduce(vector, async_op=True), vector)

    def _wait(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending[0].wait()
        return pending[1]

    def flagged(self, outputs: torch.Tensor | None, grads) -> list[tuple[int, str]]:
        """``[(rank, "outputs" | "parameter gradients" | both)]`` of every rank whose output
        sum or max|gradient| is non-finite this step, the same list on every rank.

        ``grads``: max|g| as a 0-dim tensor, or (on the CPU) one per gradient, or None."""
        if isinstance(grads, list):  # on the CPU: a number, NaN where one is not finite
            values = [g.item() for g in grads]
            grads = max(values) if all(math.isfinite(v) for v in values) else math.nan
        reduced = self._wait()
        self.shared_grads = reduced is not None
        names = ("outputs", "parameter gradients")
        if reduced is not None:  # the outputs reduced; DDP's gradients are the same everywhere
            read = [reduced] + ([grads.reshape(1).to(reduced)] if isinstance(grads, torch.Tensor)
                                else [])
            values = torch.cat(read).tolist() if len(read) > 1 else reduced.tolist()
            grad_bad = grads is not None and not math.isfinite(
                values[-1] if isinstance(grads, torch.Tensor) else grads)
            per_rank = [(values[slot], math.nan if grad_bad else 0.0)
                        for slot in range(self.ranks.size)]
        else:
            local = [t for t in (outputs, grads) if isinstance(t, torch.Tensor)]
            device = self.ranks.backend_device(local[0].device if local else torch.device("cpu"))
            vector = torch.zeros(2 * self.ranks.size, device=device)
            for index, term in enumerate((outputs, grads)):
                if term is not None:
                    vector[2 * self.ranks.slot + index] = term
            self.ranks.all_reduce(vector)
            values = vector.tolist()  # the one read of the step
            per_rank = [tuple(values[2 * slot:2 * slot + 2]) for slot in range(self.ranks.size)]
        flagged = []
        for rank, numbers in zip(self.ranks.members, per_rank):
            bad = [name for name, value in zip(names, numbers) if not math.isfinite(value)]
            if bad:
                flagged.append((rank, " and ".join(bad)))
        return flagged

    def gather_report(self, watch, flagged: list[tuple[int, str]], loss) -> "RankNonfiniteReport | None":
        """Flagged ranks confirm and replay their step; every rank gathers what they found.
        None on every rank when no flagged rank confirmed (a sum overflowed on finite values)."""
        me = self.ranks.rank
        mine = dict(flagged).get(me)
        finding: RankFinding | None = None
        local: WatchReport | None = None
        error: BaseException | None = None
        if watch.sharded_parameter():
            return self.replay_together(watch, flagged, loss)
        if mine is not None and watch._confirmed():
            try:
                local = watch.replay(loss)
                if self.shared_grads and "outputs" not in mine and not local.reproduced:
                    local.flagged = ""  # averaged gradients, its own step finite: received
                    local.notes.append("only this rank's parameter gradients were flagged, "
                                       "after DDP averaged them over the ranks")
                finding = _finding(me, mine, local, self.shared_grads)
            except Exception as exc:  # the other ranks wait in the gather below: never hang
                error = exc
                finding = RankFinding(me, mine, False, "replay failed",
                                      detail=f"{type(exc).__name__}: {exc}".splitlines()[0])
        found = [f for f in self.ranks.gather(finding) if f is not None]
        if not found:
            return None
        return RankNonfiniteReport(step=watch.steps, world=self.ranks.members,
                                   flagged=tuple(f.rank for f in found),
                                   ranks=tuple(f.rank for f in found if f.made_here),
                                   findings=found, local=local, replay_error=error)


    def replay_together(self, watch, flagged: list[tuple[int, str]],
                        loss) -> "RankNonfiniteReport | None":
        """A sharded model's step: every rank replays it at once, in lockstep (its forward
        and backward run collectives), even a rank whose own step was finite; the ranks
        agree on the outcome in a group of their own (:class:`OutcomeGroup`) before going
        on, so a rank whose replay fails stops none of the others for good."""
        me = self.ranks.rank
        mine = dict(flagged).get(me)
        if self._outcome is None:
            self._outcome = OutcomeGroup.of(self.ranks.members)
        if not any(self._outcome.gather(mine is not None and watch._confirmed())):
            return None  # a sum overflowed on finite values, on every flagged rank
        local: WatchReport | None = None
        error: BaseException | None = None
        try:
            local = watch.replay(loss, lockstep=True)
            finding = _finding(me, mine or "", local, shared=True)
        except Exception as exc:  # the others' collectives time out; they meet us below
            error = exc
            finding = RankFinding(me, mine or "", False, "replay failed",
                                  detail=f"{type(exc).__name__}: {exc}".splitlines()[0])
        found = settle(self._outcome.gather(finding))
        made = tuple(f.rank for f in found if f.made_here)
        notes = []
        if len(made) > 1 and len({f.key for f in found if f.made_here}) == 1:
            notes.append(f"{on_ranks(made)} went non-finite at the same node: each made the "
                         f"values there, or a collective inside that node carried them from one "
                         f"to the others")
        if local is not None and next(f for f in found if f.rank == me).where == "received":
            if not local.reproduced:  # its own step finite: the values came in, as under DDP
                local.flagged = ""
            source = on_ranks(made) if made else "another rank"
            local.received_from = source  # its table then says RECEIVED, never CREATED
            local.notes.append(f"the values were made on {source}; this rank received them "
                               f"through a collective of the model")
        return RankNonfiniteReport(step=watch.steps, world=self.ranks.members,
                                   flagged=tuple(rank for rank, _ in flagged), ranks=made,
                                   findings=found, local=local, replay_error=error, notes=notes)


def settle(findings: list[RankFinding]) -> list[RankFinding]:
    """Which rank made the values, from every rank's lockstep replay of one step.

    Every rank ran the same graph in the same order, and values cross ranks only
    through the model's collectives, after the node that made them: the earliest hit
    (forward before backward, then by ``position``) is where they were made; a later
    hit on another rank received them. A rank whose replay was finite says ``"finite
    here"`` (not flagged) or ``"received"`` (its gradient shard was flagged).

    >>> made = RankFinding(1, "outputs", True, "forward", "log", "torch.log", "n.py:3",
    ...                    position=4)
    >>> later = RankFinding(0, "outputs", True, "forward", "fc2", "Linear", "n.py:4",
    ...                     position=6)
    >>> [(f.rank, f.made_here, f.where) for f in settle([later, made])]
    [(0, False, 'received'), (1, True, 'forward')]
    """
    hits: list[RankFinding] = []
    for where in ("forward", "backward", "parameter gradient"):
        hits = [f for f in findings if f.made_here and f.where == where]
        if hits:
            break
    first = min((f.position for f in hits), default=-1)
    makers = [f for f in hits if f.position == first]
    by = (f"{on_ranks([f.rank for f in makers])} made them at {makers[0].where} "
          f"{makers[0].key} ({makers[0].location})") if makers else ""
    failed = [f for f in findings if f.where == "replay failed" and not _timed_out(f.detail)]
    settled = []
    for f in findings:
        if f in makers:
            settled.append(f)
        elif f.made_here:
            settled.append(dataclasses.replace(
                f, made_here=False, where="received", detail=(
                    f"its first non-finite value, at {f.where} {f.key} ({f.location}), came "
                    f"after {by}: through a collective of the model")))
        elif f.where == "replay failed":
            settled.append(f if not failed or f in failed else dataclasses.replace(
                f, detail=f"{f.detail} (a collective of the replay waited for "
                          f"{on_ranks([g.rank for g in failed])}, whose replay stopped)"))
        elif not f.nonfinite_in:
            settled.append(dataclasses.replace(f, where="finite here",
                                               detail="its own step replayed is finite"))
        elif makers:
            settled.append(dataclasses.replace(f, where="received", detail=(
                f"its own step replayed is finite; {by}, and a collective of the model "
                f"(FSDP2's reduce-scatter, an all-reduce) brought them here")))
        else:
            settled.append(f)
    return settled


def _timed_out(detail: str) -> bool:
    """Whether a replay's error is a collective that waited too long (for a rank that
    had stopped)."""
    text = detail.lower()
    return "timed out" in text or "timeout" in text


@dataclasses.dataclass(repr=False)
class RankNonfiniteReport(Report):
    """The first non-finite step of a distributed watch, on every rank.

    ``flagged``: the ranks whose outputs or parameter gradients were non-finite;
    ``ranks``: those whose own step made them (their replay found a node);
    ``findings``: one :class:`RankFinding` per flagged rank (the same on every rank);
    ``local``: this rank's own replay (a :class:`~fxdebug.NonfiniteReport`, None on a
    rank that was not flagged); ``forward`` / ``backward`` are its hits.
    ``replay_error``: the exception that stopped this rank's replay, if one did.
    """

    verdict_words = ("all finite", "NON-FINITE")

    step: int
    world: tuple[int, ...]
    flagged: tuple[int, ...]
    ranks: tuple[int, ...]
    findings: list[RankFinding]
    local: NonfiniteReport | None
    replay_error: BaseException | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    ok = False  # made only for a step that went non-finite

    @property
    def forward(self):
        return None if self.local is None else self.local.forward

    @property
    def backward(self):
        return None if self.local is None else self.local.backward

    def _size(self) -> str:
        return f"step {self.step}, {len(self.world)} ranks"

    def _finding(self) -> str:
        made = [f for f in self.findings if f.made_here]
        if made:
            return f"made on rank {made[0].rank}: {made[0].describe()}"
        return f"non-finite on {on_ranks(self.flagged)}; no replay found the node"

    def _fields(self) -> dict:
        fields = super()._fields()
        fields["replay_error"] = None if self.replay_error is None else repr(self.replay_error)
        return fields

    def table(self, wide: bool | None = None) -> str:
        """The step, each flagged rank's finding, then this rank's own replay."""
        made = [f for f in self.findings if f.made_here]
        lines = [f"watch_nonfinite: step {self.step} on {on_ranks(self.world)}: non-finite "
                 f"values on {on_ranks(self.flagged)}",
                 f"made on {on_ranks(self.ranks)}" if made else
                 "made on: no rank's replay named a node (see each rank's finding)"]
        rows = [[str(f.rank), f.nonfinite_in, "yes" if f.made_here else "no", f.where,
                 f.key or "-", f.op or "-", f.location or "-", f.detail] for f in self.findings]
        lines.append("")
        lines.append(fit_table(rows, ["rank", "non-finite", "made here", "where", "key", "op",
                                      "source", "detail"], width=table_width(wide),
                               drop=("detail", "op", "non-finite", "made here"),
                               truncate=("key", "op", "source", "detail")))
        if self.local is not None:
            lines.append("")
            lines.append("this rank's replay of its own step:")
            lines.extend("  " + line for line in self.local.table(wide=wide).splitlines())
        elif self.replay_error is not None:
            lines.append(f"this rank's replay failed: {type(self.replay_error).__name__}: "
                         f"{self.replay_error}")
        lines.append("verdict: NON-FINITE values found")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)
