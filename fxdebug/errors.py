"""Exceptions raised by fxdebug.

Every exception says what went wrong, where (module path or node key, and the
user's ``file:line``) and what to do about it. Every warning fxdebug emits is a
:class:`FxdebugWarning`, so one filter silences or escalates fxdebug's warnings
alone::

    FxdebugWarning (UserWarning)
      ├─ EagerFallbackWarning   part of the model runs eagerly, or another front end ran it
      ├─ FidelityWarning        a value or a pass may not be what you asked for
      ├─ PerformanceWarning     the same result, computed a slower way
      └─ FxdebugDeprecationWarning (also a DeprecationWarning) an old spelling that still
                                works for one release; the message names the new one

>>> import warnings
>>> warnings.filterwarnings("error", category=FxdebugWarning)   # fxdebug's only
>>> warnings.resetwarnings()
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, TypeVar

__all__ = ["FxdebugError", "TraceFailure", "SelectionError", "PassEquivalenceError",
           "StaleCaptureError", "SavedRunError", "GraphChangedError", "ReferenceMismatchError",
           "FxdebugWarning", "EagerFallbackWarning", "FidelityWarning", "PerformanceWarning",
           "FxdebugDeprecationWarning"]


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


class FxdebugDeprecationWarning(FxdebugWarning, DeprecationWarning):
    """An old spelling (a name, an argument, a return shape) that still works for one release;
    the message names the new spelling."""


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
    """A saved run (``fxdebug.save_records``, ``instrument(..., folder=)``) that cannot be read
    or written: a missing folder, a truncated or corrupt file, a newer format, a failed write.

    The message names the file and what to do.
    """


class GraphChangedError(FxdebugError, RuntimeError):
    """A diff's code was asked for after its GraphModule changed."""


class ReferenceMismatchError(FxdebugError, ValueError):
    """The reference run is not a run of the same model and input: keys or shapes differ."""


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a name, an argument) is deprecated in favour of ``new``; the old
    spelling keeps working for one release.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     deprecated("f(of=)", "f(output=)")
    >>> print(caught[0].message)
    f(of=) is deprecated and will be removed in the next release; use f(output=).
    """
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}.",
                  FxdebugDeprecationWarning, stacklevel=stacklevel)


_F = TypeVar("_F", bound=Callable[..., Any])


def renamed_arguments(renamed: dict[str, str] | None = None,
                      keyword_only: tuple[str, ...] = ()) -> Callable[[_F], _F]:
    """Decorate a function whose arguments were renamed (``renamed={old: new}``) or made
    keyword-only (``keyword_only``: their names, in their old positional order, after the
    function's positional parameters): the old call still works, with a
    :class:`FxdebugDeprecationWarning` naming the new spelling.

    >>> import warnings
    >>> @renamed_arguments({"of": "output"}, keyword_only=("rtol",))
    ... def f(x, *, output=None, rtol=None):
    ...     return x, output, rtol
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     f(1, 1e-3, of="y")
    (1, 'y', 0.001)
    >>> [str(w.message).split(";")[0] for w in caught]  # each names the new spelling after ";"
    ['rtol by position in f() is deprecated and will be removed in the next release', \
'f(of=) is deprecated and will be removed in the next release']
    """
    renamed = dict(renamed or {})

    def decorate(function: _F) -> _F:
        name = function.__name__
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                         for p in inspect.signature(function).parameters.values())

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if keyword_only and len(args) > positional:
                extra = args[positional:]
                if len(extra) > len(keyword_only):
                    raise TypeError(f"{name}() takes {positional} positional argument(s) "
                                    f"but {len(args)} were given.")
                names = keyword_only[:len(extra)]
                deprecated(f"{', '.join(names)} by position in {name}()",
                           f"{name}({', '.join(f'{n}=' for n in names)}) by keyword")
                for key, value in zip(names, extra):
                    if key in kwargs:
                        raise TypeError(f"{name}() got multiple values for argument {key!r}.")
                    kwargs[key] = value
                args = args[:positional]
            for old, new in renamed.items():
                if old in kwargs:
                    deprecated(f"{name}({old}=)", f"{name}({new}=)")
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {old}= and {new}=; give {new}= "
                                        f"only.")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate
