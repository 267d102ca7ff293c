"""``fxdebug compare``: two saved runs, key by key.

    fxdebug compare A B [--rtol R] [--atol A] [--run-a N] [--run-b N] [--wide]
                        [--reference R [--reference-factor F] [--reference-floor E]]

A and B are folders written by ``fxdebug.save_records`` or
``fxdebug.instrument(model, folder=...)`` (the latest run there, or run N).
Prints the verdict, the first divergent key with its op and file:line, and every
key with its error (:func:`fxdebug.compare_runs`). The ``first divergence:``
line stays one line whatever the terminal's width (the table is fitted), so
``grep "first divergence:"`` finds the key and its file:line. With
``--reference R`` (a saved run of the same model and input in float64, say),
a key differs only where B's error against R exceeds F (4) times A's plus a
floor (2 eps of B's dtype): rounding of another reduction order is not a
difference. Exit status, as ``diff``: 0 when every key was compared and the runs
agree, 1 when they differ, 2 for trouble (a missing run, bad arguments, an
error), and 3 when nothing compared differs but some keys could not be compared
(not assembled from a sharded run's pieces, stale): never 0 for a verdict that
did not look at every key.
"""

from __future__ import annotations

EXIT_STATUS = {"EQUAL": 0, "DIFFERENT": 1, "INCOMPLETE": 3}  # 2: trouble (an error), as diff


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare two saved runs key by key; name the first that differs",
        description="Compare two saved runs (folders written by fxdebug.save_records or "
                    "instrument(..., folder=)) key by key in execution order; print the first "
                    "divergent key with its op and source line, and every key's error.")
    parser.add_argument("a", metavar="A", help="a saved run's folder (the reference)")
    parser.add_argument("b", metavar="B", help="the other run's folder")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--run-a", type=int, default=None, metavar="N",
                        help="run N of an instrument(folder=) folder A (default: the latest)")
    parser.add_argument("--run-b", type=int, default=None, metavar="N",
                        help="run N of an instrument(folder=) folder B (default: the latest)")
    parser.add_argument("--reference", default=None, metavar="R",
                        help="a saved run of the same model and input in a more precise dtype "
                             "(float64): B differs only where its error against R exceeds "
                             "--reference-factor times A's plus --reference-floor")
    parser.add_argument("--run-reference", type=int, default=None, metavar="N",
                        help="run N of an instrument(folder=) folder R (default: the latest)")
    parser.add_argument("--reference-factor", type=float, default=None, metavar="F",
                        help="with --reference: how many times A's error B's may reach (default 4)")
    parser.add_argument("--reference-floor", type=float, default=None, metavar="E",
                        help="with --reference: a relative error always allowed "
                             "(default: 2 eps of B's dtype)")
    parser.add_argument("--wide", action="store_true", help="every column, whatever the width")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..errors import FxdebugError
    from ..runs.run_comparison import compare_runs
    from ..runs.reference import REFERENCE_FACTOR
    from ..runs.saved_runs import load_records
    if args.reference is None and (args.reference_factor is not None
                                   or args.reference_floor is not None
                                   or args.run_reference is not None):
        raise FxdebugError("fxdebug compare: --reference-factor, --reference-floor and "
                           "--run-reference need --reference R (a saved float64 run).")
    reference = None if args.reference is None else \
        load_records(args.reference, run=args.run_reference)
    factor = REFERENCE_FACTOR if args.reference_factor is None else args.reference_factor
    report = compare_runs(load_records(args.a, run=args.run_a), load_records(args.b, run=args.run_b),
                          rtol=args.rtol, atol=args.atol, reference=reference,
                          reference_factor=factor, reference_floor=args.reference_floor)
    print(report.table(wide=args.wide or None))
    return EXIT_STATUS[report.verdict_text]
