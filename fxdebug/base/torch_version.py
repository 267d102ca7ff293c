"""Which torch is running, and a clear error where a feature needs a newer one (public names only).

>>> torch_version() >= MINIMUM_TORCH
True
"""

from __future__ import annotations

import torch

from ..errors import FxdebugError

__all__ = ["MINIMUM_TORCH", "torch_version", "require_torch"]

MINIMUM_TORCH = (2, 9)
"""The oldest torch fxdebug supports: every release of the last year (pyproject.toml agrees)."""


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (public ``torch.__version__``).

    >>> isinstance(torch_version()[1], int)
    True
    """
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def require_torch(minimum: tuple[int, int], feature: str) -> None:
    """Raise an error naming ``feature`` and the torch it needs when the running one is older.

    >>> require_torch(MINIMUM_TORCH, "fxdebug")
    >>> require_torch((99, 0), "time travel")
    Traceback (most recent call last):
    fxdebug.errors.FxdebugError: time travel needs torch 99.0 or newer, this is torch ...: pip install "torch>=99.0"
    """
    if torch_version() < minimum:
        need = ".".join(map(str, minimum))
        raise FxdebugError(f"{feature} needs torch {need} or newer, this is torch "
                           f"{torch.__version__}: pip install \"torch>={need}\"")
