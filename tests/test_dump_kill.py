"""A dump SIGKILLed at 20 points spread over the whole dump: the folder holds the earlier dump
or the new one, whole. Half the kills come before a file system change, half in the middle of
writing a file (before one of its writes); the points are fixed, so every run kills alike."""

from __future__ import annotations

import os

import torch
import torchvision

import fxdebug
from fxdebug.dumping.pipeline import KNOWN
from fxdebug.dumping.writer import prepare_destination
from test_dump_overwrite import _tree, killed_dump

KILLS = 20
X = torch.randn(1, 3, 32, 32)


def _spread(count: int, total: int) -> list[int]:
    """``count`` event numbers from 1 to ``total``, evenly apart, the first and the last included."""
    return [1 + (index * (total - 1)) // (count - 1) for index in range(count)]


def _events(gm, folder, log) -> list[str]:
    """The kinds of event an uncut dump of ``gm`` into ``folder`` meets, in order."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # os.open: not one of the events

    def note(event, path):
        os.write(fd, f"{event}\n".encode())
        return False

    try:
        status = killed_dump(gm, folder, note, X, writes=True)
    finally:
        os.close(fd)
    assert os.WIFEXITED(status), status
    with open(log) as handle:
        return handle.read().split()


def test_sigkill_at_many_points_loses_nothing_and_leaves_nothing(tmp_path):
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(fxdebug.trace(torchvision.models.resnet18().eval()))
    refs = []
    for index, gm in enumerate(models):  # the ground truth: each dump written without a kill
        # in a forked child too, like the killed dumps: after a fork, backward can fail (autograd's
        # threads, if an earlier test started them), and expected.pt says so in every child alike
        never = killed_dump(gm, str(tmp_path / f"ref{index}"), lambda event, path: False, X)
        assert os.WIFEXITED(never), never
        refs.append(_tree(tmp_path / f"ref{index}"))
    assert refs[0]["weights.pt"] != refs[1]["weights.pt"]
    work = tmp_path / "work"
    work.mkdir()
    dest = work / "resnet18"
    killed_dump(models[0], str(dest), lambda event, path: False, X)
    assert _tree(dest) == refs[0]
    events = _events(models[1], str(dest), tmp_path / "events")  # one replacing dump, uncut
    assert _tree(dest) == refs[1]
    changes, writes = len([e for e in events if e != "write"]), events.count("write")
    assert changes >= 12 and writes >= 12, events
    # (kind of event counted, its number): kills alternate between the two kinds
    points = [("change", at) for at in _spread(KILLS // 2, changes)]
    points = [point for pair in zip(points, [("write", at) for at in _spread(KILLS // 2, writes)])
              for point in pair]
    holds, outcomes = 1, []
    for kind, at in points:
        other = 1 - holds
        counter = iter(range(1, len(events) + 1))

        def when(event, path, kind=kind, at=at, counter=counter):
            return ((event == "write") == (kind == "write")) and next(counter) == at

        killed_dump(models[other], str(dest), when, X, writes=kind == "write")
        done = prepare_destination(str(dest), True, KNOWN)  # what the next dump does first
        assert sorted(os.listdir(work)) == ["resnet18"], (kind, at, os.listdir(work))
        tree = _tree(dest)
        assert tree in refs, f"killed before {kind} {at}: neither the earlier dump nor the new one"
        holds = refs.index(tree)
        outcomes.append("new" if holds == other else "restored" if done else "earlier")
    assert "new" in outcomes and "earlier" in outcomes, list(zip(points, outcomes))
    killed_dump(models[1 - holds], str(dest), lambda event, path: False, X)  # a whole dump at last
    assert sorted(os.listdir(work)) == ["resnet18"] and _tree(dest) == refs[1 - holds]
    package = {"__file__": str(dest / "module.py"), "__name__": "dumped_resnet18"}
    exec(compile((dest / "module.py").read_text(), str(dest / "module.py"), "exec"), package)
    with torch.no_grad():
        assert torch.equal(package["load"](str(dest))(X), models[1 - holds](X))
