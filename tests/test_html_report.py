"""fxdebug.report in a real browser (headless chromium), and its content against the run.

The page is loaded with ``chromium --headless --dump-dom`` (the DOM after the
scripts ran) and ``--screenshot``; the test skips only where no chromium is
installed (.ci/run installs it when it can).
"""

from __future__ import annotations

import operator
import re
import shutil
import subprocess

import pytest
import torch
import torchvision

import fxdebug

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(name)), None)


def _browser(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        model.fc.bias[3] = float("nan")
    gm = fxdebug.instrument(model, grads=True)
    gm(x).sum().backward()

    def faulty(gm):
        for node in gm.graph.nodes:
            if node.meta.get("fxdebug_key") == "layer2.0.iadd":
                node.target = operator.sub
        return gm

    with pytest.raises(fxdebug.PassEquivalenceError) as caught:
        fxdebug.PassManager([faulty], check_inputs=(x,)).run(torchvision.models.resnet18().eval())
    path = tmp_path_factory.mktemp("report") / "report.html"
    fxdebug.report([gm, caught.value.report], path)
    return path, fxdebug.records(gm)


def test_page_is_self_contained(page):
    text = page[0].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<script src" not in text and "<link" not in text


def test_rows_match_records_and_nonfinite_marked(page):
    text = page[0].read_text()
    path, rec = page
    bad = [key for key in rec.keys() if rec.record(key).stats.nonfinite]
    assert bad == ["fc"]  # ground truth: the NaN bias poisons only the output
    marked = re.findall(r'<tr class="nonfinite"><td>([^<]+)</td>', text)
    assert marked == bad
    assert len(re.findall(r"<tr[^>]*><td>[^<]+</td><td>", text.split("fxdebug-diff")[0])) >= len(rec)


@pytest.mark.skipif(BROWSER is None, reason="no chromium installed (.ci/run installs it)")
def test_renders_in_chromium(page, tmp_path):
    path, rec = page
    dom = _browser("--dump-dom", f"file://{path}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 2  # activation and gradient norm charts
    assert 'class="changed first"' in dom.stdout  # the first divergence: layer2.0.iadd
    assert re.search(r'class="changed first"><td>~</td><td>layer2\.0\.iadd</td>', dom.stdout)
    shot = tmp_path / "report.png"
    result = _browser("--window-size=1200,900", f"--screenshot={shot}", f"file://{path}")
    assert result.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repr_html(page):
    path, rec = page
    assert "fxdebug-records" in rec._repr_html_()
    before = fxdebug.trace(torch.nn.Sequential(torch.nn.ReLU()))
    after = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    assert 'class="added"' in fxdebug.diff(before, after)._repr_html_()


def test_report_rejects_what_it_cannot_show(tmp_path):
    with pytest.raises(TypeError, match="no recorded run"):
        fxdebug.report(torch.nn.ReLU(), tmp_path / "r.html")


def test_report_command(tmp_path):
    from subprocesses import fxdebug_cli
    (tmp_path / "net.py").write_text(
        "import torch\ndef build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())\n")
    result = fxdebug_cli("report", "net.py:build", "--input", "2,3", "-o", "out.html",
                         "--pass", "functionalize", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out.html").read_text()
    assert text.count("<svg") == 2 and "pass functionalize" in text
