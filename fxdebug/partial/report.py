"""What a part-by-part model traced, what ran eagerly, and why.

Filled while the model runs (parts are traced on their first call); read it
as ``model.fxdebug_partial`` (``print(model.fxdebug_partial.summary())``).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import TraceFailure
from ..base.report import Report
from ..tracing.keys import join_path
from ..tracing.locations import short_list

__all__ = ["PartialReport", "TracedPart", "EagerModule", "is_partial", "PARTIAL_REPORT_ATTR"]

PARTIAL_REPORT_ATTR = "fxdebug_partial"

# A key/value cache object (transformers' DynamicCache, StaticCache...) named in a reason.
_CACHE = re.compile(r"\b(\w*Cache)\b")


@dataclasses.dataclass(frozen=True)
class TracedPart:
    """A traced part: its label (``path``, ``path@1`` for a second specialisation), path,
    class, the call it is specialised to, the modules it keeps as auto-leaves, and the
    front end that made its graph: ``"fx"`` (symbolic tracing) or ``"export"``
    (``torch.export`` on the call's arguments, after symbolic tracing failed)."""

    label: str
    path: str
    module_type: str
    call: str
    auto_leaves: tuple[str, ...] = ()
    frontend: str = "fx"
    fx_reason: str = ""  # why symbolic tracing did not make the graph (export parts)


@dataclasses.dataclass(frozen=True)
class EagerModule:
    """A module whose ``forward`` ran eagerly, with the explanation of why: ``reason``
    (symbolic tracing) and ``export_reason`` (``torch.export`` on the call's arguments)."""

    path: str
    module_type: str
    kind: str
    location: str | None
    reason: str
    export_reason: str = ""

    @classmethod
    def from_failure(cls, path: str, module: torch.nn.Module, failure: TraceFailure):
        """Keep ``failure``'s explanation, naming modules by their path in the whole model."""
        text = " ".join(str(failure).split())
        if path:
            inner = failure.module_path
            if inner:
                text = text.replace(f"module {inner!r}", f"module {join_path(path, inner)!r}")
            else:
                text = text.replace(f"the root module ({failure.module_type})",
                                    f"module {path!r} ({failure.module_type})", 1)
        return cls(path, type(module).__name__, failure.kind, failure.location, text)


@dataclasses.dataclass(repr=False)
class PartialReport(Report):
    """What a partially traced model traced, what ran eagerly and why; filled as it runs.

    ``parts``: :class:`TracedPart` in the order they were first called;
    ``eager``: :class:`EagerModule` (path ``""`` is the root); ``notes``: why
    whole-model front ends were not used.

    >>> import torch, fxdebug, warnings
    >>> class Twice(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.fc(x) if x.sum() > 0 else -x    # a branch on values
    >>> model = fxdebug.instrument(Twice())
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     _ = model(torch.ones(1, 2))
    >>> print(model.fxdebug_partial.summary().splitlines()[0])
    Twice: partially traced, 0 traced part(s), 1 module(s) eager
    >>> model.fxdebug_partial.eager[0].kind
    'control flow on a traced value'
    """

    model_type: str
    parts: list[TracedPart] = dataclasses.field(default_factory=list)
    eager: list[EagerModule] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """What was traced and what ran eagerly, one line each (byte-identical across runs)."""
        lines = [f"{self.model_type}: partially traced, {len(self.parts)} traced part(s), "
                 f"{len(self.eager)} module(s) eager"]
        lines.extend(f"  note: {note}" for note in self.notes)
        if not self.parts and not self.eager:
            lines.append("  (parts are traced on the first run: run the model once)")
        lines.append("traced parts (GraphModules; keys are full module paths; [fx]: symbolic "
                     "tracing, [export]: torch.export of the call, after fx failed):")
        for part in self.parts:
            leaves = f"; auto-leaves: {', '.join(part.auto_leaves)}" if part.auto_leaves else ""
            lines.append(f"  {part.label or '(root)'} ({part.module_type}) [{part.frontend}] "
                         f"{part.call}{leaves}")
            if part.fx_reason:
                lines.append(f"    fx: {part.fx_reason}")
        lines.append("eager modules (run as Python; their outputs and module calls are captured, "
                     "and with capture='all' their ops):")
        for eager in self.eager:
            lines.append(f"  {eager.path or '(root)'} ({eager.module_type}) [eager]: "
                         f"{eager.reason}")
            if eager.export_reason:
                lines.append(f"    export: {eager.export_reason}")
        lines.extend(f"hint: {hint}" for hint in self.hints())
        return "\n".join(lines)

    def hints(self) -> list[str]:
        """What would let the model trace whole, where the reasons show it (a key/value cache).

        >>> report = PartialReport("GPT2Model", eager=[EagerModule(
        ...     "h.0", "GPT2Block", "", None, "argument 'past_key_values' holds a value of type "
        ...     "DynamicCache, which is neither a tensor, a container of tensors nor a constant")])
        >>> print(report.hints()[0][:60])
        1 module(s) ran eagerly because of a key/value cache (Dynami
        """
        caches = [e for e in self.eager if _CACHE.search(f"{e.reason} {e.export_reason}")]
        if not caches:
            return []
        match = _CACHE.search(f"{caches[0].reason} {caches[0].export_reason}")
        name = match.group(1) if match else "a cache"
        return [f"{len(caches)} module(s) ran eagerly because of a key/value cache ({name}: "
                f"transformers' use_cache=True, the default), which neither symbolic tracing "
                f"nor torch.export takes as an argument or output. Build the model with "
                f"use_cache=False in its config, or call it with use_cache=False, to trace it "
                f"whole."]

    def table(self, wide: bool | None = None) -> str:
        """The same as :meth:`summary`."""
        return self.summary()

    def _size(self) -> str:
        return f"{self.model_type}, {len(self.parts)} traced part(s), {len(self.eager)} eager"

    def _finding(self) -> str:
        if not self.eager:
            return ""
        first = self.eager[0]
        return f"{first.path or '(root)'} ({first.module_type}) eager: {first.kind}"

    def warning_text(self) -> str:
        """One line for the warning; :meth:`summary` has every part and reason in full."""
        eager = short_list([f"{e.path or '(root)'} ({e.module_type}): {e.kind}"
                            for e in self.eager])
        exported = sum(part.frontend == "export" for part in self.parts)
        by_export = f" ({exported} by torch.export)" if exported else ""
        return (f"fxdebug could not trace {self.model_type} as a whole: traced "
                f"{len(self.parts)} part(s){by_export}, ran {len(self.eager)} module(s) eagerly "
                f"({eager}); "
                f"print(model.{PARTIAL_REPORT_ATTR}.summary()) says why."
                + "".join(f" {hint}" for hint in self.hints()))


def is_partial(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a partially traced (or instrumented) model made by fxdebug.

    >>> import torch
    >>> is_partial(torch.nn.Linear(2, 2))
    False
    """
    return isinstance(module.__dict__.get(PARTIAL_REPORT_ATTR), PartialReport)

