"""A dump is a straight pipeline: measured by the calls a real dump makes, not by reading the code.

A profiler records every call into fxdebug while ``fxdebug.dump`` writes an
instrumented resnet18. Two views of the same calls:

* the pipeline: the modules ``dump()`` itself calls into (fxdebug.dumping's modules, other
  rooms by package), consecutive repeats collapsed. Each step is entered once; the one
  step entered twice is ``writer.py``, by design: it refuses an existing folder before
  any work and writes the folder after it. Any other repeat is data going back to a
  step it already left (an accumulator handed from step to step).
* the rooms (packages, tests/test_layout.py STAGES): every fxdebug call, with the room
  of the nearest fxdebug caller. Calls down (the dump reads keys, source lines, the
  walker) are how layered code works; a call *up* to a higher stage (a callback into
  ``instrument``, which re-traces the model) is the dump climbing back. There must be
  none. torch's own calls into a dispatch mode (``__torch_dispatch__``, made by torch for
  every op of the expected-results run) are torch's, not the dump's, and are not counted;
  nor is a function the caller was handed as an argument for this very call (the
  walker's ``is_leaf`` predicate: DESIGN.md's "pass a callable in instead"). A callback
  kept from earlier that brings the work back up (the mode follower calling
  ``instrument`` to re-trace) counts.

``python tests/test_dump_rooms.py`` prints both views.
"""

from __future__ import annotations

import os
import sys

import torch
import torchvision

import fxdebug
import fxdebug.dumping

from test_layout import _stage  # tests/ is on the path (pyproject's pythonpath, PYTHONPATH)

_TORCH_CALLBACKS = ("__torch_dispatch__", "__torch_function__")


def _room(module: str) -> str:
    return _stage(module)[0]


def _unit(module: str) -> str:
    """A module of fxdebug.dumping, else its room (package)."""
    return module if module.startswith("fxdebug.dumping.") else _room(module)


def _fxdebug_caller(frame):
    caller = frame.f_back
    while caller is not None and not caller.f_globals.get("__name__", "").startswith("fxdebug"):
        caller = caller.f_back
    return caller


def _handed_in(caller, code) -> bool:
    """Whether ``caller`` was given the function it calls as a value (``is_leaf=...``): a predicate
    passed down for this call, as DESIGN.md asks ("pass a callable in instead"), not a climb."""
    return any(getattr(value, "__code__", None) is code for value in caller.f_locals.values())


def measure(gm, folder, *inputs) -> dict:
    """The pipeline, the rooms, and the climbs of ``fxdebug.dump(gm, *inputs, folder=)``."""
    dump = fxdebug.dump  # resolved before: fxdebug's lazy attribute is not part of the dump
    pipeline: list[str] = []
    rooms: list[str] = []
    climbs: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("fxdebug"):
            return
        room = _room(module)
        if not rooms or rooms[-1] != room:
            rooms.append(room)
        caller = frame.f_back
        if caller is not None and caller.f_code is dump.__code__:
            unit = _unit(module)
            if unit != "fxdebug.dumping.pipeline" and (not pipeline or pipeline[-1] != unit):
                pipeline.append(unit)
        caller = _fxdebug_caller(frame)
        if caller is None or frame.f_code.co_name in _TORCH_CALLBACKS:
            return
        caller_module = caller.f_globals["__name__"]
        if _stage(module)[1] > _stage(caller_module)[1] and not _handed_in(caller, frame.f_code):
            climbs.append(f"{caller_module}.{caller.f_code.co_name} -> {module}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        dump(gm, *inputs, folder=folder)
    finally:
        sys.setprofile(None)
    return {"pipeline": pipeline, "pipeline_reentries": _reentries(pipeline), "rooms": rooms,
            "rooms_entered": list(dict.fromkeys(rooms)), "room_reentries": len(_reentries(rooms)),
            "climbs": list(dict.fromkeys(climbs))}


def _reentries(sequence: list[str]) -> list[str]:
    """Each step of ``sequence`` (consecutive repeats collapsed) entered again after it was left."""
    left: set[str] = set()
    again = []
    for previous, current in zip(sequence, sequence[1:]):
        left.add(previous)
        if current in left:
            again.append(current)
    return again


def test_reentries_counts_returns_to_steps_left():
    assert _reentries(["a", "b", "a", "c", "b"]) == ["a", "b"]
    assert _reentries(["a", "b", "c"]) == []


def test_a_dump_goes_through_each_step_once_and_never_climbs(tmp_path):
    torch.manual_seed(0)
    gm = fxdebug.instrument(torchvision.models.resnet18())
    seen = measure(gm, tmp_path / "resnet18", torch.randn(1, 3, 64, 64))
    assert seen["pipeline_reentries"] == ["fxdebug.dumping.writer"], seen["pipeline"]
    assert seen["pipeline"][0] == seen["pipeline"][-1] == "fxdebug.dumping.writer"
    assert seen["climbs"] == []  # e.g. no callback into instrument re-tracing the model
    # it reads only downward: its own room and the rooms below it (never passes or instrument)
    assert set(seen["rooms_entered"]) <= {"fxdebug.dumping", "fxdebug.tracing", "fxdebug.runtime",
                                          "fxdebug.stats", "fxdebug.frontend", "fxdebug.base",
                                          "fxdebug.errors"}, seen["rooms_entered"]


if __name__ == "__main__":
    import tempfile
    torch.manual_seed(0)
    found = measure(fxdebug.instrument(torchvision.models.resnet18()),
                    os.path.join(tempfile.mkdtemp(), "resnet18"), torch.randn(1, 3, 64, 64))
    short = [step.replace("fxdebug.", "") for step in found["pipeline"]]
    print("pipeline:", " -> ".join(short), f"({len(short)} steps, re-entered:",
          [s.replace("fxdebug.", "") for s in found["pipeline_reentries"]], ")")
    print("rooms entered:", [r.replace("fxdebug.", "") for r in found["rooms_entered"]],
          f"({len(found['rooms_entered'])}); room changes: {len(found['rooms'])}, "
          f"re-entries of a room left: {found['room_reentries']}")
    print(f"climbs ({len(found['climbs'])}):", *found["climbs"], sep="\n  ")
