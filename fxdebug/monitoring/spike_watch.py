"""The monitor's spike check: rules at every ``step()``, a replay when one fires.

Call tree (inside :class:`fxdebug.monitoring.training_monitor.Monitor`, with ``spikes=`` given)::

    model(x)                        every forward under grad: SpikeWatch.begin / end keep
                                    its inputs, RNG state, outputs and their gradients
    mon.step(loss)
      └─ SpikeWatch.check(step, loss, logged)
           ├─ metrics: loss, global gradient norm (one host read of both), the logged
           │   step's series (already read)
           ├─ rules (spikes.py); under torch.distributed one all_reduce (MAX) of the
           │   flag: every rank replays, or none
           ├─ replay_step (replay.py): same dtype and float64, every node captured
           ├─ under torch.distributed: every rank's findings gathered, the lowest rank
           │   holding a finding named
           └─ SpikeReport (spike_report.py), with the keys that moved most before

Cost while nothing fires: a reference to each forward's inputs and outputs and a hook
keeping each output's gradient until ``step()``, the random-number state (a copy of a few
KB), the gradient norm (one pass over the gradients) and one host read per step; under
torch.distributed one small all_reduce per step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch

from ..distributed.rank_group import RankGroup
from ..errors import FxdebugError
from .drift import drift_rows
from .replay import (ReplayFindings, StepForwards, float64_copy, instrument_all,
                     replay_step)
from .spike_report import SpikeReport
from .spikes import NonFinite, Rule
from .statistics import derived, split_slot

__all__ = ["SpikeWatch"]


class _Stopped(FxdebugError):
    """Another rank's replay failed; every rank stops (after the collective that said so)."""

_HISTORY = 20  # logged steps kept for "moved most before the spike"


class SpikeWatch:
    """Rules, the step's forwards, and the replay of a spike (one per monitor)."""

    def __init__(self, target: torch.nn.Module, rules: list[Rule], ranks: RankGroup | None,
                 unpatched: Callable[[], contextlib.AbstractContextManager],
                 averaged: bool = False, loss_key: str | None = "loss") -> None:
        self.target, self.rules, self.ranks = target, rules, ranks
        self._loss_key = loss_key  # the series of step(loss): no module, not "moved"
        self._averaged = averaged and ranks is not None  # DDP: .grad is the ranks' mean
        self.forwards = StepForwards()
        self._unpatched = unpatched
        self._same: torch.nn.Module | None = None
        self._history: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self._sharded = any(hasattr(p, "placements") for p in target.parameters())
        if self._sharded and any(rule.metric in ("grad_norm", "nonfinite") for rule in rules):
            raise FxdebugError(
                "fxdebug.monitor: spike rules on the gradient norm (NonFinite, "
                "Sigma/Factor('grad_norm')) need every parameter's whole gradient; this model's "
                "parameters are DTensor pieces (FSDP2, tensor parallel). Use rules on 'loss' or "
                "on a series ('<key>.<kind>.<stat>') for it.")

    # -- the step's forwards -------------------------------------------------------------

    def begin(self, args: tuple, kwargs: dict):
        return self.forwards.begin(args, kwargs)

    def end(self, entry, out) -> None:
        self.forwards.end(entry, out)

    def remember(self, step: int, rows: Mapping[str, Sequence[float]], params: Mapping) -> None:
        """A logged step's global rows (their rms), for the rules on series and ``moved``."""
        found = self._history.setdefault(step, {})
        for name, row in rows.items():
            key, kind = split_slot(name)
            values = derived(row, params.get(key) if kind == "update" else None)
            for stat, value in values.items():
                found[f"{name}.{stat}"] = value
        while len(self._history) > _HISTORY:
            self._history.popitem(last=False)

    # -- the check -----------------------------------------------------------------------

    def check(self, step: int, loss, logged: bool) -> SpikeReport | None:
        """Evaluate the rules on this step; replay it when one fires."""
        error: BaseException | None = None
        reason: str | None = None
        try:
            reason = self._reason(step, loss, logged)
        except Exception as exc:
            if self.ranks is None:
                raise
            error = exc
        if self.ranks is not None:
            fired = self._agree(reason, error)
            if fired is None:
                self.forwards.clear()
                return None
            reason = fired
        elif reason is None:
            self.forwards.clear()
            return None
        try:
            return self._replay(step, reason)
        finally:
            self.forwards.clear()

    def _reason(self, step: int, loss, logged: bool) -> str | None:
        values = self._metrics(loss)
        if logged:
            values.update(self._history.get(step, {}))
        reasons = []
        for rule in self.rules:
            if isinstance(rule, NonFinite):
                for metric in ("loss", "grad_norm"):
                    if metric in values:
                        found = rule.check(values[metric], metric)
                        if found:
                            reasons.append(found)
                continue
            if rule.metric in values:
                found = rule.check(values[rule.metric])
                if found:
                    reasons.append(found)
        return "; ".join(dict.fromkeys(reasons)) or None

    def _metrics(self, loss) -> dict[str, float]:
        wanted = {rule.metric for rule in self.rules}
        parts, names = [], []
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            parts.append(loss.detach().reshape(()).double())
            names.append("loss")
        elif isinstance(loss, (int, float)):
            parts.append(torch.tensor(float(loss), dtype=torch.float64))
            names.append("loss")
        grads: list[torch.Tensor] = []
        if wanted & {"grad_norm", "nonfinite"} and not self._sharded:
            grads = [p.grad.detach() for p in self.target.parameters() if p.grad is not None]
            if grads:
                parts.append(_grad_norm(grads, None))
                names.append("grad_norm")
        if not parts:
            return {}
        device = parts[0].device
        values = dict(zip(names, torch.stack([p.to(device) for p in parts]).tolist()))
        norm = values.get("grad_norm")
        if norm is not None and not (math.isfinite(norm) and norm > _FLOAT32_TINY_NORM):
            # float32 squares overflowed (|g| > 1e19) or underflowed: the float64 norm
            values["grad_norm"] = float(_grad_norm(grads, torch.float64))
        return values

    def _agree(self, reason: str | None, error: BaseException | None) -> str | None:
        """Every rank learns whether any fired (one small all_reduce); their reasons if so."""
        ranks = self.ranks
        if ranks is None:
            return reason
        device = next(iter(self.target.parameters()), torch.empty(0)).device
        flag = torch.tensor([0.0 if reason is None and error is None else 1.0],
                            device=ranks.backend_device(device))
        ranks.all_reduce(flag, "max")
        if float(flag) == 0.0:
            return None
        said = ranks.gather((reason, None if error is None else repr(error)))
        _stop_if_one_failed(ranks.members, [e for _, e in said], "the spike check", error)
        return "; ".join(f"rank {r}: {text}" for r, (text, _) in zip(ranks.members, said) if text)

    # -- the replay ----------------------------------------------------------------------

    def _replay(self, step: int, reason: str) -> SpikeReport:
        notes: list[str] = []
        findings = None
        error: BaseException | None = None
        if self._sharded:
            notes.append("not replayed: the parameters are DTensor pieces (FSDP2, tensor "
                         "parallel), which the replay does not support yet")
        elif not self.forwards.forwards:
            notes.append("not replayed: no forward of the model ran under grad in this step")
        else:
            try:
                findings = self._replay_here()
            except _Stopped:
                raise
            except Exception as exc:
                if self.ranks is None:
                    raise
                error = exc
        if findings is None:  # what a rank that did not replay says
            findings = ReplayFindings(None, "", None, "", None, 0.0, False, [])
        mine = {**dataclasses.asdict(findings), "notes": notes + findings.notes,
                "error": None if error is None else repr(error)}
        everyone = [mine] if self.ranks is None else self.ranks.gather(mine)
        if error is not None:  # this rank's own error, after the collective that told the others
            raise FxdebugError(f"fxdebug.monitor: the replay of spike step {step} failed on "
                               f"this rank: {error!r}") from error
        rank_ids = [0] if self.ranks is None else self.ranks.members
        _stop_if_one_failed(rank_ids, [e["error"] for e in everyone],
                            f"the replay of spike step {step}", error)
        return _report(step, reason, rank_ids, everyone, self._moved(step),
                       per_rank=self.ranks is not None)

    def _replay_here(self):
        with self._unpatched():
            if self._same is None:
                self._same = instrument_all(self.target)
            with torch.no_grad():
                wide = float64_copy(self.target)
            wide64 = instrument_all(wide)
        self._same.train(self.target.training)
        wide64.train(self.target.training)
        return replay_step(self.target, self.forwards.forwards, self._same, wide64,
                           self._mean_over_ranks if self._averaged else None)

    def _mean_over_ranks(self, grads: list) -> list:
        """The replay's gradients as DistributedDataParallel makes them: every rank's mean.

        First every rank says that its replay got this far (a rank whose replay failed says
        so in the same collective, and every rank stops), then one all_reduce."""
        ranks = self.ranks
        if ranks is None:
            return grads
        said = ranks.gather({"error": None})
        _stop_if_one_failed(ranks.members, [e["error"] for e in said], "the spike replay",
                            kind=_Stopped)
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        flat = torch.cat([g.reshape(-1) for g in present])
        device = ranks.backend_device(flat.device)
        total = flat.to(device)
        ranks.all_reduce(total)
        total = (total / ranks.size).to(flat.device)
        out: list[torch.Tensor | None] = []
        offset = 0
        for grad in grads:
            if grad is None:
                out.append(None)
                continue
            out.append(total[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return out

    def _moved(self, step: int) -> list[tuple[str, float, float, float]]:
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for logged, values in self._history.items():
            if logged >= step:
                continue
            for name, value in values.items():
                if name.endswith(".rms"):
                    key, kind = split_slot(name[:-len(".rms")])
                    if kind in ("out", "grad", "param") and key != self._loss_key:
                        series.setdefault((key, kind), []).append((logged, value))
        rows = drift_rows(series, 5)
        return [(f"{r.key}.{r.kind}.rms", r.first, r.last, r.factor) for r in rows
                if r.first_step != r.last_step]


def _stop_if_one_failed(members: Sequence[int], errors: list, what: str,
                        cause: BaseException | None = None, kind: type = FxdebugError) -> None:
    """Raise on every rank (after the collective that gathered ``errors``, one per rank in
    ``members`` order: None where it went well) when a rank failed, naming it and its error."""
    failed = [(rank, error) for rank, error in zip(members, errors) if error]
    if failed:
        where = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise kind(f"fxdebug.monitor: {what} failed on {where}; every rank stops here.") \
            from cause


_FLOAT32_TINY_NORM = 1e-15  # below it, float32 squares may have lost values to underflow


def _grad_norm(grads: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """The L2 norm of every gradient together, summed in ``dtype`` (None: their own)."""
    norms = [torch.linalg.vector_norm(g, dtype=dtype or (
        torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None)).double()
        for g in grads]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def _report(step: int, reason: str, rank_ids: Sequence[int], everyone: list[dict],
            moved, per_rank: bool) -> SpikeReport:
    def lowest(field: str):
        for rank, entry in zip(rank_ids, everyone):
            if entry[field] is not None:
                return rank, entry
        return rank_ids[0], everyone[0]

    replayed = [e["reproduced"] for e in everyone if e["reproduced"] is not None]
    reproduced = None if not replayed else all(replayed)
    rank_nf, nf = lowest("first_nonfinite")
    rank_div, div = lowest("first_divergence")
    why_entry = next((e for e in everyone if e["reproduced"] is False), everyone[0])
    notes = list(dict.fromkeys(n for e in everyone for n in e["notes"]))
    rank = rank_div if div["first_divergence"] is not None else rank_nf
    ranks = [{"rank": r, "differs": "" if e["reproduced"] is not False else e["reproduced_why"]}
             for r, e in zip(rank_ids, everyone)] if per_rank else []
    return SpikeReport(step=step, trigger=reason, reproduced=reproduced,
                       reproduced_why=why_entry["reproduced_why"],
                       first_nonfinite=nf["first_nonfinite"],
                       first_nonfinite_where=nf["first_nonfinite_where"],
                       first_divergence=div["first_divergence"],
                       divergence_eps=div["divergence_eps"],
                       compared=all(e["compared"] for e in everyone),
                       rank=rank, moved=moved, notes=notes, per_rank=ranks)
