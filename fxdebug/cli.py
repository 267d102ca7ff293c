"""The ``fxdebug`` command line.

    fxdebug summary [MODEL] [--input 1,3,224,224] [--capture modules|all|KEYS]
                    [--depth N] [--mode tensor|stats] [--seed 0]

MODEL is ``package.module:factory`` or ``path/to/file.py:factory``
(default ``torchvision.models:resnet18``, random weights). Errors print one
paragraph and exit with status 1 (2 for bad arguments), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from .errors import FxdebugError
from .model_spec import DEFAULT_INPUT, DEFAULT_MODEL, load_model, make_inputs

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxdebug", description="Debug PyTorch models through torch.fx graph transformations.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    summary = commands.add_parser(
        "summary", help="run the model once and print a table of every captured value",
        description="Instrument MODEL, run it on random inputs and print the Records table.")
    summary.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                         help=f"package.module:factory or path/to/file.py:factory "
                              f"(default {DEFAULT_MODEL})")
    summary.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]",
                         help=f"input shape, repeat for several inputs (default {DEFAULT_INPUT})")
    summary.add_argument("--capture", default="modules",
                         help="modules, all, or comma-separated keys/globs (default modules)")
    summary.add_argument("--depth", type=int, default=None, help="only keys nested this deep")
    summary.add_argument("--mode", choices=("tensor", "stats"), default="tensor")
    summary.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
    summary.set_defaults(run=_summary)
    return parser


def _capture_arg(text: str):
    if text in ("modules", "all"):
        return text
    return [part.strip() for part in text.split(",") if part.strip()]


def _summary(args) -> int:
    from .instrument import instrument, records
    torch.manual_seed(args.seed)
    model, inputs = load_model(args.model)
    if inputs is None or args.input:
        inputs = make_inputs(args.input or [DEFAULT_INPUT], seed=args.seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = instrument(model, capture=_capture_arg(args.capture), depth=args.depth,
                        mode=args.mode)
    for warning in caught:
        print(f"note: {warning.message}")
    with torch.no_grad():
        gm(*inputs)
    rec = records(gm)
    shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs)
    print(f"{args.model}: {type(model).__name__}, input {shapes}, capture={args.capture}, "
          f"mode={args.mode}")
    print(rec.table())
    return 0


def _one_paragraph(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    notes = " ".join(" ".join(str(note).split()) for note in getattr(exc, "__notes__", ()))
    return f"{text} {notes}".strip()


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
    except Exception as exc:  # a model error: report it in one paragraph, never a traceback
        print(f"fxdebug: error: {type(exc).__name__}: {_one_paragraph(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
