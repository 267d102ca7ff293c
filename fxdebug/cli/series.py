"""``fxdebug series``: the keys whose statistics drifted most in a monitor's folder.

    fxdebug series FOLDER [--window N] [--stat rms] [--kind out --kind param] [--rank R]
                          [--limit 10] [--wide] [--plot PNG] [--html HTML]

FOLDER is what ``fxdebug.monitor(model, folder=...)`` wrote. Prints
:meth:`fxdebug.load_series(FOLDER).drift() <fxdebug.monitoring.series.Series.drift>`: for
each key, its stat at the first and last of the latest N logged steps and the factor
between them, most moved first (the global batch's, or rank R's own); then the spikes
the monitor replayed, if any (step, trigger, reproduced, first divergence). ``--plot``
saves a PNG of the table's top keys (at most 6) over the steps and of the loss, spike
steps marked (:meth:`~fxdebug.monitoring.series.Series.plot`); ``--html`` writes the same as
a self-contained page (:func:`fxdebug.report`). Exit status 0; 2 for trouble (no such
folder, an unknown stat, no matplotlib for --plot).
"""

from __future__ import annotations

PLOTTED = 6  # the most keys --plot and --html draw


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "series", help="the keys that drifted most in a monitor's folder (and a plot, a page)",
        description="Read a folder written by fxdebug.monitor(model, folder=...) and print the "
                    "keys whose statistic moved most between the first and the last logged step "
                    "of a window, and the spikes the monitor replayed.")
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
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help=f"also save a PNG: the stat of the table's top keys (at most "
                             f"{PLOTTED}) and the loss over the steps, spike steps marked "
                             f"(needs matplotlib)")
    parser.add_argument("--html", default=None, metavar="HTML",
                        help="also write a self-contained HTML page: the same charts (inline "
                             "SVG), the drift table and the spikes")
    parser.set_defaults(run=run)


def spikes_table(spikes: list[dict], wide: bool | None = None) -> str:
    """The spikes the monitor replayed: step, trigger, reproduced, first divergence; fitted
    to the terminal, or to 80 columns when printed to a file or a pipe (the triggers are
    free text; ``wide=True`` keeps every character).

    >>> print(spikes_table([{"step": 7, "trigger": "loss is nan", "reproduced": True,
    ...                      "first_divergence": "fc1"}], wide=True))
    spikes replayed: 1
    step  trigger      reproduced  first divergence
    ------  -----------  ------------  ------------------
    7     loss is nan  yes         fc1
    """
    from ..monitoring.plot import spike_rows
    from ..base.fit_to_width import fit_table, table_width
    cells = [list(row[:4]) for row in spike_rows(spikes)]
    table = fit_table(cells, ["step", "trigger", "reproduced", "first divergence"],
                      width=table_width(wide) or (None if wide else 80),
                      truncate=("trigger", "first divergence"))
    return f"spikes replayed: {len(spikes)}\n{table}"


def run(args) -> int:
    from ..errors import FxdebugError
    from ..monitoring import STATS, load_series
    from ..reporting.html import report as write_page
    if args.stat not in STATS:
        raise FxdebugError(f"fxdebug series: unknown --stat {args.stat!r}; the stats are "
                           f"{', '.join(STATS)}.")
    if args.plot:
        from ..reporting.plots import require_matplotlib
        require_matplotlib()  # fail before anything is printed or written
    series = load_series(args.folder)
    kinds = tuple(args.kind or ("out", "param"))
    report = series.drift(window=args.window, stat=args.stat, kinds=kinds, rank=args.rank,
                          limit=args.limit or None)
    print(report.table(wide=args.wide or None))
    if series.spikes:
        print()
        print(spikes_table(series.spikes, wide=args.wide or None))
    shown = dict(stat=args.stat, kinds=kinds, rank=args.rank, window=args.window,
                 limit=min(args.limit or PLOTTED, PLOTTED))
    if args.plot:
        print(f"plot: {series.plot(args.plot, **shown)}")
    if args.html:
        path = write_page(series.chart_data(**shown), args.html,
                          title=f"fxdebug series {args.folder}")
        print(f"page: {path}")
    for note in series.notes:
        print(f"note: {note}")
    return 0
