"""A dump SIGKILLed at 20 random points: the folder holds the earlier dump or the new one, whole."""

from __future__ import annotations

import os
import random
import signal
import time

import torch
import torchvision

import fxdebug
from fxdebug.dumping.dump import KNOWN
from fxdebug.dumping.writer import prepare_destination
from test_dump_overwrite import _tree, killed_dump

KILLS = 20
X = torch.randn(1, 3, 32, 32)


def _start_dump(gm, folder) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 1
        try:
            torch.set_num_threads(1)
            fxdebug.dump(gm, folder, X, overwrite=True)
            code = 0
        finally:
            os._exit(code)
    return pid


def test_sigkill_at_random_points_loses_nothing_and_leaves_nothing(tmp_path):
    """Half the kills at a random time of the whole dump, half at a random file system change."""
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
    start = time.perf_counter()  # one replacing dump, uncut: how long it takes and its events
    status = killed_dump(models[1], str(dest), lambda event, path: False, X)
    took, events = time.perf_counter() - start, os.WEXITSTATUS(status)
    assert _tree(dest) == refs[1] and events >= 12
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    holds, outcomes = 1, []
    for trial in range(KILLS):
        other = 1 - holds
        if trial % 2:
            at = rng.randrange(1, events + 1)
            counter = iter(range(1, events + 1))
            killed_dump(models[other], str(dest), lambda event, path: next(counter) == at, X)
        else:
            pid = _start_dump(models[other], str(dest))
            time.sleep(rng.uniform(0, took * 1.1))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        done = prepare_destination(str(dest), True, KNOWN)  # what the next dump does first
        assert sorted(os.listdir(work)) == ["resnet18"], (seed, os.listdir(work))
        tree = _tree(dest)
        assert tree in refs, f"seed {seed}: neither the earlier dump nor the new one"
        holds = refs.index(tree)
        outcomes.append("new" if holds == other else "restored" if done else "earlier")
    print(f"seed {seed}, a dump {took:.2f} s and {events} file system changes, kills: {outcomes}")
    assert "new" in outcomes and "earlier" in outcomes, (seed, outcomes)  # kills before and after
    killed_dump(models[1 - holds], str(dest), lambda event, path: False, X)  # a whole dump at last
    assert sorted(os.listdir(work)) == ["resnet18"] and _tree(dest) == refs[1 - holds]
    package = {"__file__": str(dest / "module.py"), "__name__": "dumped_resnet18"}
    exec(compile((dest / "module.py").read_text(), str(dest / "module.py"), "exec"), package)
    with torch.no_grad():
        assert torch.equal(package["load"](str(dest))(X), models[1 - holds](X))
