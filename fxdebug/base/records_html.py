"""The Records table as HTML: what ``Records._repr_html_`` shows in Jupyter, and what the
HTML page (:mod:`fxdebug.reporting.html`) embeds.

One ``<table class="fxdebug-records">`` row per capture, with the statistics of
``Records.table()`` and, when gradients were recorded, the gradient norm; rows
holding a NaN/Inf (value or gradient) have the class ``nonfinite``. Text is
escaped; nothing depends on addresses or hash seeds.

>>> import torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(2, 2)))
>>> _ = gm(torch.ones(1, 2))
>>> "<td>0</td>" in records_table_html(fxdebug.records(gm))
True
"""

from __future__ import annotations

import html

from .formatting import dtype_text, shape_text

__all__ = ["records_table_html", "records_rows"]

HEADERS = ("key", "op", "shape", "dtype", "mean", "std", "min", "max", "norm", "zeros %",
           "non-finite")
GRAD_HEADERS = ("grad norm", "grad non-finite")
HEADER_TITLES = {"std": "Bessel-corrected (n - 1), as tensor.std(), over the finite values",
                 "norm": "Frobenius norm of the finite values"}


def records_rows(records, floatfmt: str = ".4g") -> tuple[list[str], list[tuple[list[str], bool]]]:
    """``(headers, [(cells, has_nonfinite), ...])`` of every capture, in execution order."""
    grads = records.grads if len(records.grads) else None
    headers = list(HEADERS) + (list(GRAD_HEADERS) if grads is not None else [])
    rows = []
    for record in records.records():
        stats = record.stats
        cells = [record.key, record.op, shape_text(record.shape),
                 dtype_text(record.dtype),
                 *(format(value, floatfmt) for value in stats[:4]), format(stats.norm, floatfmt),
                 format(stats.zeros_pct, ".1f"), str(stats.nonfinite)]
        bad = stats.nonfinite > 0
        if grads is not None:
            grad = grads.record(record.key) if record.key in grads else None
            if grad is None:
                cells += ["-", "-"]
            else:
                cells += [format(grad.stats.norm, floatfmt), str(grad.stats.nonfinite)]
                bad = bad or grad.stats.nonfinite > 0
        rows.append((cells, bad))
    return headers, rows


def records_table_html(records, table_id: str = "records") -> str:
    """One HTML table of every capture (numbers right-aligned, non-finite rows marked)."""
    headers, rows = records_rows(records)
    head = "".join(f'<th title="{html.escape(HEADER_TITLES[h])}">{html.escape(h)}</th>'
                   if h in HEADER_TITLES else f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for cells, bad in rows:
        tds = "".join(f"<td>{html.escape(c)}</td>" if i < 4 else
                      f'<td class="num">{html.escape(c)}</td>' for i, c in enumerate(cells))
        body.append(f'<tr{" class=" + chr(34) + "nonfinite" + chr(34) if bad else ""}>{tds}</tr>')
    return (f'<table class="fxdebug-records" id="{html.escape(table_id)}"><thead><tr>{head}'
            f'</tr></thead><tbody>{"".join(body)}</tbody></table>')
