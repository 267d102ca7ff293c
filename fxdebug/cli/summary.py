"""``fxdebug summary``: run the model once and print the Records table."""

from __future__ import annotations

import warnings

from ..errors import FxdebugError
from .model_spec import load_object
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
    parser.add_argument("--grads", action="store_true",
                        help="also run a backward and add gradient columns and parameter gradients")
    parser.add_argument("--loss", default="sum", metavar="sum|mean|MODULE:FUNCTION",
                        help="what --grads differentiates: the sum (default) or mean of the "
                             "outputs, or FUNCTION(output) -> scalar")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw activation (and gradient) norms per node; needs matplotlib")
    parser.set_defaults(run=run)


def _loss_function(spec: str):
    if spec in ("sum", "mean"):
        return lambda output: _reduce(output, spec)
    return load_object(spec, "loss")


def _reduce(output, how: str):
    from ..runtime import flatten_tensors
    tensors = [t for _, t in flatten_tensors(output, "out") if t.is_floating_point()]
    if not tensors:
        raise FxdebugError("--grads: the model output holds no floating-point tensor to "
                           "differentiate; name a loss with --loss MODULE:FUNCTION.")
    return sum(getattr(t, how)() for t in tensors)


def run(args) -> int:
    from ..instrumenting import records
    loss_fn = _loss_function(args.loss) if args.grads else None
    if args.plot:
        from ..reporting.plots import require_matplotlib
        require_matplotlib()  # fail before the run when matplotlib is missing
    from ..base.progress import progress_bar
    bar = progress_bar(total=2, desc="summary", unit="step")
    with bar as steps:
        steps.set_postfix_str("building the model")
        model, inputs = model_and_inputs(args)
        steps.update()
        steps.set_postfix_str("tracing and running")
        gm, output, caught = _instrument_and_run(args, model, inputs)
        steps.update()
    for warning in caught:
        print(f"note: {warning.message}")
    if args.grads:
        _backward(args, loss_fn, output)
    rec = records(gm)
    return _print(args, model, inputs, gm, rec)


def _instrument_and_run(args, model, inputs):
    import torch

    from ..instrumenting import instrument
    output = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = instrument(model, capture=capture_argument(args.capture), depth=args.depth,
                        mode=args.mode, grads=args.grads)
        if args.grads:  # a partially instrumented model says after its first run what ran eagerly
            output = gm(*inputs)
        else:
            with torch.no_grad():
                gm(*inputs)
    return gm, output, caught


def _backward(args, loss_fn, output) -> None:
    import torch
    loss = loss_fn(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise FxdebugError(f"--loss {args.loss!r} must return a scalar tensor, got "
                           f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}.")
    loss.backward()


def _print(args, model, inputs, gm, rec) -> int:
    from ..partial.report import PARTIAL_REPORT_ATTR, is_partial
    report = getattr(gm, PARTIAL_REPORT_ATTR) if is_partial(gm) else None
    if report is not None and not report.parts and len(rec) == 0:
        reasons = " ".join(eager.reason for eager in report.eager[:1]) or "no part was traceable"
        raise FxdebugError(f"nothing in {type(model).__name__} could be traced, so nothing was "
                           f"captured. {reasons}")
    grads_text = f", grads of {args.loss}" if args.grads else ""
    from ..base.fit_to_width import fit_line, table_width
    print(fit_line(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
                   f"capture={args.capture}, mode={args.mode}{grads_text}",
                   table_width(args.wide)))
    print(rec.table(wide=args.wide))
    if report is not None:  # what was traced, what ran eagerly and why
        print(report.summary())
    if args.plot:
        from ..reporting.plots import plot_norms
        plot_norms(rec, args.plot, title=args.model)
        print(f"plot: {args.plot}")
    return 0
