"""``fxdebug lint``: in-place writes that break autograd, found without running backward."""

from __future__ import annotations

from ._common import add_model_arguments, describe_inputs, model_and_inputs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lint", help="find in-place writes that break autograd, before backward",
        description="Trace MODEL, list its in-place writes, and run one forward (on a private "
                    "copy, no backward) to find the writes that change a value autograd saved "
                    "for backward. Exit status 1 when there is an error-level hazard.")
    add_model_arguments(parser)
    parser.add_argument("--eval", action="store_true",
                        help="lint the model in eval mode (default: train mode, as in training)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..hazards import lint_inplace
    model, inputs = model_and_inputs(args)
    model.train(not args.eval)
    hazards = lint_inplace(model, *inputs)
    mode = "eval" if args.eval else "train"
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, {mode} mode")
    print(hazards.table())
    for hazard in hazards.errors:
        print(f"\n{hazard}")
    return 1 if hazards.errors else 0
