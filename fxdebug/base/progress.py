"""Progress on standard error for work that can take more than a few seconds.

Bars are drawn by ``tqdm`` and only when standard error is a terminal: logs,
pipes, files and tests get nothing, so output stays byte-identical::

    with progress_bar(total=samples, desc="jacobian probes") as bar:
        ...; bar.update(n)

>>> with progress_bar(total=3, desc="work") as bar:  # not a terminal here: a silent bar
...     bar.update(3)
>>> list(progress([1, 2], desc="items"))
[1, 2]
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Iterator

__all__ = ["progress", "progress_bar", "stderr_is_terminal"]


def stderr_is_terminal() -> bool:
    """Whether standard error is an interactive terminal."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "it") -> Iterator:
    """A tqdm bar on stderr when it is a terminal, else an object whose methods do nothing."""
    if not stderr_is_terminal():
        yield _Silent()
        return
    from tqdm import tqdm
    bar = tqdm(total=total, desc=f"fxdebug: {desc}", unit=unit, leave=False, file=sys.stderr,
               dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def progress(iterable: Iterable, desc: str, total: int | None = None, unit: str = "it") -> Iterable:
    """``iterable`` itself, wrapped in a tqdm bar on stderr when stderr is a terminal."""
    if not stderr_is_terminal():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=f"fxdebug: {desc}", total=total, unit=unit, leave=False,
                file=sys.stderr, dynamic_ncols=True)
