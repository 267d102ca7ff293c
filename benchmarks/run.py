"""Every benchmark, one table: fxdebug's ratios and the alternatives', median of interleaved repeats.

Runs, each in its own interpreter (so no benchmark warms another's caches)::

    capture      capture_overhead.py   resnet50, batch 4 at 224x224: tensor and stats
                                       mode vs eager, forward hooks, feature extractor
    gradient     grad_overhead.py      gradient capture vs plain backward, retain_grad
    non-finite   nonfinite_cost.py     find_nonfinite, watch_nonfinite vs detect_anomaly
    watch        watch_cost.py         watch_nonfinite's fixed cost per step on a tiny CNN;
                                       on 2 gloo ranks against a plain DDP step
    checkpoint   checkpoint_memory.py  memory of the checkpoint pass vs eager
    scaling      scaling.py            10k-node graph vs symbolic_trace, dump vs to_folder
    save         save_overhead.py      resnet50 capture="all": peak memory and time of
                                       in-memory capture and save_to vs eager
    sharded      sharded_steps.py      FSDP2 and tensor-parallel training steps on 2 gloo
                                       ranks, instrumented vs plain
    sharded-zoo  sharded_zoo.py        HF/timm/torchvision families x FSDP2, TP, FSDP x TP,
                                       HSDP on 2 and 4 gloo ranks: compare verdicts and
                                       planted bugs named (a verdict per pair, seconds)
    host         host_overhead.py      host time per capture on 400 Linear(16,16)/ReLU
                                       modules at batch 1: every capture kind vs hooks
    monitor      monitor_cost.py       fxdebug.monitor's training steps (off, logged, after a
                                       logged one) vs plain and stats mode, resnet50 and
                                       GPT-2 small; compiled (inductor) vs the floor
    precision    precision_cost.py     precision_sensitivity: seconds per candidate node and
                                       choose(), resnet18 and a tiny GPT-2, vs a plain step

and prints one GitHub table: benchmark, model, variant, median, the benchmark's
spread column (min, or max - min of the repeats) and the ratio with what it is a
ratio to. Each benchmark's own output (with its correctness lines) is written
above the table. ``--quick`` runs every benchmark's smoke-test size. The header
names the date, torch version, machine and load average: timings on a shared
machine are noisy, compare ratios within one run only.

Run (from the repository root)::

    python benchmarks/run.py --quick
    python benchmarks/run.py --threads 2
    python benchmarks/run.py --device cuda      # capture, gradient, non-finite on the GPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

import torch
from _common import table

HERE = os.path.dirname(os.path.abspath(__file__))

# name, script, full-size arguments, quick arguments
BENCHMARKS = [
    ("capture", "capture_overhead.py", ["--models", "resnet50", "--input", "4,3,224,224",
                                        "--repeats", "10"], ["--quick", "--models", "resnet50"]),
    ("gradient", "grad_overhead.py", [], ["--quick"]),
    ("non-finite", "nonfinite_cost.py", ["--models", "resnet18"], ["--quick", "--models", "resnet18"]),
    ("watch", "watch_cost.py", [], ["--quick"]),
    ("checkpoint", "checkpoint_memory.py", [], ["--quick"]),
    ("scaling", "scaling.py", [], ["--quick"]),
    ("save", "save_overhead.py", [], ["--quick"]),
    ("sharded", "sharded_steps.py", [], ["--quick"]),
    ("sharded-zoo", "sharded_zoo.py", [], ["--quick"]),
    ("host", "host_overhead.py", [], ["--quick"]),
    ("monitor", "monitor_cost.py", [], ["--quick"]),
    ("precision", "precision_cost.py", [], ["--quick"]),
]


ON_DEVICE = ("capture", "gradient", "non-finite")  # the benchmarks with --device


def parse_tables(text: str):
    """``(section, {header: cell})`` for every row of every markdown table in ``text``."""
    section, headers = "", None
    for line in text.splitlines():
        if line.startswith("### "):
            section, headers = line[4:].strip(), None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if headers is None:
                headers = cells
            elif not all(set(c) <= set("-:") for c in cells):
                yield section, dict(zip(headers, cells))
        else:
            headers = None


def _pick(row: dict, *words: str) -> str:
    for header, cell in row.items():
        if any(word in header for word in words):
            return cell
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's smoke test")
    parser.add_argument("--threads", type=int, default=0, help="passed to every benchmark")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--device", default="cpu",
                        help="cuda: capture, gradient and non-finite run on the GPU")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    rows = []
    for name, script, full, quick in BENCHMARKS:
        if only and name not in only:
            continue
        command = [sys.executable, os.path.join(HERE, script), *(quick if args.quick else full)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if args.device != "cpu":
            if name not in ON_DEVICE:
                continue
            command += ["--device", args.device]
        print(f"$ {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout, flush=True)
        if done.returncode:
            print(done.stderr[-3000:], flush=True)
            rows.append([name, "", f"FAILED (exit {done.returncode})", "", "", "", ""])
            continue
        for section, row in parse_tables(done.stdout):
            rows.extend(summary_rows(name, section, row))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = " ".join(part for part in (platform.machine(), platform.processor()) if part)
    where = (f"GPU {torch.cuda.get_device_name()}" if args.device != "cpu" else "CPU only")
    print(f"{when}, torch {torch.__version__}, {machine}, {os.cpu_count()} cores, {where}, "
          f"threads {args.threads or torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.2f}{', --quick' if args.quick else ''}")
    print(table(rows, ["benchmark", "model", "variant", "median ms (MiB)", "min / spread",
                       "ratio", "ratio to"]))


def summary_rows(name: str, section: str, row: dict) -> list[list[str]]:
    """The combined table's rows for one row of a benchmark's own table.

    >>> summary_rows("sharded-zoo", "", {"family": "vit", "configuration": "tp", "ranks": "2",
    ...     "instrumented": "yes", "captures match hooks": "52/52",
    ...     "compare verdict (float64 reference)": "EQUAL (52/52 compared)",
    ...     "planted bug named": "eps: yes; norm: yes", "seconds": "2.8"})[0][2]
    'tp on 2 ranks: EQUAL, captures 52/52, bugs named 2/2'
    >>> summary_rows("checkpoint", "", {"variant": "eager", "held after forward MiB": "651.1",
    ...     "peak fwd+bwd MiB": "659.0", "peak vs eager": "1.00x", "median s": "10.60",
    ...     "time vs eager": "1.00x"})[0]
    ['checkpoint', '', 'eager: peak memory fwd+bwd', '659.0 MiB', 'held 651.1 MiB', '1.00x', 'eager peak']
    """
    variant = row.get("variant", "")
    if "planted bug named" in row:  # sharded_zoo: a verdict per pair, seconds, no ratio
        if row.get("instrumented") == "n/a":
            return []
        bugs = [b for b in row["planted bug named"].split("; ") if ": " in b]
        named = sum(b.endswith(": yes") for b in bugs)
        verdict = row.get("compare verdict (float64 reference)", "").split(" (")[0]
        return [[name, row.get("family", ""),
                 f"{row.get('configuration', '')} on {row.get('ranks', '')} ranks: {verdict}, "
                 f"captures {row.get('captures match hooks', '')}, bugs named {named}/{len(bugs)}",
                 f"{row.get('seconds', '')} s", "", "", ""]]
    if "forward peak MiB" in row:  # save: memory and time, a row each
        return [[name, section, f"{variant}: peak memory forward", f"{row['forward peak MiB']} MiB",
                 "", row.get("peak vs eager", ""), "eager peak"],
                [name, section, f"{variant}: time forward", f"{row.get('median ms', '')} ms", "",
                 row.get("time vs eager", ""), "eager"]]
    if "peak fwd+bwd MiB" in row:  # memory and time: a row each, each with its own ratio
        return [[name, section, f"{variant}: peak memory fwd+bwd", f"{row['peak fwd+bwd MiB']} MiB",
                 f"held {row.get('held after forward MiB', '')} MiB", row.get("peak vs eager", ""),
                 "eager peak"],
                [name, section, f"{variant}: time fwd+bwd", f"{row.get('median s', '')} s", "",
                 row.get("time vs eager", ""), "eager"]]
    return [[name, section, variant, _pick(row, "median ms", "MiB"),
             _pick(row, "min ms", "spread ms"), _pick(row, "ratio", "vs "),
             row.get("ratio to", _ratio_to(row))]]


def _ratio_to(row: dict) -> str:
    for header in row:
        if header.startswith("vs ") or header.endswith(" vs eager"):
            return header.replace("vs ", "").replace(" (median)", "").replace("peak ", "")
    return ""


if __name__ == "__main__":
    main()
