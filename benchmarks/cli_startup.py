"""Start-up time of the ``fxdebug`` command: ``--help`` and an argument error, against
``python -c "import torch"``, each in a fresh interpreter, interleaved.

Goal: ``fxdebug --help`` and argument errors well under half of ``import torch``
(they import no torch). Run: python benchmarks/cli_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from _common import interleaved, median, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(*args: str):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return lambda: subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                                  capture_output=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants = {"python -c 'import torch'": _command("-c", "import torch"),
                "fxdebug --help": _command("-m", "fxdebug", "--help"),
                "fxdebug summary --bogus (exit 2)": _command("-m", "fxdebug", "summary", "--bogus")}
    times = interleaved(variants, repeats=args.repeats, warmup=1)
    base = median(times["python -c 'import torch'"])
    rows = [[name, f"{median(t):.3f}", f"{median(t) / base:.2f}x"] for name, t in times.items()]
    print(table(rows, ["command", "median s", "vs import torch"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
