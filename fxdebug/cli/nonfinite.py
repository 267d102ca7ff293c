"""``fxdebug nonfinite``: the first node that makes a NaN or Inf, forward and backward.

    fxdebug nonfinite [MODEL] [--input SHAPE] [--forward-only] [--train] [--ignore KEYS] [--seed 0]

Exit status 0 when every value and gradient is finite, 1 when a non-finite
one was found (or on an error).
"""

from __future__ import annotations

from ._common import add_model_arguments, model_and_inputs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "nonfinite", help="find the first node whose output or gradient is NaN/Inf",
        description="Run MODEL forward and backward once, node by node, and name the first "
                    "node whose output holds a NaN or Inf (with what it received) and the first "
                    "node, in backward order, whose gradient does.")
    add_model_arguments(parser)
    parser.add_argument("--forward-only", action="store_true", help="skip the backward")
    parser.add_argument("--train", action="store_true", help="run in training mode (default eval)")
    parser.add_argument("--ignore", default=None, metavar="KEYS",
                        help="comma-separated keys/globs allowed to be non-finite "
                             "(e.g. an attention mask filled with -inf)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..nonfinite import find_nonfinite
    from ..base.progress import progress_bar
    with progress_bar(total=2, desc="nonfinite", unit="step") as bar:
        bar.set_postfix_str("building the model")
        model, inputs = model_and_inputs(args)
        if args.train:
            model.train()
        bar.update()
        bar.set_postfix_str("forward and backward, node by node")
        ignore = [part.strip() for part in (args.ignore or "").split(",") if part.strip()]
        report = find_nonfinite(model, *inputs, grads=not args.forward_only, ignore=ignore)
        bar.update()
    print(f"{args.model}:")
    print(report.table())
    return 0 if report.ok else 1
