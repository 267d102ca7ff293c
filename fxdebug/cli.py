"""The ``fxdebug`` command line.

    fxdebug summary [MODEL] [--input 1,3,224,224] [--capture modules|all|KEYS]
                    [--depth N] [--mode tensor|stats] [--seed 0]

MODEL is ``package.module:factory`` or ``path/to/file.py:factory``
(default ``torchvision.models:resnet18``, random weights). Each subcommand
lives in ``fxdebug/commands/<name>.py``. Errors print one paragraph and exit
with status 1 (2 for bad arguments), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import FxdebugError

__all__ = ["main"]

# Subcommands, in the order ``fxdebug --help`` lists them.
COMMANDS = ("summary", "passes", "check", "nonfinite", "lint", "dump", "debug")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxdebug", description="Debug PyTorch models through torch.fx graph transformations.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"fxdebug.commands.{name}").register(subparsers)
    return parser


def _one_paragraph(exc: BaseException) -> str:
    parts = [" ".join(str(exc).split()) or type(exc).__name__]
    parts += [" ".join(str(note).split()) for note in getattr(exc, "__notes__", ())]
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fxdebug`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except FxdebugError as exc:
        print(f"fxdebug: error: {_one_paragraph(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fxdebug: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: stop quietly, like cat does
        sys.stdout = open(os.devnull, "w")
        return 141
    except Exception as exc:  # a model error: report it in one paragraph, never a traceback
        print(f"fxdebug: error: {type(exc).__name__}: {_one_paragraph(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
