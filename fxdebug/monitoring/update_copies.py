"""The copy of the parameters that a logged step keeps for its update, in buffers kept between logged steps.

::

    logged step N, mon.step()     each parameter summarized and copied into its buffer in the
                                  same read (copy_to= of fxdebug.stats.moments.summarize_many)
    optimizer.step()              the parameters change
    step N + 1, mon.step()        the update's rows: summaries of parameter - buffer, read
                                  row by row, nothing written (minus=)
    logged step N + every         the same buffers again

The copy lives from a logged step's ``mon.step()`` through the next step's forward and
backward, so keeping its buffers between logged steps adds nothing to the peak memory of
training; it spares the logged step a fresh allocation whose pages the kernel faults in
one by one (on a CPU some 30 ms per 100 MB). ``release()`` (at ``mon.remove()``) frees them.
A buffer holds a DTensor's local piece (what the parameter's summary is of).

>>> copies = UpdateCopies()
>>> w = torch.nn.Parameter(torch.ones(3))
>>> first = copies.buffers([w])
>>> first[0].shape, copies.buffers([w])[0] is first[0]
(torch.Size([3]), True)
>>> tied = copies.buffers([w, w])
>>> tied[0] is tied[1], copies.targets()[1] is None
(True, True)
"""

from __future__ import annotations

import torch

from ..distributed.sharded_replay import local

__all__ = ["UpdateCopies"]


class UpdateCopies:
    """Buffers shaped as the parameters' local pieces, made once and reused; a parameter that
    several modules own (a tied embedding) has one buffer, copied once."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._first: list[bool] = []

    def buffers(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """A buffer per parameter, as its local piece (dtype, shape, strides, device): the
        ones of the last call where they still fit, new ones where not (a parameter moved or
        resharded)."""
        pieces = [local(p).detach() for p in parameters]
        old, seen = self._buffers, dict[int, int]()
        buffers: list[torch.Tensor] = []
        first: list[bool] = []
        for i, (parameter, piece) in enumerate(zip(parameters, pieces)):
            repeat = seen.get(id(parameter))
            if repeat is not None:
                buffers.append(buffers[repeat])
            else:
                seen[id(parameter)] = i
                buffers.append(old[i] if i < len(old) and _fits(old[i], piece)
                               else torch.empty_like(piece))
            first.append(repeat is None)
        self._buffers, self._first = buffers, first
        return buffers

    def targets(self) -> list[torch.Tensor | None]:
        """The buffers of the last :meth:`buffers` call to copy into: None for a repeat."""
        return [b if first else None for b, first in zip(self._buffers, self._first)]

    def release(self) -> None:
        """Free the buffers (the next logged step allocates new ones)."""
        self._buffers, self._first = [], []


def _fits(buffer: torch.Tensor, piece: torch.Tensor) -> bool:
    return buffer.dtype == piece.dtype and buffer.device == piece.device \
        and buffer.shape == piece.shape and buffer.stride() == piece.stride()
