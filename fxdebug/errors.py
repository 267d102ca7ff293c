"""Exceptions raised by fxdebug.

Every exception says what went wrong, where (module path or node key, and the
user's ``file:line``) and what to do about it. Every warning fxdebug emits is a
:class:`FxdebugWarning`, so one filter silences or escalates fxdebug's warnings
alone::

    FxdebugWarning (UserWarning)
      ├─ EagerFallbackWarning   part of the model runs eagerly, or another front end ran it
      ├─ FidelityWarning        a value or a pass may not be what you asked for
      └─ PerformanceWarning     the same result, computed a slower way

>>> import warnings
>>> warnings.filterwarnings("error", category=FxdebugWarning)   # fxdebug's only
>>> warnings.resetwarnings()
"""

from __future__ import annotations

__all__ = ["FxdebugError", "TraceFailure", "SelectionError", "PassEquivalenceError",
           "StaleCaptureError", "SavedRunError", "FxdebugWarning", "EagerFallbackWarning", "FidelityWarning",
           "PerformanceWarning"]


class FxdebugWarning(UserWarning):
    """Base class of every warning fxdebug emits.

    >>> import warnings, torch, fxdebug
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", fxdebug.FxdebugWarning)  # silence fxdebug only
    ...     gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    """


class EagerFallbackWarning(FxdebugWarning):
    """Part of the model runs eagerly (an auto-leaf, an untraceable part), or a front end
    other than the one asked for ran it; captures there come from the eager run."""


class FidelityWarning(FxdebugWarning):
    """What fxdebug did may not be what was asked: a pass left nodes as they were, a capture
    could not be placed, a value could not be checked."""


class PerformanceWarning(FxdebugWarning):
    """The same result, computed a slower way (e.g. a compiled kernel was unavailable)."""


class FxdebugError(Exception):
    """Base class of every error fxdebug raises on purpose."""


class SelectionError(FxdebugError, ValueError):
    """A capture selection (keys, globs, depth, mode) that matches nothing or is malformed."""


class TraceFailure(FxdebugError):
    """Symbolic tracing failed; the message names the module, the line and the fix.

    Attributes:
        module_path: dotted path of the module whose ``forward`` failed
            (``""`` for the root module).
        module_type: class name of that module.
        location: ``"file.py:LINE"`` of the failing statement in user code,
            or ``None`` when no user frame was found.
        kind: short description of the failure kind, e.g.
            ``"control flow on a traced value"``.
        fix: the concrete fix, as a sentence.
        auto_leaves: modules that were already turned into leaves before
            this failure (path, reason) pairs.

    Example::

        >>> import torch, fxdebug
        >>> class Branchy(torch.nn.Module):
        ...     def forward(self, x):
        ...         if x.sum() > 0:
        ...             return x
        ...         return -x
        >>> try:
        ...     fxdebug.trace(Branchy())
        ... except fxdebug.TraceFailure as failure:
        ...     print(failure.kind)
        control flow on a traced value
    """

    def __init__(self, message: str, *, module_path: str, module_type: str,
                 location: str | None, kind: str, fix: str,
                 auto_leaves: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.module_path = module_path
        self.module_type = module_type
        self.location = location
        self.kind = kind
        self.fix = fix
        self.auto_leaves = auto_leaves


class PassEquivalenceError(FxdebugError):
    """A pass changed what the module computes; raised by :class:`fxdebug.PassManager`.

    Attributes:
        pass_name: the pass that broke equivalence.
        report: the :class:`~fxdebug.pass_manager.PassReport` up to and
            including that pass (snapshots, diffs, the equivalence report).
    """

    def __init__(self, message: str, *, pass_name: str, report) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.report = report


class StaleCaptureError(FxdebugError):
    """A captured tensor was written in place after its capture, by code fxdebug could not see.

    fxdebug keeps a capture as a view of the model's own tensor where no later
    op in the graph writes to it; the tensor's version counter tells when
    something else did (a forward hook, your code after the forward). The
    capture then no longer shows what the model computed, so it is not shown.

    Attributes:
        key: the capture's key.
    """

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class SavedRunError(FxdebugError):
    """A saved run (``fxdebug.save_records``, ``instrument(..., save_to=)``) that cannot be read
    or written: a missing folder, a truncated or corrupt file, a newer format, a failed write.

    The message names the file and what to do.
    """
