"""The ``fxdebug`` command line: one module per subcommand, each a thin layer over the API.

::

    fxdebug COMMAND [MODEL] [options]        main(argv)
      ├─ model_spec.py  load MODEL ("package.module:factory" or "file.py:factory",
      │                 default torchvision.models:resnet18, random weights) and --input
      ├─ summary.py     instrument -> run -> print_tabular of the captures
      ├─ report.py      instrument -> run -> one self-contained HTML page (+ pass diffs)
      ├─ passes.py      PassManager(--pass ...) -> a diff table per pass
      ├─ check.py       check_equivalence(model, trace(model)) -> first differing node
      ├─ nonfinite.py   find_nonfinite -> the first node that makes a NaN/Inf
      ├─ lint.py        lint_inplace -> in-place writes that break autograd
      ├─ dump.py        dump -> a folder with module.py, run.py, weights
      ├─ debug.py       a dump folder's run.py under pdb, stopping at --break KEYS
      ├─ compare.py     compare_runs on two saved runs -> the first divergent key
      └─ series.py      load_series(FOLDER).drift() -> the keys a monitor saw drift most
    _common.py holds the options and messages the subcommands share.

Exit status, as ``diff`` and ``cmp``: 0 when everything agrees (or nothing was
found), 1 when a command finds what it looks for (runs or stages that differ,
a non-finite value, an in-place hazard), 2 for trouble: bad arguments, a
missing run, any error. Errors print one paragraph; an error raised in the
user's code (a model factory, a forward) adds where it was raised and the
traceback of the user's own frames; ``--traceback`` prints every frame.

>>> from fxdebug.cli import main
>>> main(["summary", "torchvision.models:resnet18", "--input", "1,3,32,32", "--depth", "1"])
torchvision.models:resnet18: ResNet, input 1x3x32x32, capture=modules, mode=tensor
key ...
fc ...
18 tensors captured, ...
0
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from ..errors import FxdebugError
from .model_spec import command_search_path

__all__ = ["main"]

# Subcommands, in the order ``fxdebug --help`` lists them.
TROUBLE = 2  # the exit status of an error, as diff and cmp: 1 means "found a difference"
COMMANDS = ("summary", "report", "passes", "check", "nonfinite", "lint", "dump", "debug",
            "compare", "series")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxdebug", description="Debug PyTorch models through torch.fx graph transformations.",
        epilog="exit status: 0 same / nothing found, 1 different / found, 2 trouble (bad "
               "arguments, a missing run, an error), 3 incomplete (compare: what was compared "
               "agrees, but some keys could not be compared)")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, print the full traceback (default: the user's frames)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"fxdebug.cli.{name}").register(subparsers)
    return parser


def _one_paragraph(exc: BaseException) -> str:
    parts = [" ".join(str(exc).split()) or type(exc).__name__]
    parts += [" ".join(str(note).split()) for note in getattr(exc, "__notes__", ())]
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fxdebug`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        with command_search_path():  # the folders of model, loss and pass files, until the end
            return args.run(args)
    except FxdebugError as exc:
        print(f"fxdebug: error: {_one_paragraph(exc)}", file=sys.stderr)
        return TROUBLE
    except KeyboardInterrupt:
        print("fxdebug: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: stop quietly, like cat does
        sys.stdout = open(os.devnull, "w")
        return 141
    except Exception as exc:  # a model error: one paragraph, then the user's frames
        # imported here: --help and argument errors must not import torch (tracing does)
        from ..tracing.locations import user_location_in_traceback
        from ..base.formatting import format_location
        location = user_location_in_traceback(exc.__traceback__)
        where = f" (raised at {format_location(location)})" if location else ""
        print(f"fxdebug: error: {type(exc).__name__}: {_one_paragraph(exc)}{where}",
              file=sys.stderr)
        if getattr(args, "traceback", False):
            traceback.print_exception(exc, file=sys.stderr)
        else:
            _print_user_frames(exc)
        return TROUBLE


def _print_user_frames(exc: BaseException) -> None:
    """The frames of the traceback that are the user's code (not torch, fxdebug, the stdlib)."""
    from ..tracing.locations import is_user_file
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if is_user_file(frame.filename)]
    if frames:
        print("Traceback (the user's frames; --traceback for all):", file=sys.stderr)
        print("".join(traceback.format_list(frames)), end="", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
