"""run.py runs under the numeric settings the dump's results were computed under; load() sets none.

A dump made in a process with non-default settings (float32 matmul precision,
deterministic algorithms, oneDNN off, float64 default dtype) is run by run.py
in a fresh process, whose settings are torch's: run.py sets them again, says
which, and the results are those recorded; the settings read back in that
process after run.py are those of the dumping process. ``load()`` in a fresh
process leaves torch's settings as they were. A changed weight still fails,
also where run.py widens its tolerances for a nondeterministic CUDA dump.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torchvision

import fxdebug
from fxdebug.dumping import numeric_settings
from fxdebug.dumping.numeric_settings import read_settings
from subprocesses import child_env, run_python, start_python

SETTINGS_PY = numeric_settings.__file__

# Read in the child through torch's public getters, after whatever the child did.
READ_BACK = ("print('after:', torch.get_float32_matmul_precision(), "
             "torch.are_deterministic_algorithms_enabled(), torch.backends.mkldnn.enabled, "
             "torch.get_default_dtype())")

RUN_PY = ("import runpy, sys, torch\n"
          "folder = sys.argv[1]\n"
          "sys.argv = ['run.py', '--backward']\n"
          "try:\n"
          "    runpy.run_path(folder + '/run.py', run_name='__main__')\n"
          "except SystemExit as exc:\n"
          "    print('exit', exc.code)\n" + READ_BACK + "\n")

LOAD = ("import sys, torch\n"
        "from folder_import import import_folder\n"
        "model = import_folder(sys.argv[1] + '/dumped').load()\n"
        "inputs = torch.load(sys.argv[1] + '/dumped/inputs.pt', weights_only=True)\n"
        "print('dtype:', model(*inputs).dtype)\n" + READ_BACK + "\n")

TORCH_DEFAULTS = "after: highest False True torch.float32"
DUMPED = "after: medium True False torch.float64"


class WithOffsets(torch.nn.Module):
    """resnet18's logits plus ``arange / 10``: float64 under a float64 default dtype."""

    def __init__(self):
        super().__init__()
        self.net = torchvision.models.resnet18(num_classes=10)

    def forward(self, x):
        logits = self.net(x)
        return logits + torch.arange(logits.shape[1]) / 10


def _dump_under_other_settings(folder) -> str:
    """Dump WithOffsets with every global it changes restored afterwards (one thread: with more,
    MKL's products are reproducible only under MKL_CBWR; the children run with one too)."""
    torch.manual_seed(0)
    model, x = WithOffsets(), torch.randn(2, 3, 64, 64)
    threads = torch.get_num_threads()
    before = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.mkldnn.enabled,
              torch.get_default_dtype(), torch.backends.cuda.matmul.fp32_precision,
              torch.backends.mkldnn.matmul.fp32_precision)  # the last two: what "medium" set
    try:
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True)
        torch.backends.mkldnn.enabled = False
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        return fxdebug.dump(fxdebug.instrument(model), x, folder=folder)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])
        torch.backends.mkldnn.enabled = before[3]
        torch.set_default_dtype(before[4])
        torch.backends.cuda.matmul.fp32_precision = before[5]
        torch.backends.mkldnn.matmul.fp32_precision = before[6]


def _copy(folder, to, change_weight=False, claim_cuda=False, drop_settings=False) -> str:
    shutil.copytree(folder, to)
    if change_weight:  # one layer's weight 1% larger: a real difference
        weights = torch.load(os.path.join(to, "weights.pt"), weights_only=True)
        weights["net.layer4.1.conv2.weight"] *= 1.01
        torch.save(weights, os.path.join(to, "weights.pt"))
    if claim_cuda:  # as if dumped on CUDA without deterministic algorithms
        with open(os.path.join(to, "settings.json")) as handle:
            recorded = json.load(handle)
        recorded["devices"] = ["cuda"]
        recorded["settings"]["torch.are_deterministic_algorithms_enabled()"] = False
        with open(os.path.join(to, "settings.json"), "w") as handle:
            json.dump(recorded, handle)
    if drop_settings:  # a dump made before settings.json existed
        os.remove(os.path.join(to, "settings.json"))
    return str(to)


def test_run_py_reproduces_a_dump_made_under_other_settings_and_load_sets_none(tmp_path):
    unchanged = read_settings()
    folder = _dump_under_other_settings(str(tmp_path / "dumped"))
    assert read_settings() == unchanged  # the test process is as it was
    with open(os.path.join(folder, "settings.json")) as handle:
        recorded = json.load(handle)
    assert recorded["devices"] == ["cpu"] and recorded["nondeterministic"] == ""
    assert recorded["settings"]["torch.get_default_dtype()"] == "torch.float64"
    expected = torch.load(os.path.join(folder, "expected.pt"), weights_only=True)
    assert expected["outputs"]["output"].dtype == torch.float64  # what the settings changed

    folders = {"same": folder,
               "changed_cuda": _copy(folder, tmp_path / "changed_cuda", change_weight=True,
                                     claim_cuda=True),
               "claimed_cuda": _copy(folder, tmp_path / "claimed_cuda", claim_cuda=True),
               "older": _copy(folder, tmp_path / "older", drop_settings=True)}
    env = child_env(OMP_NUM_THREADS="1")  # the dump's count: nothing to set but the above
    waits = {name: start_python(["-c", RUN_PY, path], str(tmp_path), env, None)
             for name, path in folders.items()}
    waits["load"] = start_python(["-c", LOAD, str(tmp_path)], str(tmp_path), env, None)
    procs = {name: wait(300) for name, wait in waits.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)

    same = procs["same"].stdout
    assert same.splitlines()[0] == (
        "settings applied as when dumped: torch.set_default_dtype(torch.float64), "
        "torch.use_deterministic_algorithms(True), torch.set_float32_matmul_precision('medium'), "
        "torch.backends.mkldnn.enabled = False"), same
    assert "NOT as when dumped" not in same and "nondeterministic" not in same
    assert "outputs: 1 equal" in same and "DIFFERENT" not in same and "close" not in same, same
    assert "ok: same results as when dumped\nexit 0\n" + DUMPED in same, same

    # load() in the user's process: the model runs under the process's own settings
    assert procs["load"].stdout == "dtype: torch.float32\n" + TORCH_DEFAULTS + "\n", procs["load"].stdout

    claimed = procs["claimed_cuda"].stdout  # on the CPU every run gives the same bits: spread 0
    assert ("nondeterministic: the dump ran on CUDA without torch.use_deterministic_algorithms(True), "
            "where torch does not promise the same bits twice; tolerances widened by 4x the spread "
            "of 3 runs here (largest: outputs 0, gradients 0)") in claimed, claimed
    assert "ok: same results as when dumped\nexit 0" in claimed, claimed
    widened = procs["changed_cuda"].stdout  # even the widened tolerances do not hide a real change
    assert "nondeterministic: the dump ran on CUDA" in widened, widened
    assert "FAILED: results differ from when dumped\nexit 1" in widened, widened
    assert "net.layer4.1.conv2.weight: DIFFERENT (max abs diff" in widened, widened

    older = procs["older"].stdout  # without the settings: torch's defaults, another dtype
    assert older.startswith("settings: none recorded (an older dump)"), older
    assert "output: DIFFERENT (shape (2, 10) torch.float32, expected (2, 10) torch.float64)" in older
    assert "FAILED" in older and "exit 1\n" + TORCH_DEFAULTS in older, older


# numeric_settings needs only torch (run.py carries it): imported by its path, without fxdebug.
# Each way runs in a process forked from this child, whose settings are torch's; the recorded
# settings are applied in another such fork (a process costs seconds, a fork milliseconds).
FORKS = ("import importlib.util, json, os, sys, torch\n"
         f"spec = importlib.util.spec_from_file_location('numeric_settings', {SETTINGS_PY!r})\n"
         "settings = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(settings)\n"
         "def in_fork(action):\n"
         "    read, write = os.pipe()\n"
         "    pid = os.fork()\n"
         "    if pid == 0:\n"
         "        os.close(read)\n"
         "        try:\n"
         "            out = json.dumps(action())\n"
         "        except BaseException as exc:\n"
         "            out = json.dumps({'error': repr(exc)})\n"
         "        os.write(write, out.encode())\n"
         "        os._exit(0)\n"
         "    os.close(write)\n"
         "    data = b''\n"
         "    while chunk := os.read(read, 1 << 16):\n"
         "        data += chunk\n"
         "    os.waitpid(pid, 0)\n"
         "    return json.loads(data)\n"
         "def set_and_read(way):\n"
         "    exec(way, {'torch': torch, 'os': os})\n"
         "    return settings.read_settings()\n"
         "results = [in_fork(settings.read_settings)]\n"
         "for way in json.loads(sys.argv[1]):\n"
         "    recorded = in_fork(lambda: set_and_read(way))\n"
         "    results.append([way, recorded, in_fork(\n"
         "        lambda: [settings.apply_settings(recorded), settings.read_settings()])])\n"
         "print(json.dumps(results))\n")


def test_every_way_of_setting_them_is_applied_again_in_a_fresh_process():
    ways = [
        "torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = False",
        "torch.backends.cudnn.deterministic = True; torch.backends.cudnn.benchmark = True",
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'",  # the new API, legacy unreadable
        "torch.backends.fp32_precision = 'tf32'",
        "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'; torch.backends.mkldnn.deterministic = True",
        "torch.set_float32_matmul_precision('high')",
        "torch.use_deterministic_algorithms(True, warn_only=True)",
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False; "
        "torch.backends.cuda.enable_flash_sdp(False); torch.backends.cuda.enable_math_sdp(False)",
        "os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'",
        "os.environ['MKL_CBWR'] = 'AUTO'",
    ]
    proc = run_python(FORKS, json.dumps(ways))
    assert proc.returncode == 0, proc.stderr
    defaults, *results = json.loads(proc.stdout)
    assert "error" not in defaults and len(results) == len(ways), proc.stdout
    for way, recorded, applied in results:
        assert "error" not in recorded and "error" not in applied, (way, recorded, applied)
        assert recorded != defaults, way  # the way changed something
        (done, failed), now = applied
        assert failed == [] and done, (way, done, failed)
        assert now == recorded, (way, {k: (v, now.get(k)) for k, v in recorded.items() if now.get(k) != v})
