"""The recorders of a partially instrumented model, and the node every traced part starts with.

A model fxdebug traces part by part (:mod:`fxdebug.partial`) has one
:class:`SharedRecorder`; each traced part has a :class:`PartRecorder` that
files its captures there, renaming keys for the part's second, third... call
in a run, as forward hooks counting calls would name them::

    model(x)                                  the part-by-part model
      └─ part(*args)                          a traced part (GraphModule)
           ├─ begin_part(part recorder)       count this call of the part
           └─ capture(part recorder, v, key)  -> SharedRecorder.latest under the
                                                 key for this call (``head.conv_1``)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.node import has_side_effect

from ..errors import FxdebugError
from .compiled_ops import register_recorder
from .nodes import Recorder, begin_run, emit_if_tracing
from .records import Records

__all__ = ["SharedRecorder", "PartRecorder", "begin_part"]


class SharedRecorder(Recorder):
    """The one Recorder of a partially instrumented model (its ``fxdebug_recorder``).

    Counts the calls of each part and eager module within the current
    Records, so repeated calls get keys ``path_1``, ``path_2``...; ``depth``
    is how many dispatched module calls are running (0: none, so the next one
    starts a new Records).

    >>> shared = SharedRecorder()
    >>> [shared.next_call("head.conv") for _ in range(3)]
    [0, 1, 2]
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self._calls: dict[str, int] = {}
        self._calls_of: Records | None = None

    def next_call(self, name: str) -> int:
        """How many times ``name`` was called before in the current Records (and count this one)."""
        if self._calls_of is not self.latest:
            self._calls, self._calls_of = {}, self.latest
        count = self._calls.get(name, 0)
        self._calls[name] = count + 1
        return count

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.update(depth=0, _calls={}, _calls_of=None)
        return state


class _PartRecords:
    """What a part's capture nodes write to: the shared Records, keys renamed for call n."""

    __slots__ = ("records", "part", "call", "_grads")

    def __init__(self, records: Records, part: "PartRecorder", call: int, grads: bool = False):
        self.records, self.part, self.call, self._grads = records, part, call, grads

    def add(self, key: str, op: str, value: Any, **kwargs) -> None:
        target = self.records.grads if self._grads else self.records
        target.add(self.part.rename(key, self.call), op, value, **kwargs)

    def add_tensor(self, key: str, op: str, value: torch.Tensor, clone: bool = False) -> None:
        target = self.records.grads if self._grads else self.records
        target.add_tensor(self.part.rename(key, self.call), op, value, clone)

    def add_grad_stats(self, key: str, op: str, grad: torch.Tensor) -> None:
        """Stats mode's gradient hook (``grads=True``) of a part: the shared Records' own."""
        target = self.records.grads if self._grads else self.records
        target.add_grad_stats(self.part.rename(key, self.call), op, grad)

    def flush_stats(self) -> None:
        """The last capture of a part's forward: the shared Records' pending summaries."""
        self.records.flush_stats()

    @property
    def grads(self) -> "_PartRecords":
        return _PartRecords(self.records, self.part, self.call, grads=True)


class PartRecorder(Recorder):
    """The ``fxdebug_recorder`` of one traced part: files captures in the shared Recorder.

    A part's keys are baked into its graph as full module paths; on the n-th
    call of the part in a run (n > 0) each key ``base`` / ``base_j`` becomes
    ``base_{n*m+j}`` (``m``: calls of ``base`` in one call of the part), the
    name a forward hook counting calls would give it.

    >>> shared = SharedRecorder()
    >>> part = PartRecorder(shared, "head.conv", {"head.conv.0": ("head.conv.0", 0, 1)})
    >>> part.rename("head.conv.0/1", 0), part.rename("head.conv.0/1", 2)
    ('head.conv.0/1', 'head.conv.0_2/1')
    """

    shared: SharedRecorder  # set with object.__setattr__: not a submodule

    def __init__(self, shared: SharedRecorder, path: str, plan: dict | None = None) -> None:
        torch.nn.Module.__init__(self)
        register_recorder(self)  # the id compiled code finds it by
        object.__setattr__(self, "shared", shared)  # not a submodule: the root owns it
        self.path = path
        self.plan = dict(plan or {})
        self.call = 0

    # Recorder.latest is the Records captures go to; a part's is a view of the shared Records
    # that renames keys (add and grads only), and it is never assigned: not a Records subclass
    @property  # type: ignore[override]
    def latest(self) -> _PartRecords:
        return _PartRecords(self.shared.latest, self, self.call)

    @latest.setter
    def latest(self, records: Records) -> None:
        raise FxdebugError(f"the recorder of traced part {self.path!r} has no Records of its "
                           f"own: a run starts on the model's shared recorder "
                           f"(begin_run(part.shared, ...)), which the part's captures go to.")

    def begin_call(self) -> None:
        """A new call of this part: start a run when nothing else did, then count the call."""
        if self.shared.depth == 0:
            begin_run(self.shared, ())
        self.call = self.shared.next_call(self.path)

    def rename(self, key: str, call: int) -> str:
        if call == 0:
            return key
        head, sep, rest = key.partition("/")
        base, local, per_call = self.plan.get(head, (head, 0, 1))
        index = call * per_call + local
        return f"{base if index == 0 else f'{base}_{index}'}{sep}{rest}"

    def extra_repr(self) -> str:
        return f"part={self.path!r}"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["call"] = 0
        state.pop("_per_thread", None)  # added by Recorder.__setstate__ on copies; per process
        return state


@has_side_effect
def begin_part(recorder: Recorder, inputs: tuple):
    """First node of an instrumented part: count this call of the part (a plain Recorder: begin_run)."""
    emitted = emit_if_tracing(begin_part, (recorder, inputs), {})
    if emitted is not None:
        return emitted
    if isinstance(recorder, PartRecorder):
        recorder.begin_call()
    else:
        begin_run(recorder, inputs)
    return None

