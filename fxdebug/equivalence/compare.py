"""Compare tensors and nested outputs the way ``torch.testing.assert_close`` does, as data.

Nothing here raises on a mismatch: every comparison returns a :class:`Comparison`
(path, verdict, max abs / rel error, what differs), so callers can build tables.
Default tolerances depend on the dtype, as ``torch.testing.assert_close`` picks
them; a structure that does not match (tuple vs dict, another shape, a missing
key) is a mismatch at its path (``out/1/logits``), never an exception from torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..runtime import children
from ..base.formatting import default_tolerances, dtype_text, format_error, shape_text

__all__ = ["Comparison", "compare_tensors", "compare_values"]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One compared value: a tensor, a Python scalar, or a structure mismatch.

    ``max_abs`` / ``max_rel`` are 0.0 for equal values and ``inf`` where the
    values cannot be compared element by element (another shape, a tuple
    against a dict). ``detail`` says what differs besides the numbers.
    """

    path: str
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    shape: str = ""
    dtype: str = ""
    rtol: float = 0.0
    atol: float = 0.0
    mismatched: int = 0
    numel: int = 0
    detail: str = ""

    def describe(self) -> str:
        """One line: ``out/0: shape 1x10 vs 1x5`` or ``out: max abs 0.5, max rel 1 (3/10 ...)``."""
        if self.detail and not math.isfinite(self.max_abs):
            return f"{self.path}: {self.detail}"
        text = (f"{self.path}: max abs {format_error(self.max_abs)}, max rel "
                f"{format_error(self.max_rel)}")
        if self.numel:
            text += (f" ({self.mismatched}/{self.numel} elements beyond rtol="
                     f"{self.rtol:g}, atol={self.atol:g})")
        return text + (f"; {self.detail}" if self.detail else "")


def _type_name(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if value is None:
        return "None"
    return type(value).__name__


def _tolerances(dtypes, rtol, atol) -> tuple[float, float]:
    default_rtol, default_atol = default_tolerances(*dtypes)
    return (default_rtol if rtol is None else float(rtol),
            default_atol if atol is None else float(atol))


def compare_tensors(reference: torch.Tensor, candidate: torch.Tensor, path: str = "out",
                    rtol: float | None = None, atol: float | None = None,
                    equal_nan: bool = False) -> Comparison:
    """Compare ``candidate`` with ``reference`` elementwise, as ``isclose(candidate, reference)``.

    The relative error is taken against the reference. Another shape or
    dtype makes the comparison fail with ``detail`` saying so.

    >>> c = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    >>> c.ok, c.max_abs, c.max_rel, c.mismatched
    (False, 0.5, 0.25, 1)
    >>> compare_tensors(torch.ones(1, 10), torch.ones(1, 5)).describe()
    'out: shape 1x10 vs 1x5'
    """
    ref_dtype, cand_dtype = reference.dtype, candidate.dtype
    rtol, atol = _tolerances((ref_dtype, cand_dtype), rtol, atol)
    common: dict[str, Any] = dict(shape=shape_text(reference.shape), dtype=dtype_text(ref_dtype),
                                  rtol=rtol, atol=atol)
    if tuple(reference.shape) != tuple(candidate.shape):
        return Comparison(path, False, math.inf, math.inf,
                          detail=f"shape {shape_text(reference.shape)} vs "
                                 f"{shape_text(candidate.shape)}", **common)
    ref, cand = _plain(reference), _plain(candidate)
    if cand.device != ref.device:
        cand = cand.to(ref.device)
    work = torch.complex128 if (ref.is_complex() or cand.is_complex()) else torch.float64
    ref, cand = ref.to(work), cand.to(work)
    numel = ref.numel()
    if numel == 0:
        close_all, max_abs, max_rel, mismatched = True, 0.0, 0.0, 0
    else:
        close = torch.isclose(cand, ref, rtol=rtol, atol=atol, equal_nan=equal_nan)
        same = cand == ref  # equal infinities count as equal, as in torch.isclose
        if equal_nan:
            same |= torch.isnan(cand) & torch.isnan(ref)
        diff = torch.where(same, torch.zeros((), dtype=torch.float64, device=ref.device),
                           (cand - ref).abs())
        rel = torch.where(same, torch.zeros((), dtype=torch.float64, device=ref.device),
                          diff / ref.abs())
        diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
        rel = torch.nan_to_num(rel, nan=math.inf, posinf=math.inf)
        max_abs, max_rel = float(diff.max()), float(rel.max())
        mismatched = int(numel - int(close.sum()))
        close_all = mismatched == 0
    detail = ""
    ok = close_all
    if ref_dtype != cand_dtype:
        detail = f"dtype {dtype_text(ref_dtype)} vs {dtype_text(cand_dtype)}"
        ok = False
    return Comparison(path, ok, max_abs, max_rel, mismatched=mismatched, numel=numel,
                      detail=detail, **common)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.is_quantized:
        tensor = tensor.dequantize()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    return tensor


def _items(value: Any) -> tuple[str, list[tuple[str, Any]]] | None:
    """``("sequence"|"mapping", [(name, item), ...])`` for containers (dicts and dataclasses
    compare by key, the rest by position), else None."""
    items = children(value)
    if items is None:
        return None
    keyed = isinstance(value, dict) or (dataclasses.is_dataclass(value) and not isinstance(value, type))
    return ("mapping" if keyed else "sequence"), items


def _members(value: Any) -> list[tuple[Any, Any]]:
    """The ``(name, item)`` pairs of a container (``[]`` for anything else)."""
    found = _items(value)
    return [] if found is None else found[1]


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    found = _items(value)
    if found is not None:
        return found[0]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return "exact"
    if isinstance(value, (int, float, complex)):
        return "number"
    return "other"


def compare_values(reference: Any, candidate: Any, path: str = "out",
                   rtol: float | None = None, atol: float | None = None,
                   equal_nan: bool = False) -> list[Comparison]:
    """Compare two nested outputs; one :class:`Comparison` per tensor, number or mismatch.

    Tuples, lists and namedtuples compare by position (named by field for
    namedtuples), dicts and dataclasses by key. A structure that does not match
    gives one failed comparison naming the path.

    >>> ref = (torch.zeros(2), {"logits": torch.zeros(1, 10)})
    >>> [c.describe() for c in compare_values(ref, (torch.zeros(2), (torch.zeros(1, 10),)))
    ...  if not c.ok]
    ['out/1: dict vs tuple']
    >>> [c.describe() for c in compare_values(ref, (torch.zeros(2), {"logits": torch.zeros(1, 5)}))
    ...  if not c.ok]
    ['out/1/logits: shape 1x10 vs 1x5']
    """
    found: list[Comparison] = []
    _compare(reference, candidate, path, rtol, atol, equal_nan, found)
    return found


def _mismatch(path: str, detail: str) -> Comparison:
    return Comparison(path, False, math.inf, math.inf, detail=detail)


def _compare(ref, cand, path, rtol, atol, equal_nan, found: list[Comparison]) -> None:
    ref_kind, cand_kind = _kind(ref), _kind(cand)
    if ref_kind != cand_kind and not {ref_kind, cand_kind} <= {"number", "exact"}:
        found.append(_mismatch(path, f"{_type_name(ref)} vs {_type_name(cand)}"))
        return
    if ref_kind == "tensor":
        found.append(compare_tensors(ref, cand, path, rtol, atol, equal_nan))
        return
    if ref_kind == "sequence":
        ref_items, cand_items = _members(ref), _members(cand)
        if len(ref_items) != len(cand_items):
            found.append(_mismatch(path, f"{_type_name(ref)} of {len(ref_items)} vs "
                                         f"{_type_name(cand)} of {len(cand_items)}"))
            return
        for (name, ref_item), (_, cand_item) in zip(ref_items, cand_items):
            _compare(ref_item, cand_item, f"{path}/{name}", rtol, atol, equal_nan, found)
        return
    if ref_kind == "mapping":
        ref_items, cand_map = _members(ref), dict(_members(cand))
        for name, ref_item in ref_items:
            if name not in cand_map:
                found.append(_mismatch(f"{path}/{name}", f"missing in the candidate's "
                                                         f"{_type_name(cand)}"))
                continue
            _compare(ref_item, cand_map[name], f"{path}/{name}", rtol, atol, equal_nan, found)
        ref_names = [name for name, _ in ref_items]
        for name in cand_map:
            if name not in ref_names:
                found.append(_mismatch(f"{path}/{name}", f"only in the candidate's "
                                                         f"{_type_name(cand)}"))
        return
    found.append(_compare_scalars(ref, cand, path, rtol, atol, equal_nan))


def _compare_scalars(ref, cand, path, rtol, atol, equal_nan) -> Comparison:
    both_int = isinstance(ref, int) and isinstance(cand, int)
    if _kind(ref) == _kind(cand) == "number" and not both_int:
        rtol, atol = _tolerances((torch.float64,), rtol, atol)
        if ref == cand or (equal_nan and ref != ref and cand != cand):
            return Comparison(path, True, rtol=rtol, atol=atol, dtype=type(ref).__name__)
        diff = abs(cand - ref)
        diff = math.inf if diff != diff else diff
        rel = diff / abs(ref) if ref else math.inf
        return Comparison(path, diff <= atol + rtol * abs(ref), diff, rel, rtol=rtol, atol=atol,
                          dtype=type(ref).__name__, detail=f"{ref!r} vs {cand!r}")
    try:
        equal = bool(ref == cand) and type(ref) is type(cand)
    except Exception as exc:  # an object whose == does not give a bool: say so in the table
        return Comparison(path, False, math.inf, math.inf,
                          detail=f"{_type_name(ref)} values could not be compared: "
                                 f"{type(exc).__name__}: {exc}")
    if equal:
        return Comparison(path, True, dtype=_type_name(ref))
    if type(ref) is not type(cand):
        return _mismatch(path, f"{_type_name(ref)} vs {_type_name(cand)}")
    return _mismatch(path, f"{_short_repr(ref)} vs {_short_repr(cand)}")


def _short_repr(value: Any) -> str:
    text = repr(value)
    if " at 0x" in text:
        return f"<{_type_name(value)}>"  # never print an address
    return text if len(text) <= 40 else text[:37] + "..."
