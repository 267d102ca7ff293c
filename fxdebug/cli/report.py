"""``fxdebug report``: the HTML page of :func:`fxdebug.report` for a run (and of passes, with --pass)."""

from __future__ import annotations

from typing import Any

from ._common import add_model_arguments, add_pass_arguments, capture_argument, model_and_inputs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write the HTML page of a run: records table, norm charts, pass diffs",
        description="Instrument MODEL with gradients, run a forward and a backward of the "
                    "output sum, and write one self-contained HTML file (no network): the "
                    "records table (sortable, filterable), activation and gradient norms per "
                    "node, non-finite nodes in red; with --pass, each pass's diff and "
                    "equivalence check.")
    add_model_arguments(parser)
    add_pass_arguments(parser)
    parser.add_argument("-o", "--output", default="report.html", metavar="FILE.html",
                        help="where to write the page (default report.html)")
    parser.add_argument("--capture", default="modules",
                        help="modules, all, or comma-separated keys/globs (default modules)")
    parser.add_argument("--no-grads", dest="grads", action="store_false",
                        help="forward only: no backward, no gradient chart")
    parser.set_defaults(run=run)


def run(args) -> int:
    import torch

    from ..instrumenting import instrument, records
    from ..pass_manager import PassManager
    from ..reporting.html import report
    from ._common import built_in_passes
    from .summary import _reduce

    passes = built_in_passes(args.passes) if args.passes else []
    model, inputs = model_and_inputs(args)
    gm = instrument(model, capture=capture_argument(args.capture), grads=args.grads)
    if args.grads:
        _reduce(gm(*inputs), "sum").backward()
    else:
        with torch.no_grad():
            gm(*inputs)
    items: list[Any] = [records(gm)]  # Records, then a PassReport
    if passes:
        pass_report = PassManager(passes, check_inputs=inputs).run(model).report
        items.append(pass_report)
    path = report(items, args.output, title=f"fxdebug report: {args.model}")
    print(f"report: {path}")
    return 0
