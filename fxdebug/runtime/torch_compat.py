"""Every private torch name fxdebug uses, in one place, each with a public fallback.

fxdebug supports every torch release of the last year (``torch>=2.9``). A
private name (``torch._dynamo``, ``torch.fx.graph_module._forward_from_src``,
``grad_fn._saved_*``, ...) may change in any release, so the rest of the
package never touches one: it calls the functions below. Each says which
private name it reads, the torch versions it was checked on, and what it
does when that name is missing (a public way to the same result, or a
clear "needs torch X" error); ``tests/test_layout.py`` fails on a private
``torch._*`` name anywhere else in the package.

>>> torch_version() >= (2, 9)
True
"""

from __future__ import annotations

import torch

__all__ = ["torch_version"]


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (public ``torch.__version__``).

    >>> isinstance(torch_version()[1], int)
    True
    """
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
