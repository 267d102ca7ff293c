"""fxdebug.dump: folders that run elsewhere, give the original outputs, and fail cleanly."""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import tempfile
import textwrap
import zipfile

import pytest
import torch
import torchvision

import fxdebug
from dump_models import DictInput, Gadgets, Opaque
from models import LaterInplace, NestedOutputs, Reuse, SeedOneNet, ViewAugAssign
from subprocesses import (HASH_SEEDS, REPO, fxdebug_cli, outputs_under_hash_seeds, run_python,
                          run_python_unprivileged)


# name -> (build the model, input shape, leaf modules, capture)
MODELS = {
    "resnet18": (torchvision.models.resnet18, (1, 3, 64, 64), (), "modules"),
    "mobilenet_v3_small": (torchvision.models.mobilenet_v3_small, (1, 3, 64, 64), (), "modules"),
    "efficientnet_b0": (torchvision.models.efficientnet_b0, (1, 3, 64, 64), (), "modules"),  # fx.wrap'd stochastic_depth
    "seed001_mynet": (SeedOneNet, (1, 3, 8, 8), (), "all"),  # the lambda attribute is traced through
    "nested_outputs": (NestedOutputs, (2, 8), (), "all"),
    "reuse": (Reuse, (3, 6), (), "modules"),
    "view_aug_assign": (ViewAugAssign, (2, 4), (), "all"),
    "later_inplace": (LaterInplace, (2, 3, 5, 5), (), "all"),  # backward fails, in eager too
    "gadgets": (Gadgets, (2, 6), (Opaque,), "modules"),
    "plain_reuse": (Reuse, (3, 6), (), None),  # no capture nodes
}

# The dumping process's CPU thread count, and the one the child starts with: the child
# reproduces the dump bit for bit only by setting what settings.json recorded. One thread for
# the dump: with more, MKL's matrix products are reproducible only under MKL_CBWR (which must be
# set before this process first used MKL), and run.py says so (tests/test_dump_threads.py).
DUMP_THREADS, CHILD_THREADS = 1, 2

# Runs in a fresh interpreter, in another working directory, after the folders were moved.
CHILD = textwrap.dedent("""
    import contextlib, importlib, io, json, os, runpy, sys
    import torch
    from fxdebug.dumping.numeric_settings import apply_settings
    from folder_import import import_folder
    moved, results, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = {}
    for name in sorted(os.listdir(moved)):
        torch.set_num_threads(threads)                   # not the dumping process's count
        with open(os.path.join(moved, name, "settings.json")) as handle:
            applied, failed = apply_settings(json.load(handle)["settings"])
        package = import_folder(os.path.join(moved, name))  # the folder is a package
        model = package.load()
        inputs = torch.load(os.path.join(moved, name, "inputs.pt"), weights_only=True)
        with torch.no_grad():
            value = model(*inputs)
        rec = {}
        if hasattr(model, "fxdebug_recorder"):
            import fxdebug
            rec = {k: fxdebug.records(model)[k].clone() for k in fxdebug.records(model).keys()}
        text = io.StringIO()
        sys.argv = ["run.py", "--backward"]
        with contextlib.redirect_stdout(text):
            try:
                runpy.run_path(os.path.join(moved, name, "run.py"), run_name="__main__")
                status = None
            except SystemExit as exc:
                status = exc.code
        out[name] = {"value": value, "records": rec, "run_status": status, "run_stdout": text.getvalue(),
                     "applied": applied, "failed": failed,
                     "tied": getattr(getattr(model, "b", None), "weight", None) is getattr(getattr(model, "a", None), "weight", 0)}
    torch.save(out, results)
""")


def _flatten(value, prefix="output"):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in value.__dataclass_fields__}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    flat = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}/{key}"))
    return flat


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Dump every model, move the folders, load and run them in a fresh process elsewhere."""
    base = tmp_path_factory.mktemp("dumps")
    made, moved, elsewhere = base / "made", base / "moved", base / "elsewhere"
    made.mkdir()
    elsewhere.mkdir()
    originals = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(DUMP_THREADS)
    try:
        _dump_every_model(made, originals)
    finally:
        torch.set_num_threads(threads)
    os.rename(made, moved)
    results = base / "results.pt"
    proc = run_python(CHILD, str(moved), str(results), str(CHILD_THREADS), cwd=str(elsewhere))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return originals, torch.load(results, weights_only=False), moved, base


def _dump_every_model(made, originals):
    for name, (factory, shape, leaves, capture) in MODELS.items():
        torch.manual_seed(0)
        model = factory().eval()
        x = torch.randn(shape)
        with torch.no_grad():
            eager = _flatten(model(x.clone()))
        gm = fxdebug.trace(model, leaf_modules=leaves)
        records = {}
        if capture:
            gm = fxdebug.instrument(gm, capture=capture)
            with torch.no_grad():
                gm(x.clone())
            rec = fxdebug.records(gm)  # the graph's captures: inside leaf modules is not dumped
            records = {k: rec[k].clone() for k in rec.keys() if rec.record(k).via == "graph"}
        fxdebug.dump(gm, x, folder=made / name, allow_pickled_modules=name == "gadgets")  # Opaque
        originals[name] = {"eager": eager, "records": records, "model": model}


@pytest.mark.parametrize("name", list(MODELS))
def test_moved_folder_gives_the_eager_outputs(round_trip, name):
    """Bit for bit, in a process that started with another CPU thread count and set the
    dump's from settings.json (efficientnet_b0 gives other last bits with 1 and 2 threads)."""
    originals, results, _, _ = round_trip
    assert results[name]["applied"] == [f"torch.set_num_threads({DUMP_THREADS})"]
    assert results[name]["failed"] == []
    eager, got = originals[name]["eager"], _flatten(results[name]["value"])
    assert eager.keys() == got.keys()
    for key in eager:
        assert torch.equal(eager[key], got[key]), key


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_nodes_work_in_the_dump(round_trip, name):
    originals, results, _, _ = round_trip
    want, got = originals[name]["records"], results[name]["records"]
    assert list(got) == list(want) and (want or MODELS[name][3] is None)
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.parametrize("name", list(MODELS))
def test_run_py_compares_outputs_and_gradients(round_trip, name):
    _, results, _, _ = round_trip
    result = results[name]
    assert result["run_status"] == 0, result["run_stdout"]
    stdout = result["run_stdout"]
    # a fresh process under the dump's settings (this test process's are torch's): none to change
    assert stdout.splitlines()[0] == "settings: as when dumped, nothing to change"
    assert "outputs: " in stdout and " equal" in stdout.splitlines()[1]
    assert "DIFFERENT" not in stdout and "MISSING" not in stdout
    if name == "later_inplace":  # eager backward fails on its in-place write: so does the dump's
        assert "gradients: backward failed: one of the variables needed for gradient " in stdout
        assert "  as it did when dumped" in stdout
    else:
        assert "gradients: " in stdout and "gradients: backward failed" not in stdout
    assert ("tensors captured" in stdout) == (MODELS[name][3] is not None)  # the Records table
    assert stdout.rstrip().endswith("ok: same results as when dumped")


def test_no_absolute_path_in_any_file(round_trip):
    _, _, moved, base = round_trip
    forbidden = [REPO.encode(), str(base).encode(), b"/tmp/", os.path.expanduser("~").encode()]
    checked = 0
    for root, _, files in os.walk(moved):
        for filename in files:
            path = os.path.join(root, filename)
            if filename.endswith(".pt"):  # zip archives: check everything but raw tensor data
                with zipfile.ZipFile(path) as archive:
                    parts = [archive.read(n) for n in archive.namelist() if "/data/" not in n]
                blob = b"\n".join(parts)
            else:
                with open(path, "rb") as handle:
                    blob = handle.read()
            for needle in forbidden:
                assert needle not in blob, (path, needle)
            checked += 1
    assert checked >= 8 * len(MODELS)


def test_fx_wrapped_functions_are_imported_and_rewrapped(round_trip):
    _, _, moved, _ = round_trip
    efficientnet = (moved / "efficientnet_b0" / "module.py").read_text()
    assert ("from torchvision.ops.stochastic_depth import stochastic_depth as "
            "torchvision_ops_stochastic_depth_stochastic_depth") in efficientnet
    assert '\ntorch.fx.wrap("torchvision_ops_stochastic_depth_stochastic_depth")\n' in efficientnet
    gadgets = (moved / "gadgets" / "module.py").read_text()
    assert "from dump_models import scaled_softplus as dump_models_scaled_softplus" in gadgets
    assert "dump_models_scaled_softplus(a, 2.0)" in gadgets


def test_dumped_module_traces_again_with_the_wrapped_call_kept(round_trip):
    import dump_models
    _, _, moved, _ = round_trip
    model = _import_path("gadgets_module", moved / "gadgets" / "module.py").load()
    x = torch.load(moved / "gadgets" / "inputs.pt", weights_only=True)[0]
    gm = fxdebug.trace(model)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(dump_models.scaled_softplus) == 1, "torch.fx.wrap in module.py keeps it one call"
    assert torch.equal(gm(x), model(x))


def test_every_statement_names_its_node_and_source_line(round_trip):
    _, _, moved, _ = round_trip
    code = (moved / "resnet18" / "module.py").read_text()
    body = code.split("    def forward(self, x : torch.Tensor) -> torch.Tensor:\n")[1].split("\n\n")[0]
    lines = body.splitlines()
    assert len(lines) > 100
    for line in lines:
        assert "  # [" in line, line
        assert ";" not in line.split("  # [")[0], line  # one statement a line, no fx deletions
    assert any(line.strip().startswith("layer1_0_conv2 = ") and
               line.endswith("# [layer1.0.conv2] torchvision/models/resnet.py:96") for line in lines)
    capture_lines = [line for line in lines if "fxdebug_runtime_capture(" in line]
    assert capture_lines and all(line.strip().startswith("capture_") for line in capture_lines)
    mapping = json.loads((moved / "resnet18" / "breakpoints.json").read_text())
    line = mapping["nodes"]["layer1.0.conv2"]["line"]
    assert code.splitlines()[line - 1].strip().startswith("layer1_0_conv2 = ")
    assert mapping["nodes"]["layer1.0.conv2"]["inputs"] == ["layer1_0_relu"]


def test_structure_is_code_and_weights_are_stored_once(round_trip):
    originals, results, moved, _ = round_trip
    code = (moved / "resnet18" / "module.py").read_text()
    assert "self.conv1 = torch.nn.Conv2d(3, 64, kernel_size=(7, 7)" in code
    assert "pickled" not in code and not (moved / "resnet18" / "pickled_modules.pt").exists()
    weights = torch.load(moved / "resnet18" / "weights.pt", weights_only=True)
    model = originals["resnet18"]["model"]
    expected = dict(model.named_parameters()) | dict(model.named_buffers())
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    size = os.path.getsize(moved / "resnet18" / "weights.pt")
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert nbytes <= size < nbytes * 1.01, "each tensor stored once"


def test_tied_frozen_nonpersistent_and_pickled_leaf(round_trip):
    originals, results, moved, _ = round_trip
    folder = moved / "gadgets"
    weights = torch.load(folder / "weights.pt", weights_only=True)
    assert "offset" in weights and "opaque.shift" in weights  # non-persistent buffers kept
    assert "b.weight" not in weights and "a.weight" in weights  # tied: stored once
    assert results["gadgets"]["tied"], "b.weight is a.weight again after load()"
    code = (folder / "module.py").read_text()
    assert "FROZEN = ('frozen.weight', 'frozen.bias')" in code
    assert 'self.register_buffer("offset", torch.empty((6,), dtype=torch.float32), persistent=False)' in code
    assert 'self.opaque = pickled["opaque"]' in code
    readme = (folder / "README.md").read_text()
    assert "* `opaque` (Opaque): " in readme and "pickled_modules.pt" in readme
    pickled = torch.load(folder / "pickled_modules.pt", weights_only=False)
    assert pickled["opaque"].inner.weight.device.type == "meta", "weights are not pickled twice"


def test_plain_graph_needs_torch_only(round_trip):
    _, _, moved, _ = round_trip
    code = (moved / "plain_reuse" / "module.py").read_text()
    imports = [line for line in code.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import os", "import torch"]  # no capture nodes, no fxdebug import


def _import_path(name, path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dict_inputs_flattened_by_fx_round_trip(tmp_path):
    model = DictInput().eval()
    gm = fxdebug.instrument(fxdebug.trace(model, concrete_args={"d": {"a": torch.fx.PH,
                                                                      "b": torch.fx.PH}}))
    d = {"a": torch.randn(2, 3), "b": torch.randn(2, 3)}
    folder = fxdebug.dump(gm, d, folder=tmp_path / "dict_input")
    code = open(os.path.join(folder, "module.py")).read()
    assert "        d_1 = d['a']  " in code and "        return {'y': add}  " in code  # no pytree
    loaded = _import_path("dict_input_module", os.path.join(folder, "module.py")).load()
    with torch.no_grad():
        assert torch.equal(loaded(d)["y"], model(d)["y"])


def test_dumped_files_identical_across_hash_seeds(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, torchvision, fxdebug
        from dump_models import Gadgets, Opaque
        from models import NestedOutputs
        out = sys.argv[1]
        torch.manual_seed(0)
        fxdebug.dump(fxdebug.instrument(torchvision.models.mobilenet_v3_small().eval()),
                     torch.randn(1, 3, 32, 32), folder=out + "/mobilenet")
        fxdebug.dump(fxdebug.instrument(NestedOutputs().eval(), capture="all"),
                     torch.randn(2, 8), folder=out + "/nested")
        gm = fxdebug.instrument(fxdebug.trace(Gadgets().eval(), leaf_modules=[Opaque]))
        fxdebug.dump(gm, torch.randn(2, 6), folder=out + "/gadgets", allow_pickled_modules=True)
    """)
    for seed in HASH_SEEDS:
        (tmp_path / f"seed{seed}").mkdir()
    outputs_under_hash_seeds(script, lambda seed: [str(tmp_path / f"seed{seed}")], cwd=str(tmp_path))
    trees = []
    for seed in HASH_SEEDS:
        out = tmp_path / f"seed{seed}"
        tree = {}
        for root, _, files in os.walk(out):
            for filename in files:
                path = os.path.join(root, filename)
                with open(path, "rb") as handle:
                    tree[os.path.relpath(path, out)] = handle.read()
        trees.append(tree)
    assert trees[0].keys() == trees[1].keys() == trees[2].keys()
    # Code, inputs, breakpoints and READMEs must be byte-identical. expected.pt holds what the
    # model computed: the processes ran side by side, and torch does not promise the same
    # last bits of a reduction under another load or thread split, so its numbers are
    # compared with torch.testing's tolerances, and its manifest line (a hash of them) is left out.
    numeric = [name for name in trees[0] if name.endswith(("weights.pt", "expected.pt"))]
    compared = [name for name in trees[0] if name not in numeric]
    assert len(compared) >= 3 * 7
    for name in compared:
        first = trees[0][name]
        if name.endswith("manifest.json"):
            first, *others = (_without_expected_hash(tree[name]) for tree in trees)
            assert all(other == first for other in others), name
            continue
        assert first == trees[1][name] == trees[2][name], name
    for name in numeric:
        if name.endswith("expected.pt"):
            first, *others = (torch.load(io.BytesIO(tree[name]), weights_only=False)
                              for tree in trees)
            leaves, spec = torch.utils._pytree.tree_flatten(first)
            for other in others:
                other_leaves, other_spec = torch.utils._pytree.tree_flatten(other)
                assert other_spec == spec, name
                for got, want in zip(other_leaves, leaves):
                    if isinstance(want, torch.Tensor):
                        torch.testing.assert_close(got, want, equal_nan=True, msg=name)
                    else:
                        assert got == want, name


def _without_expected_hash(manifest: bytes) -> dict:
    files = json.loads(manifest)
    files["files"].pop("expected.pt")
    return files


# -- failures: clear message, nothing half-written ------------------------------------------
def _entries(path):
    return sorted(os.listdir(path))


def test_existing_folder_is_not_clobbered(tmp_path):
    gm = fxdebug.instrument(SeedOneNet().eval())
    x = torch.randn(1, 3, 8, 8)
    target = tmp_path / "out"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(fxdebug.FxdebugError, match="already exists.*overwrite=True"):
        fxdebug.dump(gm, x, folder=target)
    with pytest.raises(fxdebug.FxdebugError, match="not an fxdebug dump"):
        fxdebug.dump(gm, x, folder=target, overwrite=True)
    assert _entries(tmp_path) == ["out"] and _entries(target) == ["mine.txt"]
    earlier = tmp_path / "earlier"
    fxdebug.dump(gm, x, folder=earlier)
    fxdebug.dump(fxdebug.instrument(SeedOneNet().eval(), capture="all"), x, folder=earlier, overwrite=True)
    assert "capture_view" in (earlier / "module.py").read_text()  # replaced by the new dump
    assert _entries(tmp_path) == ["earlier", "out"]


def test_locally_defined_leaf_module_is_a_clear_error(tmp_path):
    class LocalBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), LocalBlock()).eval()
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[LocalBlock]))
    with pytest.raises(fxdebug.FxdebugError) as caught:
        fxdebug.dump(gm, torch.randn(2, 4), folder=tmp_path / "out")
    message = str(caught.value)
    assert "submodule '1'" in message and "defined inside a function" in message
    assert "top level of an importable module" in message
    assert _entries(tmp_path) == []


def test_locally_defined_function_call_names_the_node(tmp_path):
    def halve(x):
        return x / 2

    gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval())
    last = [n for n in gm.graph.nodes if n.op == "call_module"][-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.call_function(halve, (last,))
    node.meta["fxdebug_key"] = "halve"
    last.replace_all_uses_with(node, delete_user_cb=lambda user: user is not node)
    gm.recompile()
    with pytest.raises(fxdebug.FxdebugError, match=r"node 'halve' .* defined inside a function"):
        fxdebug.dump(gm, torch.randn(2, 4), folder=tmp_path / "out")
    assert _entries(tmp_path) == []


_DUMP_AS_NOBODY = """
import sys, tempfile, torch, fxdebug
from models import SeedOneNet
gm = fxdebug.instrument(SeedOneNet().eval())
fxdebug.dump(gm, torch.randn(1, 3, 8, 8), folder=tempfile.mkdtemp() + "/warm")  # imports done as root
become_unprivileged()
try:
    fxdebug.dump(gm, torch.randn(1, 3, 8, 8), folder=sys.argv[1], overwrite=sys.argv[2] == "overwrite")
except fxdebug.FxdebugError as error:
    print(error)
    sys.exit(3)
"""


def test_read_only_parent():
    """Root writes into read-only folders: the dump runs in a child process as ``nobody``."""
    base = tempfile.mkdtemp(prefix="fxdebug-ro-")  # not under pytest's 0700 folder: nobody can enter
    os.chmod(base, 0o755)
    parent = pathlib.Path(base) / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        proc = run_python_unprivileged(_DUMP_AS_NOBODY, str(parent / "out"), "new")
        assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
        assert "parent is writable" in proc.stdout
        assert _entries(parent) == []
    finally:
        parent.chmod(0o755)
        shutil.rmtree(base)


def test_disk_write_failure_leaves_nothing(tmp_path):
    """A file-size limit makes writing a tensor file fail half-way, as a full disk would."""
    script = textwrap.dedent("""
        import resource, signal, sys, torch, fxdebug
        from models import SeedOneNet
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        gm = fxdebug.instrument(SeedOneNet().eval())
        try:
            fxdebug.dump(gm, torch.randn(1, 3, 8, 8), folder=sys.argv[1])
        except fxdebug.FxdebugError as error:
            print(error)
            sys.exit(3)
    """)
    proc = run_python(script, str(tmp_path / "out"), cwd=str(tmp_path))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"writing [\w.]+ failed \(File too large\); nothing was written", proc.stdout)
    assert _entries(tmp_path) == []


def test_inputs_that_weights_only_load_refuses(tmp_path):
    class Box:
        pass

    class TakesAnything(torch.nn.Module):
        def forward(self, x, extra):
            return x + 1

    gm = fxdebug.trace(TakesAnything())
    with pytest.raises(fxdebug.FxdebugError, match="weights_only=True"):
        fxdebug.dump(gm, torch.ones(2), Box(), folder=tmp_path / "out")
    assert _entries(tmp_path) == []


# -- command line --------------------------------------------------------------------------
def _fxdebug(*args, cwd):
    return fxdebug_cli(*args, cwd=str(cwd))


def test_cli_dump(tmp_path):
    """(tests/test_debug.py runs a CLI-written folder to the end under pdb.)"""
    result = _fxdebug("dump", "torchvision.models:mobilenet_v3_small", "mnv3", "--input", "1,3,64,64",
                      "--capture", "features.*.block", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote mnv3" in result.stdout
    code = (tmp_path / "mnv3" / "module.py").read_text()
    assert "'features.1.block', 'Sequential')" in code and "'features.0.0'" not in code
    inputs = torch.load(tmp_path / "mnv3" / "inputs.pt", weights_only=True)
    assert [tuple(t.shape) for t in inputs] == [(1, 3, 64, 64)]
    again = _fxdebug("dump", "torchvision.models:mobilenet_v3_small", "mnv3", "--input", "1,3,64,64",
                     cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr  # an error: trouble
    assert "already exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
