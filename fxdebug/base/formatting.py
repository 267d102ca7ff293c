"""How fxdebug writes shapes, dtypes, numbers and places, and which tolerances it compares with.

Every table and message in fxdebug takes its text from here, so the same
shape reads the same everywhere (``1x3x64x64``, ``scalar``), a dtype loses its
``torch.`` prefix, an error prints with 3 significant digits and a source line
is ``path:line``. :data:`TOLERANCES` is ``torch.testing.assert_close``'s own
table (read from torch, see :func:`fxdebug.base.torch_compat.assert_close_tolerances`).
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch

from .torch_compat import assert_close_tolerances

__all__ = ["shape_text", "dtype_text", "tensor_text", "value_text", "format_error", "format_location",
           "TOLERANCES", "default_tolerances"]

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    dtype: pair for dtype, pair in assert_close_tolerances().items()
    if dtype.is_floating_point or dtype.is_complex}
"""``{dtype: (rtol, atol)}``: what ``torch.testing.assert_close`` uses for each floating and
complex dtype (fxdebug compares quantized tensors dequantized; other dtypes exactly)."""


def shape_text(shape) -> str:
    """``1x3x64x64``; ``scalar`` for a 0-d tensor.

    >>> shape_text(torch.Size([1, 3, 64, 64])), shape_text(())
    ('1x3x64x64', 'scalar')
    """
    return "x".join(str(int(size)) for size in shape) or "scalar"


def dtype_text(dtype) -> str:
    """``float32`` for ``torch.float32``.

    >>> dtype_text(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).replace("torch.", "")


def tensor_text(tensor: torch.Tensor) -> str:
    """``2x3 float32``: a tensor's shape and dtype.

    >>> tensor_text(torch.zeros(2, 3)), tensor_text(torch.tensor(1))
    ('2x3 float32', 'scalar int64')
    """
    return f"{shape_text(tensor.shape)} {dtype_text(tensor.dtype)}"


def value_text(value) -> str:
    """A tensor's :func:`tensor_text`, any other value's type name.

    >>> ", ".join(map(value_text, (torch.zeros(2, 3), 1.5)))
    '2x3 float32, float'
    """
    if isinstance(value, torch.Tensor):
        return tensor_text(value)
    return type(value).__name__


def format_error(value: float) -> str:
    """Errors in tables: ``0`` for exact equality, else 3 significant digits.

    >>> format_error(0.0), format_error(1.23456e-7), format_error(math.inf)
    ('0', '1.23e-07', 'inf')
    """
    if value == 0:
        return "0"
    if math.isinf(value):
        return "inf"
    if math.isnan(value):
        return "nan"
    return f"{value:.3g}"


def default_tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` torch.testing.assert_close would use; the loosest over ``dtypes``.

    Integer and bool dtypes compare exactly.

    >>> default_tolerances(torch.float32), default_tolerances(torch.float16, torch.float32)
    ((1.3e-06, 1e-05), (0.001, 1e-05))
    >>> default_tolerances(torch.int64)
    (0.0, 0.0)
    """
    found = [TOLERANCES.get(dtype, (0.0, 0.0)) for dtype in dtypes]
    return max(r for r, _ in found), max(a for _, a in found)


def format_location(location: tuple[str, int] | None, portable: bool = False) -> str:
    """Render ``(filename, lineno)`` as a short ``path:line`` (``?`` when unknown).

    Paths of installed packages are shown relative to their ``site-packages``
    folder, paths under the working directory relative to it, anything else
    in full. ``portable=True`` (what a dumped folder records) never shows
    where a file lives: relative to the ``sys.path`` entry holding it, else
    its base name.

    >>> format_location(("/nowhere/model.py", 12)), format_location(None)
    ('/nowhere/model.py:12', '?')
    >>> site = os.path.dirname(os.path.dirname(torch.__file__))
    >>> format_location((os.path.join(site, "torch", "nn", "modules", "conv.py"), 12), portable=True)
    'torch/nn/modules/conv.py:12'
    >>> format_location(("/nowhere/model.py", 3), portable=True)
    'model.py:3'
    """
    if location is None:
        return "?"
    filename, lineno = location
    shorten = _portable_path if portable else _short_path
    return f"{shorten(filename, os.getcwd(), tuple(sys.path))}:{lineno}"


@functools.lru_cache(maxsize=4096)  # a 10k-node table asks for the same few files thousands of times
def _short_path(filename: str, cwd: str, search_path: tuple) -> str:
    path = os.path.abspath(filename)
    best = ""  # installed packages first: a virtualenv may sit inside the working directory
    for entry in search_path:
        if not entry:
            continue
        root = os.path.abspath(entry) + os.sep
        if path.startswith(root) and len(root) > len(best) and (
                "site-packages" in root or "dist-packages" in root):
            best = root
    if best:
        return path[len(best):]
    cwd = cwd + os.sep
    if path.startswith(cwd):
        return path[len(cwd):]
    return path


@functools.lru_cache(maxsize=1024)
def _portable_path(filename: str, cwd: str, search_path: tuple) -> str:
    """``filename`` relative to its ``search_path`` entry (a graph has few files, many nodes)."""
    path = os.path.abspath(filename)
    best = ""
    for entry in search_path:
        root = os.path.join(os.path.abspath(entry or cwd), "")
        if path.startswith(root) and len(root) > len(best):
            best = root
    relative = path[len(best):] if best else os.path.basename(path)
    return relative.replace(os.sep, '/')
