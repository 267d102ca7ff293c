"""``report(...)``: one self-contained HTML page of runs and reports (a run, what passes did).

No network, no CDN: the CSS and the few lines of JavaScript (sort by a column,
filter by key) are inline, the charts are inline SVG::

    report(gm_or_reports, "report.html")
      ├─ Records (or an instrumented gm: its latest run)
      │    ├─ _norm_chart   activation norm per node, gradient norm per node (log scale,
      │    │                non-finite nodes in red)
      │    └─ records_table_html   sortable, filterable by key, non-finite rows marked
      ├─ GraphDiff        rows marked + (added) - (removed) ~ (changed), and the code diff
      ├─ EquivalenceReport  verdict and node comparisons, first divergence marked
      ├─ PassReport       one section per pass: its diff and its equivalence check
      └─ Series (fxdebug.load_series), or any SeriesView: series_html.py, line charts
                          over steps (inline SVG, spike steps marked), the drift table, spikes

Anything else is an error naming what it accepts.

>>> import torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
>>> _ = gm(torch.ones(1, 2))
>>> page = fxdebug.reporting.html.html_page(gm)
>>> page.startswith("<!DOCTYPE html>"), "http" in page.replace("http-equiv", "")
(True, False)
"""

from __future__ import annotations

import html
import math
import os

import torch

from ..runtime import RECORDER_ATTR, Records
from ..base.records_html import records_rows, records_table_html
from ..base.report import Report
from .series_html import series_html
from .series_view import SeriesView

__all__ = ["report", "html_page", "diff_html", "equivalence_html"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font:12px ui-monospace,monospace}
th,td{padding:2px 8px;border-bottom:1px solid #eee;text-align:left;white-space:nowrap}
th{cursor:pointer;background:#f4f4f4;position:sticky;top:0}
td.num{text-align:right}
tr.nonfinite td{background:#fdd;color:#900;font-weight:bold}
tr.added td{background:#e6ffec}tr.removed td{background:#ffebe9}tr.changed td{background:#fff8c5}
tr.first td{outline:2px solid #d00;font-weight:bold}
.verdict-ok{color:#080;font-weight:bold}.verdict-bad{color:#c00;font-weight:bold}
pre{background:#f8f8f8;padding:8px;overflow-x:auto;font-size:12px}
pre .add{color:#080}pre .del{color:#c00}pre .hunk{color:#06c}
input.filter{margin:6px 0;padding:3px;width:24em}
svg text{font:10px sans-serif}
.legend{font-size:12px;margin:0 0 10px 64px}
"""

_JS = """
function fxSort(th){const t=th.closest('table'),i=[...th.parentNode.children].indexOf(th);
const b=t.tBodies[0],rows=[...b.rows],d=th.dataset.dir==='asc'?-1:1;th.dataset.dir=d>0?'asc':'desc';
const v=r=>{const s=r.cells[i].textContent,n=parseFloat(s);return isNaN(n)?s:n};
rows.sort((x,y)=>{const a=v(x),c=v(y);return (typeof a===typeof c?(a<c?-1:a>c?1:0):
(typeof a==='number'?-1:1))*d});rows.forEach(r=>b.appendChild(r))}
function fxFilter(inp,id){const q=inp.value.toLowerCase();
for(const r of document.getElementById(id).tBodies[0].rows)
r.style.display=r.cells[0].textContent.toLowerCase().includes(q)?'':'none'}
document.querySelectorAll('th').forEach(th=>th.addEventListener('click',()=>fxSort(th)));
"""


def _esc(value) -> str:
    return html.escape(str(value))


def _records_of(obj) -> Records | None:
    if isinstance(obj, Records):
        return obj
    recorder = getattr(obj, RECORDER_ATTR, None)
    writer = getattr(recorder, "run_writer", None)
    if writer is not None and writer.folder is not None:  # folder=: the latest run, from disk
        return writer.latest_records()
    latest = getattr(recorder, "latest", None)
    return latest if isinstance(latest, Records) else None


def _norm_chart(title: str, points: list[tuple[str, float, bool]]) -> str:
    """Inline SVG bar chart, log10 scale: one bar per node, red where non-finite."""
    finite = [v for _, v, bad in points if not bad and v > 0 and math.isfinite(v)]
    if not finite:
        return f"<p>{_esc(title)}: no finite positive values to draw.</p>"
    low, high = math.floor(math.log10(min(finite))), math.ceil(math.log10(max(finite)))
    high = max(high, low + 1)
    bar, height, left, bottom = 6, 180, 50, 20
    width = left + bar * len(points) + 10
    parts = [f'<svg width="{width}" height="{height + bottom + 20}"'
             f' role="img" aria-label="{_esc(title)}"><text x="{left}" y="12">{_esc(title)}'
             f' (log scale; hover a bar for its key)</text>']
    for decade in range(low, high + 1):
        y = 20 + height - (decade - low) / (high - low) * height
        parts.append(f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="2" y="{y + 3:.1f}">1e{decade}</text>')
    for i, (key, value, bad) in enumerate(points):
        x = left + i * bar
        if bad or not (value > 0 and math.isfinite(value)):
            bar_height, colour = float(height), "#d00" if bad else "#bbb"
        else:
            bar_height, colour = max((math.log10(value) - low) / (high - low) * height, 1), "#4a7bd0"
        parts.append(f'<rect x="{x}" y="{20 + height - bar_height:.1f}" width="{bar - 1}" '
                     f'height="{bar_height:.1f}" fill="{colour}"><title>{_esc(key)}: '
                     f'{"non-finite" if bad else format(value, ".4g")}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def _records_section(records: Records, name: str) -> str:
    headers, rows = records_rows(records)
    norm = headers.index("norm")
    nonfinite = headers.index("non-finite")
    activations = [(cells[0], float(cells[norm]), cells[nonfinite] != "0") for cells, _ in rows]
    parts = [f"<h2>Records: {_esc(name)}</h2>",
             f"<p>{len(records)} values captured; rows with a NaN/Inf in red. Click a column "
             f"header to sort.</p>", _norm_chart("activation norm per node", activations)]
    if "grad norm" in headers:
        grad, grad_bad = headers.index("grad norm"), headers.index("grad non-finite")
        gradients = [(cells[0], float(cells[grad]) if cells[grad] != "-" else float("nan"),
                      cells[grad_bad] not in ("0", "-")) for cells, _ in rows]
        parts.append(_norm_chart("gradient norm per node", gradients))
    table_id = f"records-{_slug(name)}"
    parts.append(f'<div><input class="filter" placeholder="filter by key" '
                 f'oninput="fxFilter(this, \'{table_id}\')"></div>')
    parts.append(records_table_html(records, table_id))
    return "".join(parts)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text)[:40] or "x"


def _code_diff_html(text: str) -> str:
    lines = []
    for line in text.splitlines():
        cls = ("add" if line.startswith("+") and not line.startswith("+++") else
               "del" if line.startswith("-") and not line.startswith("---") else
               "hunk" if line.startswith("@@") else "")
        lines.append(f'<span class="{cls}">{_esc(line)}</span>' if cls else _esc(line))
    return "<pre>" + "\n".join(lines) + "</pre>"


def diff_html(graph_diff, first_key: str | None = None) -> str:
    """A GraphDiff as HTML: changed rows coloured (+ green, - red, ~ yellow), the code diff."""
    classes = {"+": "added", "-": "removed", "~": "changed", " ": ""}
    rows = []
    for row in graph_diff.rows:
        view = row.view
        cls = classes[row.mark] + (" first" if first_key is not None and view.key == first_key else "")
        rows.append(f'<tr class="{cls.strip()}"><td>{_esc(row.mark)}</td><td>{_esc(view.key)}</td>'
                    f'<td>{_esc(view.opcode)}</td><td>{_esc(view.target)}</td>'
                    f'<td>{_esc(view.args)}</td><td>{_esc(view.pass_name)}</td>'
                    f'<td>{_esc("; ".join(row.changes))}</td></tr>')
    head = "".join(f"<th>{h}</th>" for h in ("", "key", "opcode", "target", "args", "pass",
                                              "changed"))
    code = graph_diff.code_diff()
    return (f"<p>nodes {_esc(graph_diff.summary())} (+ added, - removed, ~ changed)</p>"
            f'<table class="fxdebug-diff"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
            f"</tbody></table>" + (f"<h3>generated code</h3>{_code_diff_html(code)}" if code else ""))


def equivalence_html(report) -> str:
    """An EquivalenceReport as HTML: verdict, the first divergence, every node compared."""
    first = report.first_divergence
    verdict = ('<p class="verdict-ok">EQUIVALENT</p>' if report.ok else
               '<p class="verdict-bad">DIFFERENT</p>')
    parts = [verdict]
    if first is not None:
        parts.append(f"<p><b>first divergence:</b> {_esc(first.describe())}</p>")
    rows = []
    for node in report.nodes:
        cls = ("first " if first is not None and node.key == first.key else "") + \
            ("" if node.ok else "nonfinite" if not math.isfinite(node.max_abs) else "changed")
        rows.append(f'<tr class="{cls.strip()}"><td>{_esc(node.key)}</td><td>{_esc(node.op)}</td>'
                    f'<td>{_esc(node.location)}</td><td>{_esc(node.candidate_key)}</td>'
                    f'<td>{_esc(node.shape)}</td><td class="num">{node.max_abs:.3g}</td>'
                    f'<td class="num">{node.max_rel:.3g}</td>'
                    f'<td>{"ok" if node.ok else "DIFFERS"}</td></tr>')
    if rows:
        head = "".join(f"<th>{h}</th>" for h in ("key", "op", "source", "candidate", "shape",
                                                  "max abs", "max rel", "verdict"))
        parts.append(f'<table class="fxdebug-equivalence"><thead><tr>{head}</tr></thead>'
                     f'<tbody>{"".join(rows)}</tbody></table>')
    parts.append(f"<details><summary>full text</summary><pre>{_esc(report.table(wide=True))}"
                 f"</pre></details>")
    return "".join(parts)


def _section(obj, index: int) -> str:
    records = _records_of(obj)
    if records is not None:
        return _records_section(records, type(obj).__name__ if index == 0 else f"{index}")
    if hasattr(obj, "rows") and hasattr(obj, "code_diff"):  # a GraphDiff
        return "<h2>Graph diff</h2>" + diff_html(obj)
    if hasattr(obj, "first_divergence") and hasattr(obj, "nodes"):  # an EquivalenceReport
        return "<h2>Equivalence check</h2>" + equivalence_html(obj)
    if hasattr(obj, "stages"):  # a PassReport
        parts = ["<h2>Passes</h2>", f"<pre>{_esc(obj.table())}</pre>"]
        for stage in obj.stages[1:]:
            parts.append(f"<h3>pass {_esc(stage.name)}</h3>")
            first = getattr(stage.equivalence, "first_divergence", None)
            if stage.diff is not None:
                parts.append(diff_html(stage.diff, first.key if first is not None else None))
            if stage.equivalence is not None:
                parts.append(equivalence_html(stage.equivalence))
        return "".join(parts)
    if callable(getattr(obj, "chart_data", None)):  # a monitor's Series
        obj = obj.chart_data()
    if isinstance(obj, SeriesView):
        return series_html(obj)
    if isinstance(obj, Report):  # any other fxdebug report: its own HTML
        return f"<h2>{_esc(type(obj).__name__)}</h2>" + obj._repr_html_()
    if isinstance(obj, torch.nn.Module):
        raise TypeError(f"report: {type(obj).__name__} has no recorded run; pass a module made "
                        f"by fxdebug.instrument after calling it once.")
    raise TypeError(f"report: cannot show a {type(obj).__name__}; give an instrumented module, "
                    f"Records, a GraphDiff, an EquivalenceReport, a PassReport or a Series "
                    f"(fxdebug.load_series) (or a list of them).")


def html_page(gm_or_reports, title: str = "fxdebug report") -> str:
    """The HTML page :func:`report` writes, as a string."""
    items = list(gm_or_reports) if isinstance(gm_or_reports, (list, tuple)) else [gm_or_reports]
    body = "".join(_section(item, i) for i, item in enumerate(items))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_esc(title)}</h1>{body}<script>{_JS}</script></body></html>\n")


def report(gm_or_reports, path: str | os.PathLike, title: str = "fxdebug report") -> str:
    """Write runs and reports on one self-contained HTML page (no network needed); return its path.

    ``gm_or_reports``: an instrumented module after a run (or its Records), a
    ``GraphDiff``, an ``EquivalenceReport``, a ``PassReport`` (what ``PassManager.run``
    returns), any other fxdebug report, a monitor's ``Series`` (``fxdebug.load_series``:
    line charts of the keys that drifted most and of the loss, spike steps marked, the
    drift table and the spikes), or a list of these: records table (sortable, filterable
    by key), activation and gradient norm charts, non-finite nodes in red, diffs
    coloured, first divergence outlined.

    >>> import os, tempfile, torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> _ = gm(torch.ones(1, 2))
    >>> path = fxdebug.report(gm, os.path.join(tempfile.mkdtemp(), "report.html"))
    >>> os.path.getsize(path) > 1000
    True
    """
    page = html_page(gm_or_reports, title)
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(page)
    return path
