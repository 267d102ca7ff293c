"""Saved runs, streaming to disk, and comparing two runs.

Ground truth: the in-memory Records of the same forward (bitwise), forward hooks
on the eager model (where two runs' outputs first differ), the bytes on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.runs.saved_runs import DATA, MANIFEST
from subprocesses import child_env

X = (2, 3, 64, 64)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(expected, loaded) -> None:
    """Bitwise: keys in order, tensors, statistics, shapes, dtypes, ops."""
    assert loaded.keys() == expected.keys()
    for key in expected.keys():
        want, got = expected.record(key), loaded.record(key)
        assert (got.op, got.shape, got.dtype, got.via) == \
            (want.op, want.shape, want.dtype, want.via)
        if want.value is None:
            assert loaded[key] == expected[key]
        else:
            assert got.value.dtype == want.value.dtype and got.value.shape == want.value.shape
            assert _bits(got.value) == _bits(want.value), key
        assert got.stats == want.stats or str(got.stats) == str(want.stats), key


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval(), torch.randn(*X)


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_round_trip_is_bitwise_with_gradients(resnet, tmp_path, mode):
    model, x = resnet
    gm = fxdebug.instrument(model, grads=True, mode=mode)
    model.zero_grad()
    gm(x).sum().backward()
    rec = fxdebug.records(gm)
    path = fxdebug.save_records(rec, tmp_path / "run", step=3)
    loaded = fxdebug.load_records(path)
    assert isinstance(loaded, fxdebug.Records)
    _assert_same(rec, loaded)
    _assert_same(rec.grads, loaded.grads)
    assert loaded.table(wide=True) == rec.table(wide=True)
    assert loaded.context["step"] == 3 and loaded.context["dtype"] == "float32"
    assert loaded.context["device"] == "cpu" and loaded.context["torch"] == torch.__version__
    assert loaded.context["rank"] is None and loaded.context["world_size"] is None
    # file:line of a module call: the line in BasicBlock.forward that calls conv1
    file, line = loaded.locations["layer1.0.conv1"].rsplit(":", 1)
    source = open(torchvision.models.resnet.__file__).read().splitlines()[int(line) - 1]
    assert file.endswith("resnet.py") and "self.conv1(x)" in source
    page = fxdebug.report(loaded, tmp_path / "report.html")
    assert "layer4.1.conv2" in open(page).read()
    model.zero_grad()


def _mapping_of(path: str, address: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping of ``path`` that holds ``address``."""
    found, current = None, None
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(part, 16) for part in head[0].split("-"))
                current = {"path": head[-1] if len(head) >= 6 else "", "start": start, "end": end}
                if current["path"] == path and start <= address < end:
                    found = current
            elif found is current and found is not None and head[0] == "Rss:":
                found["rss_kb"] = int(head[1])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc needed")
def test_loading_reads_no_tensor_bytes(tmp_path):
    big = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8))
    gm = fxdebug.instrument(big)
    gm(torch.randn(1024, 256))
    path = fxdebug.save_records(fxdebug.records(gm), tmp_path / "big")
    data = os.path.realpath(os.path.join(path, DATA))
    assert os.path.getsize(data) > 32 * 2**20
    loaded = fxdebug.load_records(path)
    value = loaded.record("1").value
    mapping = _mapping_of(data, value.data_ptr())
    assert mapping is not None, "the tensor is not a view of the memory-mapped tensors.bin"
    assert mapping["rss_kb"] < 1024, mapping  # nothing read yet
    assert loaded.record("0").value.untyped_storage().data_ptr() == \
        value.untyped_storage().data_ptr()  # one mapping for the whole run
    expected = fxdebug.records(gm)["1"]
    assert torch.equal(loaded["1"], expected)
    assert _mapping_of(data, value.data_ptr())["rss_kb"] * 1024 >= expected.numel() * 4 * 0.9
    loaded["1"].fill_(0)  # a private mapping: the file is not changed
    assert torch.equal(fxdebug.load_records(path)["1"], expected)


def _small_run(tmp_path, name="run"):
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()))
    gm(torch.randn(2, 4))
    return fxdebug.save_records(fxdebug.records(gm), tmp_path / name)


def test_errors_name_the_file_and_what_to_do(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(fxdebug.SavedRunError, match="nowhere.*does not exist"):
        fxdebug.load_records(missing)
    path = _small_run(tmp_path)
    with pytest.raises(fxdebug.SavedRunError, match="already holds a saved run"):
        fxdebug.save_records(fxdebug.load_records(path), path)
    data = os.path.join(path, DATA)
    size = os.path.getsize(data)
    with open(data, "r+b") as handle:
        handle.truncate(size - 70)
    with pytest.raises(fxdebug.SavedRunError, match=f"{DATA} is truncated.*Save the run again"):
        fxdebug.load_records(path)
    manifest = os.path.join(_small_run(tmp_path, "b"), MANIFEST)
    text = open(manifest).read()
    open(manifest, "w").write(text[: len(text) // 2])
    with pytest.raises(fxdebug.SavedRunError, match=f"{MANIFEST} is truncated or corrupt"):
        fxdebug.load_records(os.path.dirname(manifest))
    manifest = os.path.join(_small_run(tmp_path, "c"), MANIFEST)
    content = json.load(open(manifest))
    content["version"] = 99
    json.dump(content, open(manifest, "w"))
    with pytest.raises(fxdebug.SavedRunError, match="format 99, newer.*Upgrade fxdebug"):
        fxdebug.load_records(os.path.dirname(manifest))
    assert issubclass(fxdebug.SavedRunError, fxdebug.FxdebugError)


def test_stale_capture_stays_stale_on_disk(tmp_path):
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    out = gm(torch.ones(1, 3))
    with torch.no_grad():
        out.add_(1)  # written after the forward: the capture of "0" is a view of out
    path = fxdebug.save_records(fxdebug.records(gm), tmp_path / "stale")
    with pytest.raises(fxdebug.StaleCaptureError):
        fxdebug.load_records(path)["0"]


# -- streaming ---------------------------------------------------------------------------
def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fxdebug-run-writer"]


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_streaming_equals_in_memory_capture(resnet, tmp_path, mode):
    model, x = resnet
    folder = tmp_path / "runs"
    memory = fxdebug.instrument(model, grads=True, mode=mode)
    model.zero_grad()
    memory(x).sum().backward()
    expected = fxdebug.records(memory)
    streaming = fxdebug.instrument(model, grads=True, mode=mode, folder=folder)
    model.zero_grad()
    fxdebug.set_step(streaming, 41)
    streaming(x).sum().backward()
    saved = fxdebug.records(streaming)
    _assert_same(expected, saved)
    _assert_same(expected.grads, saved.grads)
    assert saved.table(wide=True) == expected.table(wide=True)
    assert not _writer_threads()  # records() flushed: the thread has stopped
    fxdebug.set_step(streaming, 42)
    with torch.no_grad():
        streaming(x + 1)
    fxdebug.records(streaming)
    assert sorted(os.listdir(folder)) == ["run-000001", "run-000002"]
    assert fxdebug.load_records(folder).context["step"] == 42
    assert "layer4.1.conv2" in open(fxdebug.report(streaming, tmp_path / "s.html")).read()
    first = fxdebug.load_records(folder, run=1)
    assert first.context["step"] == 41 and len(first.grads) == len(expected.grads)
    with torch.no_grad():
        fc = fxdebug.load_records(folder).record("fc")
        assert torch.equal(fc.value, model(x + 1)) if mode == "tensor" else \
            fc.stats.max == model(x + 1).max().item()
    with pytest.raises(fxdebug.SavedRunError, match="no run 7.*runs 1 to 2"):
        fxdebug.load_records(folder, run=7)
    model.zero_grad()


def test_streaming_holds_a_bounded_queue(tmp_path):
    """Every node of a model with more activation bytes than the queue: all written, all equal."""
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    x = torch.randn(256, 512)  # 512 KiB per activation, 6 MiB in all
    gm = fxdebug.instrument(model, capture="all", folder=tmp_path / "r")
    recorder = gm.fxdebug_recorder
    recorder.run_writer.limit_bytes = 2**20
    gm(x)
    assert 2**19 <= recorder.run_writer.peak_bytes <= 2**20  # one activation, never two
    saved = fxdebug.records(gm)
    memory = fxdebug.instrument(model, capture="all")
    memory(x)
    _assert_same(fxdebug.records(memory), saved)


def test_writer_error_surfaces_at_flush_and_exit_flushes(tmp_path):
    """A file size limit stands in for a full disk: the error names the run folder."""
    script = f"""
import resource, signal, torch, fxdebug
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))
linear = torch.nn.Sequential(torch.nn.Linear(64, 256))
gm = fxdebug.instrument(linear, folder={str(tmp_path / 'full')!r})
gm(torch.randn(512, 64))
try:
    fxdebug.records(gm)
except fxdebug.SavedRunError as exc:
    print("ERROR", exc)
gm3 = fxdebug.instrument(linear, folder={str(tmp_path / 'next')!r})
gm3(torch.randn(512, 64))  # its capture fails to write in the background
gm3.fxdebug_recorder.run_writer.wait_written()  # the failure is in, nothing raised yet
try:
    gm3(torch.randn(512, 64))  # the next forward says so
    print("NEXT FORWARD ran")
except fxdebug.SavedRunError as exc:
    print("NEXT FORWARD", exc)
gm2 = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), folder={str(tmp_path / 'exit')!r})
gm2(torch.tensor([-1.0, 2.0]))
"""
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ERROR writing the run" in done.stdout and "run-000001" in done.stdout
    assert "free disk space" in done.stdout
    assert "NEXT FORWARD writing the run" in done.stdout and "next/run-000001" in done.stdout
    # the second module never flushed: the exit did, the run is complete
    assert torch.equal(fxdebug.load_records(tmp_path / "exit")["0"], torch.tensor([0.0, 2.0]))


# -- comparing runs ----------------------------------------------------------------------
def _first_hook_difference(model_a, model_b, x, keys) -> str:
    """Ground truth: forward hooks on both eager models, the first module output that differs."""
    from hooks import hook_captures
    a, b = hook_captures(model_a, x), hook_captures(model_b, x)
    return next(key for key in a if key in keys and not torch.equal(a[key], b[key]))


def test_planted_perturbation_is_found_at_its_key(resnet, tmp_path):
    import copy
    model, x = resnet
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.layer2[1].conv2.weight[3] += 0.05
    gm_a, gm_b = fxdebug.instrument(model), fxdebug.instrument(perturbed)
    gm_a(x)
    gm_b(x)
    rec_a, rec_b = fxdebug.records(gm_a), fxdebug.records(gm_b)
    truth = _first_hook_difference(model, perturbed, x, set(rec_a.keys()))
    assert truth == "layer2.1.conv2"
    for a, b in ((rec_a, rec_b), (fxdebug.save_records(rec_a, tmp_path / "a"),
                                  fxdebug.save_records(rec_b, tmp_path / "b"))):
        report = fxdebug.compare_runs(a, b)
        assert not report.ok and isinstance(report, fxdebug.base.report.Report)
        first = report.first_divergence
        assert first.key == truth and first.op == "Conv2d"
        assert first.location.split(":")[0].endswith("resnet.py")
        before = report.entries[:[e.key for e in report.entries].index(truth)]
        assert before and all(e.status == "equal" for e in before)
        expected = (rec_b[truth] - rec_a[truth]).abs().max().item()
        assert first.max_abs == pytest.approx(expected, rel=1e-6)
    table = report.table()
    assert f"first divergence: {truth} (Conv2d" in table
    os.environ["COLUMNS"] = "80"
    try:
        fitted = report.table().splitlines()  # all but the first divergence, kept whole
        assert max(len(line) for line in fitted if not line.startswith("first divergence:")) <= 80
        assert [line for line in fitted if line.startswith("first divergence:")] == \
            [line for line in table.splitlines() if line.startswith("first divergence:")]
    finally:
        del os.environ["COLUMNS"]
    assert len(table.splitlines()) >= len(rec_a) + 5  # every key listed
    page = open(fxdebug.report(report, tmp_path / "cmp.html")).read()
    assert truth in page and "DIFFERS" in page


def test_identical_runs_and_keys_in_one_run_only(resnet, tmp_path):
    model, x = resnet
    gm = fxdebug.instrument(model, grads=True)
    gm(x).sum().backward()
    a = fxdebug.records(gm)
    gm(x).sum().backward()
    b = fxdebug.records(gm)
    report = fxdebug.compare_runs(a, b)
    assert report.ok and report.first_divergence is None
    assert {e.status for e in report.entries} == {"equal"}
    assert len(report.grad_entries) == len(a.grads) > 0
    shallow = fxdebug.instrument(model, depth=0)
    shallow(x)
    report = fxdebug.compare_runs(fxdebug.records(shallow), a)
    only_b = [e.key for e in report.entries if e.status == "only b"]
    assert not report.ok and "layer1.0.conv1" in only_b
    assert "only in b" in report.table()
    model.zero_grad()


def test_float32_against_bfloat16_uses_bfloat16_tolerances():
    # inputs and weights exact in bfloat16: the runs differ only by bfloat16's rounding
    lin = torch.nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
        lin.bias.copy_(lin.bias.bfloat16().float())
    x = torch.randn(4, 16).bfloat16().float()
    gm = fxdebug.instrument(torch.nn.Sequential(lin))
    gm(x)
    a = fxdebug.records(gm)
    gm_b = fxdebug.instrument(torch.nn.Sequential(lin).bfloat16())
    gm_b(x.bfloat16())
    b = fxdebug.records(gm_b)
    report = fxdebug.compare_runs(a, b)
    assert report.ok and report.entries[0].status == "close", report.table()
    assert "float32 vs bfloat16" in report.entries[0].detail
    assert not fxdebug.compare_runs(a, b, rtol=1.3e-6, atol=1e-5).ok


def test_cli_exit_codes(resnet, tmp_path, capsys):
    model, x = resnet
    gm = fxdebug.instrument(model)
    gm(x)
    a = fxdebug.save_records(fxdebug.records(gm), tmp_path / "a")
    same = fxdebug.save_records(fxdebug.records(gm), tmp_path / "same")
    with torch.no_grad():
        model.fc.bias[0] += 1.0
    try:
        gm(x)
        b = fxdebug.save_records(fxdebug.records(gm), tmp_path / "b")
    finally:
        with torch.no_grad():
            model.fc.bias[0] -= 1.0

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fxdebug", "compare", *args],
                              env=child_env(COLUMNS="80"), capture_output=True, text=True,
                              timeout=300)
    equal, different = cli(a, same), cli(a, b)
    assert equal.returncode == 0 and "verdict: EQUAL" in equal.stdout, equal.stderr
    assert different.returncode == 1 and "first divergence: fc (Linear" in different.stdout
    # at 80 columns the table is fitted, the first divergence line is not: grep finds it whole
    assert max(len(line) for line in different.stdout.splitlines()
               if not line.startswith("first divergence:")) <= 80
    found = [line for line in different.stdout.splitlines() if "first divergence:" in line]
    assert len(found) == 1 and "resnet.py:" in found[0] and "max abs" in found[0], found
    missing = cli(a, str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr  # trouble, as diff
    assert cli(a).returncode == 2  # bad arguments
    from fxdebug.cli import main
    assert main(["compare", a, str(tmp_path / "nowhere")]) == 2  # trouble, as diff and cmp
    assert "does not exist" in capsys.readouterr().err


def test_guide_blocks_run_alone(tmp_path):
    """Every python block of docs/saved-runs.md runs as written in a fresh interpreter."""
    from test_readme import FENCE
    from subprocesses import REPO
    text = open(os.path.join(REPO, "docs", "saved-runs.md")).read()
    found = [m.group("body") for m in FENCE.finditer(text) if m.group("lang") == "python"]
    assert len(found) >= 4
    import concurrent.futures

    def run(code):
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=300,
                              env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, found))
    for number, done in enumerate(results):
        assert done.returncode == 0, f"block {number}:\n{done.stderr[-3000:]}"


def test_context_records_rank_and_world_size(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()), folder=tmp_path / "runs")
        gm(torch.ones(2))
        fxdebug.records(gm)
        context = fxdebug.load_records(tmp_path / "runs").context
    finally:
        dist.destroy_process_group()
    assert (context["rank"], context["world_size"]) == (0, 1)


def test_stats_runs_compare_by_statistics(resnet):
    model, x = resnet
    gm = fxdebug.instrument(model, mode="stats")
    gm(x)
    a = fxdebug.records(gm)
    gm(x * 1.5)
    b = fxdebug.records(gm)
    report = fxdebug.compare_runs(a, b)
    assert report.first_divergence.key == "conv1"  # the first node: its input changed
    assert "statistics compared" in report.first_divergence.detail
    assert fxdebug.compare_runs(a, a).ok


PEAK = """
import resource, sys, torch, fxdebug
model = torch.nn.Sequential(*[torch.nn.Tanh() for _ in range(40)])  # 8 MiB per activation
x = torch.randn(2 * 2**20)
run = {"eager": lambda m: m, "memory": lambda m: fxdebug.instrument(m),
       "save_to": lambda m: fxdebug.instrument(m, folder=sys.argv[2])}[sys.argv[1]](model)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
with torch.no_grad():
    run(x)
if sys.argv[1] == "save_to":
    fxdebug.records(run)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) // 2**20)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc needed")
def test_streaming_every_capture_stays_near_eager_memory(tmp_path):
    """320 MiB of activations: in memory they are all held, streamed at most the queue's 64."""
    peaks = {}
    for variant in ("eager", "memory", "save_to"):
        done = subprocess.run([sys.executable, "-c", PEAK, variant, str(tmp_path / "runs")],
                              env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        peaks[variant] = int(done.stdout.split()[-1])
    assert peaks["memory"] >= 300, peaks
    assert peaks["save_to"] <= peaks["eager"] + 64 + 24, peaks
    assert len(fxdebug.load_records(tmp_path / "runs")) == 40


def test_load_records_finishes_this_process_run_of_a_deleted_module(tmp_path):
    """``gm(x); del gm; load_records(path)``: the run this process still writes there is finished
    first, whichever folder is named (the save_to folder or the run's own)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    for name, folder in (("save_to", lambda path: path), ("run", lambda path: path / "run-000001")):
        gm = fxdebug.instrument(model, capture="all", folder=tmp_path / name)
        gm(x)
        del gm
        rec = fxdebug.load_records(folder(tmp_path / name))
        assert list(rec.keys()) == ["input", "0", "1"] and torch.equal(rec["input"], x)
        assert torch.equal(rec["1"], model(x)) and torch.equal(rec["0"], model[0](x))


@pytest.mark.filterwarnings("ignore:std..\\W+degrees of freedom")  # a bias of 1: NaN, as torch
def test_run_saved_with_population_std_reads_as_tensor_std(tmp_path):
    """Format 1 saved the population std (divide by n): loading converts it to tensor.std()."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1))
    gm = fxdebug.instrument(model, grads=True)
    gm(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
    path = fxdebug.save_records(fxdebug.records(gm), tmp_path / "old")
    manifest_path = os.path.join(path, MANIFEST)
    manifest = json.load(open(manifest_path))
    assert manifest["version"] == 2
    values = {key: fxdebug.records(gm)[key].double() for key in fxdebug.records(gm).keys()}
    manifest["version"] = 1  # written the old way: the population std of each tensor
    for entry in manifest["records"]:
        entry["stats"][1] = values[entry["key"]].std(correction=0).item()
    grads = dict(model.named_parameters())
    for item in manifest["parameters"]:
        item[2][1] = grads[item[0]].grad.double().std(correction=0).item()
    json.dump(manifest, open(manifest_path, "w"))
    loaded = fxdebug.load_records(path)
    for key, value in values.items():
        assert loaded.record(key).stats.std == pytest.approx(value.std().item(), rel=1e-12), key
    for name, _, stats in loaded.parameter_grads():
        assert stats.std == pytest.approx(grads[name].grad.double().std(correction=1).item(), rel=1e-12,
                                          nan_ok=True)  # a bias of 1: NaN, as torch
    # a run written now holds tensor.std() as it is
    fresh = fxdebug.load_records(fxdebug.save_records(fxdebug.records(gm), tmp_path / "new"))
    for key, value in values.items():
        assert fresh.record(key).stats.std == pytest.approx(value.std().item(), rel=1e-6), key


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_float32_against_bfloat16_says_what_rounding_explains(resnet, tmp_path, mode):
    """Rounding only: explained, with the bound. A real BatchNorm change in the bfloat16 run:
    that key is the first beyond rounding, and every key before it stays within."""
    import copy
    model, x = resnet
    gm = fxdebug.instrument(model, mode=mode)
    gm(x)
    a = fxdebug.save_records(fxdebug.records(gm), tmp_path / "float32")
    low = copy.deepcopy(model).to(torch.bfloat16)
    gm_low = fxdebug.instrument(low, mode=mode)
    gm_low(x.bfloat16())
    rounding_only = fxdebug.compare_runs(a, fxdebug.save_records(fxdebug.records(gm_low),
                                                                  tmp_path / "bfloat16"))
    assert not rounding_only.ok  # bfloat16's tolerances alone call every key different
    check = rounding_only.rounding
    assert check is not None and check.dtype == "bfloat16" and check.explained, check
    assert check.checked == len(rounding_only.entries)
    text = rounding_only.table(wide=True)
    assert ("rounding: bfloat16 rounding can explain every difference in the "
            f"{check.checked} keys") in text and "16 x eps(bfloat16)" in text

    with torch.no_grad():  # a real change: this BatchNorm's running variance, 4x
        low.layer2[0].bn1.running_var.mul_(4.0)
    gm_low(x.bfloat16())
    changed = fxdebug.compare_runs(a, fxdebug.records(gm_low))
    check = changed.rounding
    assert not check.explained and check.beyond[0] == "layer2.0.bn1", check.beyond[:3]
    keys = [entry.key for entry in changed.entries]
    assert all(not e.beyond_rounding for e in changed.entries[:keys.index("layer2.0.bn1")])
    line = [l for l in changed.table(wide=True).splitlines() if l.startswith("first beyond")]
    assert line and line[0].startswith("first beyond rounding: layer2.0.bn1 (BatchNorm2d, ")
    assert "resnet.py:" in line[0]
    same_dtype = fxdebug.compare_runs(a, a)
    assert same_dtype.rounding is None and "rounding" not in same_dtype.table(wide=True)
