"""``fxdebug summary``: run the model once and print the Records table."""

from __future__ import annotations

import warnings

import torch

from ._common import add_model_arguments, capture_argument, describe_inputs, model_and_inputs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "summary", help="run the model once and print a table of every captured value",
        description="Instrument MODEL, run it on random inputs and print the Records table.")
    add_model_arguments(parser)
    parser.add_argument("--capture", default="modules",
                        help="modules, all, or comma-separated keys/globs (default modules)")
    parser.add_argument("--depth", type=int, default=None, help="only keys nested this deep")
    parser.add_argument("--mode", choices=("tensor", "stats"), default="tensor")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..instrument import instrument, records
    model, inputs = model_and_inputs(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = instrument(model, capture=capture_argument(args.capture), depth=args.depth,
                        mode=args.mode)
    for warning in caught:
        print(f"note: {warning.message}")
    with torch.no_grad():
        gm(*inputs)
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
          f"capture={args.capture}, mode={args.mode}")
    print(records(gm).table())
    return 0
