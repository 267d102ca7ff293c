"""The root's forward as torch.fx can trace it when a decorator wraps it in ``(*args, **kwargs)``.

torch.fx reads the root's parameters from the innermost function
(``inspect.unwrap``) but, when that one has ``*args``, ``**kwargs`` or
keyword-only parameters, rewrites the code object of the *outer* one, the
decorator's ``wrapper(self, *args, **kwargs)``, to take that many positional
arguments: ``ValueError: code: co_varnames is too small`` on every Hugging Face
model (``@can_return_tuple``, ``@auto_docstring`` and the output-capturing
decorators wrap each ``forward``).

:func:`named_parameters_forward` gives fx a function with the inner one's named
parameters, all positional-or-keyword with their defaults, that calls the
decorated forward with them (all but the first by keyword, as callers of
Hugging Face models pass them). The decorators
still run while tracing, as in eager; ``*args`` and ``**kwargs`` are left
out: a traced graph takes the named inputs only, as torch.fx's own graphs of
such functions do in practice (``**proxy`` cannot be expanded while tracing).
"""

from __future__ import annotations

import inspect
import keyword
from typing import Callable

__all__ = ["named_parameters_forward", "optional_inputs"]

_WRAPPED = "_fxdebug_decorated_forward"


def named_parameters_forward(fn: Callable, keywords: tuple = ()) -> Callable:
    """``fn``, or a function of ``fn``'s unwrapped named parameters that calls ``fn``.

    A decorated ``fn`` (``__wrapped__``) whose inner function has ``*args``,
    ``**kwargs`` or keyword-only parameters is replaced; so is any ``fn`` given
    ``keywords``: names a call passes through its ``**kwargs``, which become named
    parameters too (after the others), passed on by keyword. Anything else (or a
    signature that cannot be copied) is returned as is.

    >>> import functools
    >>> def inner(self, x, y=2, *, scale=3, **kwargs):
    ...     return (x + y) * scale + kwargs.get("shift", 0)
    >>> @functools.wraps(inner)
    ... def wrapper(self, *args, **kwargs):
    ...     return inner(self, *args, **kwargs)
    >>> shim = named_parameters_forward(wrapper)
    >>> str(inspect.signature(shim)), shim(None, 1)
    ('(self, x, y=2, scale=3)', 9)
    >>> named_parameters_forward(inner) is inner
    True
    >>> shim = named_parameters_forward(inner, keywords=("shift",))
    >>> str(inspect.signature(shim)), shim(None, 1, 2, 3, 4)
    ('(self, x, y=2, scale=3, shift=None)', 13)
    """
    inner = inspect.unwrap(fn)
    if (inner is fn and not keywords) or not hasattr(inner, "__code__"):
        return fn
    try:
        parameters = list(inspect.signature(inner).parameters.values())
    except (TypeError, ValueError):  # no signature to copy: torch.fx's own handling
        return fn
    kinds = inspect.Parameter
    if not keywords and not any(p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD,
                                           kinds.KEYWORD_ONLY) for p in parameters):
        return fn
    named = [p for p in parameters if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    taken = {p.name for p in named}
    if keywords and (not any(p.kind is kinds.VAR_KEYWORD for p in parameters)
                     or any(name in taken for name in keywords)):
        return fn
    named += [kinds(name, kinds.KEYWORD_ONLY, default=None) for name in keywords
              if name.isidentifier()]
    if len(named) != len(taken) + len(keywords) or any(
            keyword.iskeyword(p.name) or p.name == _WRAPPED for p in named):
        return fn
    defaults = [p.default for p in named if p.default is not kinds.empty]
    if any(p.default is kinds.empty for p in named[len(named) - len(defaults):]):
        return fn  # a required keyword-only parameter after defaults: no positional order
    # keywords, as callers of HF models pass them (a decorator may add one itself)
    call = ", ".join(p.name if index == 0 or p.kind is kinds.POSITIONAL_ONLY
                     else f"{p.name}={p.name}" for index, p in enumerate(named))
    source = (f"def {inner.__name__}({', '.join(p.name for p in named)}):\n"
              f"    return {_WRAPPED}({call})\n")
    namespace: dict = {_WRAPPED: fn}
    exec(compile(source, f"<fxdebug: {inner.__qualname__} with named parameters>", "exec"),
         namespace)
    shim = namespace[inner.__name__]
    shim.__defaults__ = tuple(defaults) or None
    shim.__qualname__ = inner.__qualname__
    shim.__module__ = inner.__module__
    shim.__doc__ = inner.__doc__
    return shim


def optional_inputs(fn: Callable) -> list[str]:
    """The parameters of ``fn``'s unwrapped function that default to None (``self`` skipped).

    >>> def forward(self, x, mask=None, *, labels=None, scale=1.0, **kwargs): ...
    >>> optional_inputs(forward)
    ['mask', 'labels']
    """
    try:
        parameters = inspect.signature(inspect.unwrap(fn)).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is None]
