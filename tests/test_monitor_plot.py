"""A monitor's series as pictures: the PNG's lines (read back from its matplotlib Figure) and the
HTML page's SVG and value tables hold the float64 statistics that forward hooks saw at the
logged steps, the default keys are the ones that moved most by those hook values, every spike
step is marked, labels are escaped, and matplotlib's global state is left alone."""

from __future__ import annotations

import html
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError
from fxdebug.monitoring.folder import SeriesFolder

RTOL = 1e-5  # float32 statistics vs float64 torch ops
STEPS, EVERY = 10, 2
NAMES = ["0", "1", "2", "3"]
SPIKES = [
    {"step": 4, "trigger": "loss 30 > 10x the window max 2 <script>alert(1)</script>",
     "reproduced": True, "first_divergence": "3", "first_nonfinite": None, "rank": 0,
     "text": "replay of step 4\n<b>not bold</b>"},
    {"step": 7, "trigger": "grad_norm is nan", "reproduced": False, "first_divergence": None,
     "first_nonfinite": "1", "rank": 0, "text": ""},
]
BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(name)), None)


def rms(tensors) -> float:
    values = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    return values.pow(2).mean().sqrt().item()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A monitored run whose last Linear's weight is multiplied by 1.5 every step; the float64
    rms of every module output (forward hooks) and of layer 0's parameters, and the loss, at
    each logged step; two spike lines written as the monitor writes them."""
    folder = tmp_path_factory.mktemp("series")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                              torch.nn.Linear(8, 3))
    kept: dict[str, torch.Tensor] = {}
    for name in NAMES:
        net.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: kept.__setitem__(name, output))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    expected: dict[str, dict[int, float]] = {}
    with fxdebug.monitor(net, every=EVERY, folder=folder) as mon:
        for step in range(STEPS):
            loss = mon.model(torch.randn(4, 6)).sum()
            loss.backward()
            if step % EVERY == 0:
                for name in NAMES:
                    expected.setdefault(f"{name}.out.rms", {})[step] = rms([kept[name]])
                expected.setdefault("0.param.rms", {})[step] = rms(net[0].parameters())
                expected.setdefault("loss.out.mean", {})[step] = loss.double().item()
            mon.step(loss)
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                net[3].weight.mul_(1.5)
    writer = SeriesFolder(folder, rank=0, world=1, config={"every": EVERY})
    for spike in SPIKES:
        writer.write_spike(spike)
    writer.close()
    return fxdebug.load_series(folder), expected


def most_moved(expected: dict[str, dict[int, float]]) -> list[str]:
    """The out keys by |log(last / first)| of the hook values, most first."""
    outs = [label for label in expected if label.endswith(".out.rms") and label[0].isdigit()]
    score = {label: abs(math.log(list(expected[label].values())[-1]
                                 / list(expected[label].values())[0])) for label in outs}
    return sorted(outs, key=lambda label: -score[label])


def assert_values(steps, values, truth: dict[int, float], what: str) -> None:
    assert [int(s) for s in steps] == sorted(truth), what
    for step, value in zip(steps, values):
        assert math.isclose(float(value), truth[int(step)], rel_tol=RTOL), (
            f"{what} at step {step}: drawn {value!r}, float64 of the hooked value "
            f"{truth[int(step)]!r}")


def drawn(axis) -> dict[str, tuple[list, list]]:
    return {line.get_gid(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in axis.get_lines()}


def test_figure_lines_are_the_hooked_values_top_movers_first_spikes_marked(run):
    pytest.importorskip("matplotlib")
    series, expected = run
    figure = series.figure()
    top, bottom = figure.axes
    lines = {gid: data for gid, data in drawn(top).items() if not gid.startswith("mark-")}
    assert list(lines) == most_moved(expected)  # the planted layer first
    assert list(lines)[0] == "3.out.rms"
    for label, (steps, values) in lines.items():
        assert_values(steps, values, expected[label], label)
    (label, (steps, values)), = [(g, d) for g, d in drawn(bottom).items()
                                 if not g.startswith("mark-")]
    assert label == "loss.out.mean"
    assert_values(steps, values, expected["loss.out.mean"], label)
    for axis in (top, bottom):  # every spike step, on every axis, at its step
        marks = {g: [float(x) for x in d[0]] for g, d in drawn(axis).items()
                 if g.startswith("mark-")}
        assert marks == {"mark-4": [4.0, 4.0], "mark-7": [7.0, 7.0]}
    labels = {text.get_gid(): text.get_text() for text in top.texts}
    assert labels["mark-4"].strip() == "spike 4: 3" and labels["mark-7"].strip() == "spike 7"
    positive = [v for label in lines for v in expected[label].values()]
    assert top.get_yscale() == ("log" if max(positive) >= 10 * min(positive) else "linear")
    losses = list(expected["loss.out.mean"].values())
    assert bottom.get_yscale() == ("log" if min(losses) > 0 and max(losses) >= 10 * min(losses)
                                   else "linear")


def test_chosen_keys_kinds_and_window(run):
    pytest.importorskip("matplotlib")
    series, expected = run
    top = series.figure(keys=["0"], kinds=("out", "param"), window=3).axes[0]
    lines = {g: d for g, d in drawn(top).items() if not g.startswith("mark-")}
    assert list(lines) == ["0.out.rms", "0.param.rms"]
    for label, (steps, values) in lines.items():
        window = {s: v for s, v in expected[label].items() if s >= STEPS - 3 * EVERY}
        assert_values(steps, values, window, label)
    with pytest.raises(FxdebugError, match="no param series of 2 .*2 has kinds out, grad"):
        series.figure(keys="2", kinds=("param",))
    with pytest.raises(FxdebugError, match="unknown stat"):
        series.chart_data(stat="ratio")


def test_plot_saves_a_png_and_leaves_matplotlib_as_it_was(run, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    series, _ = run
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # the user's backend; a switch to Agg would show
    try:
        params = dict(matplotlib.rcParams)
        figures = plt.get_fignums()
        path = series.plot(tmp_path / "drift.png")
        assert matplotlib.get_backend() == "svg"
        assert dict(matplotlib.rcParams) == params
        assert plt.get_fignums() == figures
    finally:
        matplotlib.use(before)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def nonfinite_folder(path) -> str:
    """A series written by hand: key ``a`` is a constant 2**step (4 values), none finite at
    step 2; key ``b`` a constant -(step + 1)."""
    writer = SeriesFolder(path, rank=0, world=1, config={"every": 1})
    for step in range(5):
        a = 2.0 ** step
        row_a = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 4.0, 0.0, 0.0] if step == 2 else \
            [4.0, a, 0.0, a, a, 0.0, 0.0, 4.0, 0.0, 0.0]
        b = -(step + 1.0)
        writer.write(step, {"a.out": row_a, "b.out": [4.0, b, 0.0, b, b, 0.0, 0.0, 4.0, 0.0, 0.0]})
    writer.close()
    return str(path)


def test_a_nonfinite_value_is_a_gap_and_negative_values_a_linear_scale(tmp_path):
    pytest.importorskip("matplotlib")
    series = fxdebug.load_series(nonfinite_folder(tmp_path))
    top = series.figure(keys=["a"]).axes[0]
    steps, values = drawn(top)["a.out.rms"]
    assert [int(s) for s in steps] == [0, 1, 2, 3, 4]
    assert [v for i, v in enumerate(values) if i != 2] == [1.0, 2.0, 8.0, 16.0]
    assert math.isnan(values[2]) and top.get_yscale() == "log"
    assert series.figure(keys=["a", "b"], stat="mean").axes[0].get_yscale() == "linear"
    svg = fxdebug.reporting.series_html.series_html(series.chart_data(keys=["a"]))
    assert len(re.findall(r'<polyline data-label="a\.out\.rms"', svg)) == 2  # broken at step 2


def points(svg: str) -> dict[str, list[tuple[float, float]]]:
    found: dict[str, list[tuple[float, float]]] = {}
    for label, text in re.findall(r'<polyline data-label="([^"]+)"[^>]* points="([^"]+)"', svg):
        found.setdefault(html.unescape(label), []).extend(
            tuple(float(v) for v in pair.split(",")) for pair in text.split())
    return found


def values_table(section: str) -> dict[str, dict[int, float]]:
    head, body = re.search(r'<table class="fxdebug-series-values"><thead><tr>(.*?)</tr></thead>'
                           r"<tbody>(.*?)</tbody>", section).groups()
    labels = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", head)][1:]
    table: dict[str, dict[int, float]] = {label: {} for label in labels}
    for row in re.findall(r"<tr>(.*?)</tr>", body):
        step, *cells = re.findall(r'<td class="num">(.*?)</td>', row)
        for label, cell in zip(labels, cells):
            table[label][int(step)] = float(cell)
    return table


@pytest.fixture(scope="module")
def page(run, tmp_path_factory):
    series, _ = run
    path = tmp_path_factory.mktemp("page") / "series.html"
    fxdebug.report(series, path)
    return path


def test_page_charts_tables_and_spikes_hold_the_hooked_values(run, page):
    series, expected = run
    text = page.read_text()
    charts = text.split('<svg class="fxdebug-series-chart"')[1:]
    assert len(charts) == 2  # the keys, the loss
    order = most_moved(expected)
    for chart, labels in zip(charts, (order, ["loss.out.mean"])):
        table = values_table(chart)
        assert list(table) == labels
        drawn_points = points(chart.split("</svg>")[0])
        assert list(drawn_points) == labels
        for label in labels:
            truth = expected[label]
            assert list(table[label]) == sorted(truth)
            for step, value in table[label].items():
                assert math.isclose(value, truth[step], rel_tol=1e-5), (label, step)
            xs = [x for x, _ in drawn_points[label]]
            ys = [y for _, y in drawn_points[label]]
            assert xs == sorted(xs) and len(xs) == len(truth)
            by_value = sorted(range(len(ys)), key=lambda i: list(truth.values())[i])
            assert sorted(range(len(ys)), key=lambda i: -ys[i]) == by_value  # higher is up
        for step, x in re.findall(r'<line class="mark" data-step="(\d+)" x1="([\d.]+)"', chart):
            if int(step) in expected["loss.out.mean"]:  # a logged step: on its points
                index = sorted(expected["loss.out.mean"]).index(int(step))
                assert math.isclose(float(x), xs[index], abs_tol=0.01)
        assert re.findall(r'<line class="mark" data-step="(\d+)"', chart) == ["4", "7"]
    drift_rows = re.search(r"<h3>drift of rms.*?<tbody>(.*?)</tbody>", text).group(1)
    assert [re.findall(r"<td>(.*?)</td>", row)[0] + ".out.rms"
            for row in re.findall(r"<tr>(.*?)</tr>", drift_rows)] == order
    spike_rows = re.search(r"<h3>spikes replayed \(2\)</h3>.*?<tbody>(.*?)</tbody>", text).group(1)
    cells = [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)]
             for row in re.findall(r"<tr>(.*?)</tr>", spike_rows)]
    assert cells == [["4", SPIKES[0]["trigger"], "yes", "3", "-", "0"],
                     ["7", "grad_norm is nan", "no", "-", "1", "0"]]


def test_page_is_self_contained_and_escapes_what_users_wrote(run, page):
    text = page.read_text()
    assert run[0]._repr_html_() in text  # Jupyter shows the same section
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<script src" not in text and "<link" not in text
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<b>not bold</b>" not in text and "&lt;b&gt;not bold&lt;/b&gt;" in text


@pytest.mark.skipif(BROWSER is None, reason="no chromium installed (.ci/run installs it)")
def test_page_renders_in_chromium(page):
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"file://{page}"], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count('<svg class="fxdebug-series-chart"') == 2
    assert dom.stdout.count('<line class="mark"') == 4


def test_series_command_plot_html_and_spike_list(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    series, expected = run
    from fxdebug.cli import main
    png, page = tmp_path / "s.png", tmp_path / "s.html"
    assert main(["series", series.folder, "--kind", "out", "--plot", str(png),
                 "--html", str(page)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] + ".out.rms" for line in printed[3:3 + 4]] == most_moved(expected)
    at = printed.index("spikes replayed: 2")
    spikes = [line.split()[:3] for line in printed[at + 3:at + 5]]
    assert spikes == [["4", "loss", "30"], ["7", "grad_norm", "is"]]
    assert printed[at + 3].split()[-2:] == ["yes", "3"]
    assert printed[at + 4].split()[-2:] == ["no", "-"]
    assert all(len(line) <= 80 for line in printed[:at + 5]), printed
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert page.read_text().count('<svg class="fxdebug-series-chart"') == 2
    assert printed[-2:] == [f"plot: {png}", f"page: {page}"]


def test_series_command_without_matplotlib_says_how_to_get_it(run, tmp_path, capsys,
                                                             monkeypatch):
    series, _ = run
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if it were not installed
    from fxdebug.cli import main
    png, page = tmp_path / "x.png", tmp_path / "x.html"
    assert main(["series", series.folder, "--plot", str(png), "--html", str(page)]) == 2
    printed = capsys.readouterr()
    assert "pip install 'fxdebug[plot]'" in printed.err, printed
    assert printed.out == ""  # failed before the table, the page or the plot
    assert not png.exists() and not page.exists()


def test_a_spike_the_monitor_replayed_is_marked_at_its_step(tmp_path):
    pytest.importorskip("matplotlib")
    from fxdebug.monitoring.spikes import Factor
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    reports = {}
    with fxdebug.monitor(net, every=2, folder=tmp_path,
                         spikes=[Factor("loss", 10, window=8, min_steps=2)]) as mon:
        for step in range(8):
            x = torch.randn(16, 4) * (1e3 if step == 5 else 1.0)  # one bad batch, off a logged step
            loss = mon.model(x).pow(2).mean()
            loss.backward()
            report = mon.step(loss)
            if report is not None:
                reports[step] = report
            net.zero_grad()
    assert list(reports) == [5]
    series = fxdebug.load_series(tmp_path)
    for axis in series.figure().axes:
        marks = {g: [float(x) for x in d[0]] for g, d in drawn(axis).items() if g.startswith("mark-")}
        assert marks == {"mark-5": [5.0, 5.0]}
    section = fxdebug.reporting.series_html.series_html(series.chart_data())
    assert re.findall(r'<line class="mark" data-step="(\d+)"', section) == ["5", "5"]
    assert html.escape(reports[5].trigger) in section
