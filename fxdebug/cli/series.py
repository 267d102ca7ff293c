"""``fxdebug series``: the keys whose statistics drifted most in a monitor's folder.

    fxdebug series FOLDER [--window N] [--stat rms] [--kind out --kind param] [--rank R]
                          [--limit 10] [--wide]

FOLDER is what ``fxdebug.monitor(model, folder=...)`` wrote. Prints
:meth:`fxdebug.load_series(FOLDER).drift() <fxdebug.monitor.series.Series.drift>`: for
each key, its stat at the first and last of the latest N logged steps and the factor
between them, most moved first (the global batch's, or rank R's own). Exit status 0;
2 for trouble (no such folder, an unknown stat).
"""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "series", help="the keys that drifted most in a monitor's folder",
        description="Read a folder written by fxdebug.monitor(model, folder=...) and print the "
                    "keys whose statistic moved most between the first and the last logged step "
                    "of a window.")
    parser.add_argument("folder", metavar="FOLDER", help="the monitor's folder")
    parser.add_argument("--window", type=int, default=None, metavar="N",
                        help="the latest N logged steps (default: all)")
    parser.add_argument("--stat", default="rms",
                        help="the statistic compared (default rms; also mean, std, absmax, "
                             "kurtosis, ...)")
    parser.add_argument("--kind", action="append", default=None,
                        choices=("out", "grad", "param", "param_grad", "update"),
                        help="kinds of series compared, repeatable (default: out and param)")
    parser.add_argument("--rank", type=int, default=None, metavar="R",
                        help="rank R's own series (default: the global batch's)")
    parser.add_argument("--limit", type=int, default=10, metavar="N",
                        help="rows shown (default 10; 0: all)")
    parser.add_argument("--wide", action="store_true", help="every column, whatever the width")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..errors import FxdebugError
    from ..monitor import STATS, load_series
    if args.stat not in STATS:
        raise FxdebugError(f"fxdebug series: unknown --stat {args.stat!r}; the stats are "
                           f"{', '.join(STATS)}.")
    series = load_series(args.folder)
    report = series.drift(window=args.window, stat=args.stat,
                          kinds=tuple(args.kind or ("out", "param")), rank=args.rank,
                          limit=args.limit or None)
    print(report.table(wide=args.wide or None))
    for note in series.notes:
        print(f"note: {note}")
    return 0
