"""Summaries with a third and fourth moment: what the training monitor merges across steps and ranks.

A *moment summary* is the 8 numbers of :func:`fxdebug.stats.summary.summarize`
followed by two more, ten float64 numbers on the tensor's device::

    count, mean, M2, min, max, zeros, non-finite, numel, M3, M4

``M3`` and ``M4`` are the sums of the cubed and fourth powers of the deviations
from the mean, over the finite values (kurtosis is ``count * M4 / M2**2``). The
first eight are the statistics of :func:`~fxdebug.stats.summary.summarize`, in its
layout, so an 8-number summary (stats mode, saved runs) stays what it was (on the
CPU a dense float32, float16 or bfloat16 tensor takes one C call,
:func:`~fxdebug.stats.native.moments`, that reads its memory once and gives
all ten, ``M2`` summed about each row's mean: equal to the 8-number kernel's to
rounding, M3 and M4 within 1e-7 of float64's); :func:`combine_moments`
merges two moment summaries exactly (Pébay's formulas, as Chan's for ``M2``), so
the statistics of several micro-batches or ranks are those of their values
together. Nothing is read back to the host here (the CPU's 8-number summary
aside, which reads as it goes).

>>> s = summarize_moments(torch.tensor([1.0, 2.0, 3.0, 10.0]))
>>> [round(v, 4) for v in s.tolist()]
[4.0, 4.0, 50.0, 1.0, 10.0, 0.0, 0.0, 4.0, 180.0, 1394.0]
"""

from __future__ import annotations

import torch

from .summary import _local_piece, combine, summarize
from .native import fills_memory, moments as native_moments, moments_many

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

__all__ = ["MOMENT_COLUMNS", "summarize_moments", "summarize_many", "combine_moments",
           "pool_moments"]

MOMENT_COLUMNS = ("count", "mean", "m2", "min", "max", "zeros", "nonfinite", "numel", "m3", "m4")
"""The ten numbers of a moment summary, in order."""

_SMALL = 1 << 16  # values summed in float64 directly (its range holds their fourth powers)
_DOT_CHUNK = 1 << 16  # values per dot product on the CPU (float64 there; float32 rounding: below)
_DOT_CHUNK_CUDA = 1 << 22  # on a GPU (a tree reduction; fewer kernel launches)


def summarize_moments(tensor: torch.Tensor) -> torch.Tensor:
    """The moment summary of ``tensor``: a float64 tensor of 10 on its device.

    A DTensor gives its local piece's, as :func:`~fxdebug.stats.summary.summarize`.

    >>> [round(v, 4) for v in summarize_moments(torch.tensor([0.0, 2.0])).tolist()]
    [2.0, 1.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0, 0.0, 2.0]
    """
    tensor = _local_piece(tensor).detach()
    if tensor.is_cpu and tensor.numel():
        whole = native_moments(tensor)  # one read of the memory; None: not dense float, a NaN
        if whole is None and tensor.dtype in _NATIVE_DTYPES and type(tensor) in _PLAIN \
                and tensor.layout == torch.strided and not fills_memory(tensor):
            whole = native_moments(tensor.contiguous())  # a transposed or strided view
        if whole is not None:
            return whole
    base = summarize(tensor)
    values = tensor
    if values.is_complex():
        values = values.abs()
    plain = values.layout == torch.strided and not values.is_quantized and not values.is_meta
    if not plain or values.numel() == 0:
        nan = torch.full((2,), float("nan"), dtype=torch.float64, device=base.device)
        return torch.cat([base, nan])
    flat = values.reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)
    m3, m4 = _central_moments_34(flat, base.to(flat.device))
    return torch.cat([base, torch.stack([m3, m4]).to(base.device)])


def summarize_many(tensors: list[torch.Tensor], *, minus: list[torch.Tensor] | None = None,
                   copy_to: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """:func:`summarize_moments` of each tensor (the CPU's dense float tensors from one call
    of the C kernel for all of them; the others one by one).

    ``minus``: the summaries of ``tensors[i] - minus[i]`` (a DTensor's local pieces); where
    the kernel does not take the difference, it is made into ``minus[i]``, which then holds
    it. ``copy_to``: on return ``copy_to[i]`` holds ``tensors[i]``'s (local) values, copied
    as they are summed where the kernel reads them (None: no copy of that one).

    >>> rows = summarize_many([torch.tensor([1.0, 3.0]), torch.tensor([0.0, 2.0]).double()])
    >>> [row[:2].tolist() for row in rows]
    [[2.0, 2.0], [2.0, 1.0]]
    >>> before = torch.tensor([1.0, 1.0])
    >>> summarize_many([torch.tensor([2.0, 4.0])], minus=[before])[0][:2].tolist()
    [2.0, 2.0]
    """
    detached = [_local_piece(tensor).detach() for tensor in tensors]
    kept = None if minus is None else [_local_piece(t).detach() for t in minus]
    found = moments_many(detached, minus=kept, copy_to=copy_to)
    if kept is not None:
        return [row if row is not None else summarize_moments(
            torch.sub(tensor, before, out=before) if before.shape == tensor.shape
            and before.dtype == tensor.dtype and before.device == tensor.device
            else tensor - before) for row, tensor, before in zip(found, detached, kept)]
    return [row if row is not None else summarize_moments(tensor)
            for row, tensor in zip(found, detached)]


def _central_moments_34(flat: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``M3`` and ``M4`` of the finite values of ``flat`` (1-D, floating) given its 8-number
    summary. Up to ``_SMALL`` values: in float64 at once. Larger tensors: one pass of dot
    products, chunk by chunk, summed in float64: in float64 on the CPU, elsewhere in the
    value's precision (float32 for float32, float16 and bfloat16).

    The deviations are taken from ``c``, the mean rounded to that precision (``x - c`` is
    exact for values near the mean), and scaled by ``1 / max |x - c|`` so that their fourth
    powers can neither overflow nor lose the largest terms; the sums about ``c`` become sums
    about the mean exactly, with ``delta = mean - c`` (known in float64)::

        M3 = S3 - 3 delta S2 + 2 n delta**3
        M4 = S4 - 4 delta S3 + 6 delta**2 S2 - 3 n delta**4,   S2 = M2 + n delta**2

    Chunks of ``_DOT_CHUNK`` values keep each float32 dot's rounding near 1e-6 of its terms
    (measured: M4 within 2.5e-6 of float64 for normal, shifted and log-normal values).
    """
    masked = flat.is_cuda or bool(base[6] > 0)  # a NaN or Inf among the values (CPU: read here)
    if flat.numel() <= _SMALL:  # float64 at once: a few ops (a call's cost is its Python here)
        values = flat.to(torch.float64)
        deviation = values - base[1]
        if masked:
            deviation = torch.where(torch.isfinite(values), deviation, 0.0)
        squared = deviation * deviation
        return torch.dot(squared, deviation), torch.dot(squared, squared)
    # float32 dots on a GPU; the CPU comes here only where its C kernel declines (a NaN or an
    # Inf, a float32 overflow, float64, no C compiler): float64 chunks there, as exact as float64
    work = torch.float64 if flat.dtype == torch.float64 or flat.is_cpu else torch.float32
    count, mean, m2, low, high = base[0], base[1], base[2], base[3], base[4]
    some = count > 0
    center = torch.where(some, mean, 0.0).to(work)
    delta = torch.where(some, mean - center.to(torch.float64), 0.0)
    spread = torch.maximum((high - center.double()).abs(), (low - center.double()).abs())
    spread = torch.where(some & (spread > 0) & torch.isfinite(spread), spread, 1.0)
    inverse = (1.0 / spread).to(work)
    s3 = torch.zeros((), dtype=torch.float64, device=flat.device)
    s4 = torch.zeros((), dtype=torch.float64, device=flat.device)
    step = _DOT_CHUNK_CUDA if flat.is_cuda else _DOT_CHUNK
    for begin in range(0, flat.numel(), step):
        part = flat[begin:begin + step].to(work)
        deviation = torch.sub(part, center).mul_(inverse)
        if masked:
            deviation = torch.where(torch.isfinite(part), deviation, 0.0)
        squared = deviation * deviation
        s3 = s3 + torch.dot(squared, deviation).to(torch.float64)
        s4 = s4 + torch.dot(squared, squared).to(torch.float64)
    s3, s4 = s3 * spread ** 3, s4 * spread ** 4
    s2 = torch.where(some, m2, 0.0) + count * delta * delta
    m3 = s3 - 3.0 * delta * s2 + 2.0 * count * delta ** 3
    m4 = s4 - 4.0 * delta * s3 + 6.0 * delta * delta * s2 - 3.0 * count * delta ** 4
    return m3, m4


def combine_moments(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The moment summary of two tensors' values together (rows of stacked summaries merge too).

    >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 10.0])
    >>> both = combine_moments(summarize_moments(a), summarize_moments(b))
    >>> whole = summarize_moments(torch.cat([a, b]))
    >>> torch.allclose(both, whole)
    True
    """
    second = second.to(first.device)
    base = combine(first[..., :8], second[..., :8])
    n_a, n_b = first[..., 0], second[..., 0]
    n = (n_a + n_b).clamp(min=1)
    some_a, some_b = n_a > 0, n_b > 0
    mean_a = torch.where(some_a, first[..., 1], 0.0)
    mean_b = torch.where(some_b, second[..., 1], 0.0)
    m2_a = torch.where(some_a, first[..., 2], 0.0)
    m2_b = torch.where(some_b, second[..., 2], 0.0)
    m3_a = torch.where(some_a, first[..., 8], 0.0)
    m3_b = torch.where(some_b, second[..., 8], 0.0)
    m4_a = torch.where(some_a, first[..., 9], 0.0)
    m4_b = torch.where(some_b, second[..., 9], 0.0)
    delta = mean_b - mean_a
    d2 = delta * delta
    m3 = (m3_a + m3_b + d2 * delta * n_a * n_b * (n_a - n_b) / (n * n)
          + 3.0 * delta * (n_a * m2_b - n_b * m2_a) / n)
    m4 = (m4_a + m4_b + d2 * d2 * n_a * n_b * (n_a * n_a - n_a * n_b + n_b * n_b) / (n * n * n)
          + 6.0 * d2 * (n_a * n_a * m2_b + n_b * n_b * m2_a) / (n * n)
          + 4.0 * delta * (n_a * m3_b - n_b * m3_a) / n)
    return torch.cat([base, torch.stack([m3, m4], dim=-1)], dim=-1)


def pool_moments(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Consecutive moment summaries pooled, ``lengths[i]`` rows into row ``i``: a fixed
    number of ops for any number of groups (what :func:`combine_moments` gives, merged in one
    step about each group's mean; a group of no value gives a row of no value).

    >>> a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 10.0]), torch.tensor([5.0])
    >>> rows = torch.stack([summarize_moments(t) for t in (a, b, c)])
    >>> pooled = pool_moments(rows, [2, 1])
    >>> torch.allclose(pooled[0], summarize_moments(torch.cat([a, b])))
    True
    >>> torch.equal(pooled[1], rows[2])
    True
    """
    device = rows.device
    groups = len(lengths)
    if all(length == 1 for length in lengths):
        return rows
    sizes = torch.tensor(lengths, device=device)
    index = torch.repeat_interleave(torch.arange(groups, device=device), sizes)
    count = rows[:, 0]
    some = count > 0
    mean = torch.where(some, rows[:, 1], 0.0)
    m2, m3, m4 = (torch.where(some, rows[:, column], 0.0) for column in (2, 8, 9))
    zero = rows.new_zeros(groups)
    total = zero.index_add(0, index, count)
    safe = total.clamp(min=1)
    center = zero.index_add(0, index, count * mean) / safe
    delta = torch.where(some, mean - center[index], 0.0)
    d2 = delta * delta
    pooled_m2 = zero.index_add(0, index, m2 + count * d2)
    pooled_m3 = zero.index_add(0, index, m3 + 3.0 * delta * m2 + count * d2 * delta)
    pooled_m4 = zero.index_add(0, index, m4 + 4.0 * delta * m3 + 6.0 * d2 * m2 + count * d2 * d2)
    low = zero.scatter_reduce(0, index, rows[:, 3], "amin", include_self=False)
    high = zero.scatter_reduce(0, index, rows[:, 4], "amax", include_self=False)
    sums = rows.new_zeros(groups, 3).index_add(0, index, rows[:, 5:8])
    pooled = torch.stack([total, center, pooled_m2, low, high, sums[:, 0], sums[:, 1],
                          sums[:, 2], pooled_m3, pooled_m4], dim=1)
    first = torch.cumsum(sizes, 0) - sizes  # a group of one row: that row, bit for bit
    return torch.where((sizes == 1)[:, None], rows[first.clamp(max=len(rows) - 1)], pooled)
