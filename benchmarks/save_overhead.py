"""Peak memory and time of capturing every node: eager vs in memory vs streamed to disk.

Model: torchvision resnet50 (random weights, eval, CPU), one forward under
``torch.no_grad()`` per repeat; variants:

1. ``eager``: the model itself;
2. ``memory``: ``fxdebug.instrument(model, capture="all")``: every node's output kept
   in memory (views, copies where an in-place op follows) until the next forward;
3. ``save_to``: ``fxdebug.instrument(model, capture="all", folder=folder)``: each
   capture handed to the writer thread and released once written (64 MiB queue).

Memory: each variant runs in a fresh interpreter, so its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own; "forward peak" is
that peak minus the resident memory right before the first forward (model built,
weights loaded). Time: one more interpreter runs the three variants interleaved
(each repeat runs every variant once, starting one later each time), median of
the repeats after one warm-up; for ``save_to`` the forward plus ``fxdebug.records`` (which finishes writing)
(every byte written and the manifest on disk). Earlier runs are deleted between
repeats, outside the timing. The saved run is checked equal to the in-memory
capture.

Run (from the repository root)::

    python benchmarks/save_overhead.py                  # 4x3x160x160, 3 repeats
    python benchmarks/save_overhead.py --quick          # 1x3x64x64, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tabulate import tabulate

CHILD = r"""
import json, os, resource, shutil, statistics, sys, time
import torch, torchvision
import fxdebug

variant, shape, repeats, folder = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = torchvision.models.resnet50().eval()
x = torch.randn(*shape)
if variant == "eager":
    run = model
elif variant == "memory":
    run = fxdebug.instrument(model, capture="all")
else:
    run = fxdebug.instrument(model, capture="all", folder=os.path.join(folder, "runs"))

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
forward, total = [], []
for repeat in range(repeats + 1):
    start = time.perf_counter()
    with torch.no_grad():
        out = run(x)
    middle = time.perf_counter()
    if variant == "save_to":
        fxdebug.records(run)
    end = time.perf_counter()
    if repeat:
        forward.append(middle - start)
        total.append(end - start)
    if variant == "save_to":  # keep the latest run only, outside the timing
        runs = sorted(os.listdir(os.path.join(folder, "runs")))
        for old in runs[:-1]:
            shutil.rmtree(os.path.join(folder, "runs", old))
    del out
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result = {"variant": variant, "before": before, "peak": peak,
          "forward": statistics.median(forward), "total": statistics.median(total)}
if variant == "save_to":
    saved = fxdebug.load_records(os.path.join(folder, "runs"))
    memory = fxdebug.instrument(model, capture="all")
    with torch.no_grad():
        memory(x)
    expected = fxdebug.records(memory)
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected.keys() if k in saved)
    result["run_bytes"] = os.path.getsize(os.path.join(saved.path, "tensors.bin"))
    result["captures"] = len(saved)
print("RESULT " + json.dumps(result))
"""

# Time: the three variants in one process, interleaved (each repeat runs every variant once,
# starting one variant later each time), so the machine's drifts spread over all of them.
TIMING = r"""
import json, os, shutil, statistics, sys, time
import torch, torchvision
import fxdebug

shape, repeats, folder = tuple(map(int, sys.argv[1].split(","))), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torchvision.models.resnet50().eval()
x = torch.randn(*shape)
runs = os.path.join(folder, "runs")
saving = fxdebug.instrument(model, capture="all", folder=runs)
variants = {"eager": model, "memory": fxdebug.instrument(model, capture="all"), "save_to": saving}
times = {name: [] for name in variants}
names = list(variants)
for repeat in range(repeats + 1):
    for name in names[repeat % 3:] + names[:repeat % 3]:
        start = time.perf_counter()
        with torch.no_grad():
            out = variants[name](x)
        if name == "save_to":
            fxdebug.records(saving)
        if repeat:
            times[name].append(time.perf_counter() - start)
        del out
        if name == "save_to":
            for old in sorted(os.listdir(runs))[:-1]:
                shutil.rmtree(os.path.join(runs, old))
        if name == "memory":
            variants["memory"].fxdebug_recorder.latest = fxdebug.Records()  # release the captures
print("RESULT " + json.dumps({name: statistics.median(t) for name, t in times.items()}))
"""


def _child(variant: str, shape: str, repeats: int) -> dict:
    folder = tempfile.mkdtemp(prefix="fxdebug_save_overhead_")
    try:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        command = ([sys.executable, "-c", TIMING, shape, str(repeats), folder]
                   if variant == "timing" else
                   [sys.executable, "-c", CHILD, variant, shape, str(repeats), folder])
        done = subprocess.run(command,
                              env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", default="4,3,160,160")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1x3x64x64, 2 repeats")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in every child")
    args = parser.parse_args()
    if args.threads:  # the children are fresh interpreters: they read it at start
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.quick:
        args.input, args.repeats = "1,3,64,64", 2
    import torch
    print(f"resnet50, input {args.input.replace(',', 'x')}, capture='all', no_grad, CPU, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.repeats} repeats + 1 warm-up")
    results = {v: _child(v, args.input, args.repeats) for v in ("eager", "memory", "save_to")}
    timing = _child("timing", args.input, args.repeats)
    mib = 2**20
    rows = []
    eager_peak = results["eager"]["peak"] - results["eager"]["before"]
    for variant, r in results.items():
        peak = r["peak"] - r["before"]
        rows.append([variant, f"{peak / mib:.0f}", f"{peak / eager_peak:.2f}x",
                     f"{r['peak'] / mib:.0f}", f"{timing[variant] * 1000:.0f}",
                     f"{timing[variant] / timing['eager']:.2f}x"])
    print(tabulate(rows, headers=["variant", "forward peak MiB", "peak vs eager",
                                  "process peak MiB", "median ms", "time vs eager"],
                   tablefmt="github", disable_numparse=True,
                   colalign=("left",) + ("right",) * 5))
    print("(save_to: the forward and fxdebug.records, every byte written; times interleaved in "
          "one process, medians)")
    saved = results["save_to"]
    print(f"save_to wrote {saved['captures']} captures, {saved['run_bytes'] / mib:.0f} MiB per "
          f"run; the saved run equals the in-memory capture")


if __name__ == "__main__":
    main()
