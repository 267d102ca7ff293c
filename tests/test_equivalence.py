"""check_equivalence / assert_equivalent: verdicts, the first divergent node, structure paths.

Ground truth comes from elsewhere: eager outputs, torch.testing.assert_close,
torch.autograd.grad, and a torch.fx.Interpreter run of both graphs that finds
the first node whose value differs by brute force.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import operator
import re
import textwrap

import pytest
import torch
import torch.fx as fx
import torchvision
from torch import nn

import fxdebug
from fxdebug.tracing.keys import assign_missing_keys, inherit_key
from faults import image, insert_after, node, one_thread, resnet  # noqa: F401 (fixtures)
from subprocesses import fxdebug_cli, outputs_under_hash_seeds



# -- helpers ------------------------------------------------------------------------------

def interpreter_values(gm: fx.GraphModule, *inputs) -> dict[str, torch.Tensor]:
    """Every node's value by key, computed by torch.fx.Interpreter (cloned when made)."""
    values: dict[str, torch.Tensor] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and "fxdebug_key" in n.meta:
                values[n.meta["fxdebug_key"]] = out.detach().clone()
            return out

    with torch.no_grad():
        Keep(gm).run(*[x.clone() for x in inputs])
    return values


def first_differing_key(reference_gm, candidate_gm, *inputs) -> str:
    """Brute force: the first key (reference order) whose value is not allclose in the candidate."""
    ref = interpreter_values(reference_gm, *inputs)
    cand = interpreter_values(candidate_gm, *inputs)
    for key, value in ref.items():
        if key in cand and (value.shape != cand[key].shape or
                            not torch.allclose(value, cand[key], rtol=1.3e-6, atol=1e-5)):
            return key
    raise AssertionError("no node differs")


class Standardize(nn.Module):
    """A hand-written layer norm: a sub and a div at known nodes."""

    def forward(self, x):
        centered = x - x.mean(dim=-1, keepdim=True)
        scale = centered.pow(2).mean(dim=-1, keepdim=True).add(1e-5).sqrt()
        return centered / scale


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm1 = Standardize()
        self.fc2 = nn.Linear(32, 32)
        self.norm2 = Standardize()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.norm1(self.fc1(x)).relu()
        return self.head(self.norm2(self.fc2(x)))


def swap_operands(gm: fx.GraphModule, key: str) -> fx.GraphModule:
    target = node(gm, key)
    target.args = (target.args[1], target.args[0])
    gm.recompile()
    return gm


# -- correct transforms -------------------------------------------------------------------

def test_correct_transforms_are_ok_with_an_empty_error_table(resnet, image):
    plain = torch.fx.symbolic_trace(resnet)  # `out += identity` becomes add: keys differ there
    torch_add = fxdebug.trace(resnet)        # every in-place add replaced by torch.add
    for n in list(torch_add.graph.nodes):
        if n.target is operator.iadd:
            with torch_add.graph.inserting_after(n):
                new = torch_add.graph.call_function(torch.add, n.args)
            n.replace_all_uses_with(new)
            torch_add.graph.erase_node(n)
            inherit_key(new, n)
    torch_add.recompile()
    for candidate in (plain, fxdebug.trace(resnet), torch_add):
        with torch.no_grad():
            assert torch.equal(resnet(image), candidate(image))  # ground truth
        report = fxdebug.check_equivalence(resnet, candidate, image)
        assert report.ok and report.first_divergence is None and report.max_error == 0.0
        assert report.divergences == [] and report.nodes == []
        assert "verdict: EQUIVALENT (1/1 outputs agree)" in report.table()
        forced = fxdebug.check_equivalence(resnet, candidate, image, localize=True)
        assert forced.ok and forced.divergences == [] and len(forced.nodes) >= 68
        assert forced.unmatched_reference == [] and forced.unmatched_candidate == []
        assert "nodes out of tolerance: 0 of" in forced.table()


def test_plain_fx_add_is_matched_to_fxdebugs_iadd_by_inputs(resnet, image):
    gm = torch.fx.symbolic_trace(resnet)
    assign_missing_keys(gm.graph)
    keys = [n.meta["fxdebug_key"] for n in gm.graph.nodes]
    assert "layer1.0.add" in keys and "layer1.0.iadd" not in keys
    report = fxdebug.check_equivalence(resnet, gm, image, localize=True)
    row = [r for r in report.nodes if r.key == "layer1.0.iadd"][0]
    assert (row.candidate_key, row.match, row.ok) == ("layer1.0.add", "inputs", True)


# -- faulty transforms: first_divergence is exactly the faulted node ------------------------

def test_constant_scale_inserted_after_a_node(resnet, image):
    gm = fxdebug.trace(resnet)
    insert_after(gm, "layer2.0.bn1", operator.mul, 1.5)
    report = fxdebug.check_equivalence(resnet, gm, image)
    first = report.first_divergence
    assert not report.ok and first.key == "layer2.0.bn1"
    assert (first.match, first.via, first.candidate_op) == ("in its place", "layer2.0.relu",
                                                            "operator.mul")
    assert first.location.endswith("torchvision/models/resnet.py:93")  # out = self.bn1(out)
    # ground truth: the bn1 output itself is unchanged, what relu reads is bn1 * 1.5
    ref = interpreter_values(fxdebug.trace(resnet), image)
    assert torch.allclose(first.max_abs * torch.ones(()), (ref["layer2.0.bn1"] * 0.5).abs().max())
    upstream = [r for r in report.nodes if r.key in ("layer2.0.conv1", "layer1.1.relu_1")]
    assert len(upstream) == 2 and all(r.ok and r.max_abs == 0 for r in upstream)


def test_activation_replaced_in_place_keeps_the_key(resnet, image):
    gm = fxdebug.trace(resnet)
    relu = node(gm, "layer3.0.relu")
    relu.op, relu.target, relu.kwargs = "call_function", torch.sigmoid, {}
    gm.recompile()
    report = fxdebug.check_equivalence(resnet, gm, image)
    first = report.first_divergence
    assert (first.key, first.candidate_key, first.match) == ("layer3.0.relu",) * 2 + ("key",)
    assert (first.op, first.candidate_op) == ("ReLU", "torch.sigmoid")
    assert first.key == first_differing_key(fxdebug.trace(resnet), gm, image)
    assert "the candidate computes it with torch.sigmoid" in first.describe()


@pytest.mark.parametrize("carry_key", [False, True], ids=["new-node", "inherit_key"])
def test_activation_replaced_by_a_new_node(resnet, image, carry_key):
    gm = fxdebug.trace(resnet)
    relu = node(gm, "layer3.0.relu")
    with gm.graph.inserting_after(relu):
        new = gm.graph.call_function(torch.nn.functional.gelu, relu.args)
    relu.replace_all_uses_with(new)
    gm.graph.erase_node(relu)
    if carry_key:
        inherit_key(new, relu)
    gm.recompile()
    report = fxdebug.check_equivalence(resnet, gm, image)
    first = report.first_divergence
    assert first.key == "layer3.0.relu" and first.candidate_op == "torch.nn.functional.gelu"
    assert first.match == ("key" if carry_key else "inputs")
    assert report.unmatched_reference == [] and report.unmatched_candidate == []


def test_bias_dropped_from_one_conv(image):
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small().eval()
    fc1 = "features.4.block.2.fc1"  # the squeeze-excitation conv of block 4
    nn.init.normal_(model.get_submodule(fc1).bias)  # torchvision initialises it to zero
    gm = fxdebug.trace(model)
    no_bias = copy.deepcopy(gm.get_submodule(fc1))
    no_bias.bias = None
    gm.add_submodule(fc1, no_bias)  # the candidate's own module; the model keeps its bias
    gm.recompile()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    # in eval mode this randomly initialised network shrinks activations to ~1e-9 by the
    # output, below the default atol: the check rightly passes at default tolerances ...
    assert fxdebug.check_equivalence(model, gm, x).ok
    # ... and localizes the fault with atol=0, or in training mode (batch statistics)
    for report in (fxdebug.check_equivalence(model, gm, x, atol=0),
                   fxdebug.check_equivalence(model, gm, x, train=True)):
        assert not report.ok and report.first_divergence.key == fc1
        assert report.first_divergence.location.endswith("torchvision/ops/misc.py:254")
    assert fxdebug.check_equivalence(model, gm, x, train=True).mode == "train"
    assert not model.training and not any(m.training for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in buffers.items())


@pytest.mark.parametrize("key", ["norm1.sub", "norm2.truediv"])
def test_operands_swapped_at_one_node(key):
    model = NormNet().eval()
    x = torch.randn(8, 16)
    gm = swap_operands(fxdebug.trace(model), key)
    report = fxdebug.check_equivalence(model, gm, x)
    assert not report.ok
    assert report.first_divergence.key == key == first_differing_key(fxdebug.trace(model), gm, x)
    assert report.first_divergence.op == {"norm1.sub": "operator.sub",
                                          "norm2.truediv": "operator.truediv"}[key]
    # every node the reference runs before it agrees exactly
    before = report.nodes[:[r.key for r in report.nodes].index(key)]
    assert before and all(r.ok and r.max_abs == 0 for r in before)


def test_removed_node_is_compared_with_what_replaced_it(resnet, image):
    gm = fxdebug.trace(resnet)
    relu = node(gm, "layer1.1.relu")
    relu.replace_all_uses_with(relu.args[0])
    gm.graph.erase_node(relu)
    gm.recompile()
    report = fxdebug.check_equivalence(resnet, gm, image)
    first = report.first_divergence
    assert (first.key, first.candidate_key, first.match) == ("layer1.1.relu", "layer1.1.bn1",
                                                             "in its place")
    assert "the candidate's counterpart of 'layer1.1.bn1'" in first.detail


def test_nodes_without_counterpart_are_named_not_guessed(resnet, image):
    gm = fxdebug.trace(resnet)
    iadd = node(gm, "layer1.0.iadd")
    with gm.graph.inserting_after(iadd):
        stacked = gm.graph.call_function(torch.stack, ([iadd.args[0], iadd.args[1]],))
    with gm.graph.inserting_after(stacked):
        summed = gm.graph.call_function(torch.sum, (stacked, 0))
    iadd.replace_all_uses_with(summed)
    gm.graph.erase_node(iadd)
    gm.recompile()
    report = fxdebug.check_equivalence(resnet, gm, image, localize=True)
    assert report.ok  # a + b == stack([a, b]).sum(0) exactly
    row = [r for r in report.nodes if r.key == "layer1.0.iadd"][0]
    assert (row.candidate_key, row.match) == ("sum", "position")
    assert report.unmatched_candidate == ["stack"]
    assert "no counterpart in the reference: stack" in report.table()


# -- outputs of any structure ----------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["low", "high"])


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: object


class Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.fc = nn.Linear(4, 10)
        self.make = make

    def forward(self, x):
        return self.make(self.fc(x))


@pytest.mark.parametrize("make_ref, make_cand, expected", [
    (lambda y: (y, {"logits": y}), lambda y: (y, (y,)), ["out/1: dict vs tuple"]),
    (lambda y: (y, {"logits": y}), lambda y: (y, {"logits": y[:, :5]}),
     ["out/1/logits: shape 2x10 vs 2x5"]),
    (lambda y: [y, y], lambda y: [y], ["out: list of 2 vs list of 1"]),
    (lambda y: {"a": y, "b": y}, lambda y: {"a": y, "c": y},
     ["out/b: missing in the candidate's dict", "out/c: only in the candidate's dict"]),
    (lambda y: Out(y, 3), lambda y: Out(y, 4), ["out/extra: 3 vs 4"]),
    (lambda y: y, lambda y: (y,), ["out: Tensor vs tuple"]),
    (lambda y: y, lambda y: y.double(), ["out: max abs 0, max rel 0 (0/20 elements beyond "
                                        "rtol=1.3e-06, atol=1e-05); dtype float32 vs float64"]),
], ids=["tuple-vs-dict", "shape", "length", "keys", "dataclass-field", "tensor-vs-tuple", "dtype"])
def test_structure_mismatch_names_the_path(make_ref, make_cand, expected):
    reference, candidate = Returns(make_ref), Returns(make_cand)
    candidate.fc = reference.fc
    report = fxdebug.check_equivalence(reference, candidate, torch.randn(2, 4))
    assert not report.ok and report.max_error in (0.0, float("inf"))
    assert [c.describe() for c in report.outputs if not c.ok] == expected
    assert all(line in report.table() for line in [e.split(":")[0] for e in expected])


def test_equal_nested_outputs_compare_every_leaf():
    make = lambda y: Out(logits=y, extra=(Pair(y[:, :2], y[:, 2:]), {"k": [y * 2], "n": None}))
    reference, candidate = Returns(make), Returns(make)
    candidate.fc = reference.fc
    report = fxdebug.check_equivalence(reference, candidate, torch.randn(2, 4))
    assert report.ok
    assert [c.path for c in report.outputs] == ["out/logits", "out/extra/0/low",
                                                "out/extra/0/high", "out/extra/1/k/0",
                                                "out/extra/1/n"]


# -- tolerances, modes, gradients ------------------------------------------------------------

@pytest.mark.parametrize("dtype, offset", [(torch.float32, 2e-5), (torch.float32, 5e-6),
                                           (torch.float64, 2e-7), (torch.float16, 1e-3)])
def test_default_tolerances_follow_torch_testing(dtype, offset):
    torch.manual_seed(0)
    reference = nn.Linear(8, 8).to(dtype)
    shifted = nn.Sequential(reference, _AddConstant(offset))
    x = torch.randn(4, 8).to(dtype)
    report = fxdebug.check_equivalence(reference, shifted, x)
    with torch.no_grad():
        try:
            torch.testing.assert_close(shifted(x), reference(x))
            expected = True
        except AssertionError:
            expected = False
    assert report.ok is expected


class _AddConstant(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x + self.value


def test_rtol_atol_override():
    reference = nn.Linear(8, 8)
    shifted = nn.Sequential(reference, _AddConstant(1e-3))
    x = torch.randn(4, 8)
    assert not fxdebug.check_equivalence(reference, shifted, x).ok
    assert fxdebug.check_equivalence(reference, shifted, x, atol=2e-3).ok
    assert fxdebug.check_equivalence(reference, shifted, x, atol=2e-3, rtol=0).ok
    assert not fxdebug.check_equivalence(reference, shifted, x, atol=5e-4, rtol=0).ok


class Mutates(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        x.mul_(2)  # writes to its input
        return self.drop(self.bn(self.fc(x)))


def test_eval_by_default_on_cloned_inputs_and_flags_restored():
    model = Mutates().train()
    model.bn.eval()  # a mixed state, restored module by module
    x = torch.randn(5, 6)
    x_before = x.clone()
    stats = model.bn.running_mean.clone()
    rng = torch.get_rng_state()
    report = fxdebug.check_equivalence(model, fxdebug.trace(model), x)
    assert report.ok and report.mode == "eval" and "eval mode, cloned inputs" in report.table()
    assert torch.equal(x, x_before)
    assert model.training and model.drop.training and not model.bn.training
    trained = fxdebug.check_equivalence(model, fxdebug.trace(model), x, train=True)
    assert trained.ok and trained.mode == "train"  # dropout draws the same masks in both
    assert torch.equal(model.bn.running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def test_grads_compares_parameter_gradients(resnet, image):
    same = fxdebug.check_equivalence(resnet, fxdebug.trace(resnet), image, grads=True)
    assert same.ok and len(same.grads) == len(list(resnet.parameters()))
    gm = fxdebug.trace(resnet)
    insert_after(gm, "layer4.0.relu", torch.Tensor.detach)  # same outputs, no gradient through
    report = fxdebug.check_equivalence(resnet, gm, image, grads=True)
    assert all(c.ok for c in report.outputs) and not report.ok
    failed = {c.path for c in report.grads if not c.ok}
    # ground truth: which parameters get a different gradient, by torch.autograd.grad
    params = dict(resnet.named_parameters())
    ref = torch.autograd.grad(resnet(image).sum(), list(params.values()), allow_unused=True)
    cand = torch.autograd.grad(gm(image).sum(), list(params.values()), allow_unused=True)
    expected = {f"grad/{name}" for name, a, b in zip(params, ref, cand)
                if b is None or not torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)}
    assert failed == expected and "grad/layer4.0.conv1.weight" in failed
    assert "grad/fc.weight" not in failed
    # in the backward, the first activation gradient to differ is that of the detached node
    first = report.first_grad_divergence
    assert (first.key, first.detail) == ("layer4.0.relu", "no gradient reaches it in the candidate")
    before = report.grad_nodes[:report.grad_nodes.index(first)]
    assert before and all(row.ok and row.max_abs == 0 for row in before)
    assert "first gradient divergence (backward order): layer4.0.relu" in report.table()


def double_the_gradient(t):
    """The same value (t + 0), twice the gradient."""
    return t.detach() + (t - t.detach()) * 2


def test_first_gradient_divergence_in_backward_order(resnet, image):
    gm = fxdebug.trace(resnet)
    insert_after(gm, "layer3.1.conv1", double_the_gradient)
    # ground truth with retain_grad: conv1's output gradient doubles, relu's does not change
    grads = {}
    for model in (resnet, gm):
        seen = {}

        def keep(name):
            def hook(module, args, out):
                out.retain_grad()
                seen[name] = out
            return hook

        handles = [model.get_submodule("layer3.1.conv1").register_forward_hook(keep("conv1")),
                   model.get_submodule("layer3.1.conv2").register_forward_pre_hook(
                       lambda m, args: seen.update(relu=args[0]) or args[0].retain_grad())]
        model(image).sum().backward()
        for handle in handles:
            handle.remove()
        grads[model is gm] = {k: v.grad.clone() for k, v in seen.items()}
    resnet.zero_grad(set_to_none=True)
    assert torch.equal(grads[False]["relu"], grads[True]["relu"])
    assert torch.allclose(grads[True]["conv1"], 2 * grads[False]["conv1"])

    report = fxdebug.check_equivalence(resnet, gm, image, grads=True)
    assert all(c.ok for c in report.outputs) and not report.ok
    first = report.first_grad_divergence
    assert first.key == "layer3.1.conv1"
    assert first.max_abs == pytest.approx(float(grads[False]["conv1"].abs().max()), rel=1e-5)
    later = [r.key for r in report.grad_nodes[:report.grad_nodes.index(first)]]
    assert "layer3.1.relu" in later and "layer3.1.bn1" in later  # agree: after it in forward


# -- assert_equivalent ----------------------------------------------------------------------

def test_assert_equivalent_message_is_the_table():
    model = NormNet().eval()
    x = torch.randn(8, 16)
    assert fxdebug.testing.assert_equivalent(model, fxdebug.trace(model), x).ok
    gm = swap_operands(fxdebug.trace(model), "norm2.sub")
    with pytest.raises(AssertionError) as caught:
        fxdebug.testing.assert_equivalent(model, gm, x)
    message = str(caught.value)
    assert message == fxdebug.check_equivalence(model, gm, x).table()
    assert "first divergence: norm2.sub (operator.sub, tests/test_equivalence.py:" in message


def test_bad_arguments_say_what_to_do():
    with pytest.raises(fxdebug.FxdebugError, match="needs example inputs"):
        fxdebug.check_equivalence(nn.ReLU(), nn.ReLU())
    with pytest.raises(TypeError, match="candidate must be an nn.Module"):
        fxdebug.check_equivalence(nn.ReLU(), torch.relu, torch.ones(1))


# -- command line and determinism ------------------------------------------------------------

FAULTY_PASS = '''
import operator
import torch


def scale_bn1(gm):
    """Meant to be a no-op; multiplies layer2.0.bn1's output by 1.5."""
    bn1 = [n for n in gm.graph.nodes if n.meta.get("fxdebug_key") == "layer2.0.bn1"][0]
    with gm.graph.inserting_after(bn1):
        new = gm.graph.call_function(operator.mul, (bn1, 1.5))
    bn1.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return gm
'''


def _fxdebug(*args, cwd):
    return fxdebug_cli(*args, cwd=cwd, OMP_NUM_THREADS="1")


def test_cli_check_names_the_pass_and_node(tmp_path):
    (tmp_path / "my_passes.py").write_text(FAULTY_PASS)
    result = _fxdebug("check", "--input", "1,3,64,64", "--pass", "capture", "--pass",
                      "my_passes.py:scale_bn1", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "== pass 1: capture (modified graph), checked against the model" in out
    assert "== pass 2: scale_bn1 (modified graph), checked against the stage before" in out
    assert "first divergence: layer2.0.bn1 (BatchNorm2d, " in out
    summary = out.strip().splitlines()[-2:]
    assert summary[0].split()[:3] == ["capture", "yes", "ok"]
    assert summary[1].split()[:3] == ["scale_bn1", "yes", "DIFFERS"]
    assert summary[1].split()[-2] == "layer2.0.bn1"
    bad = _fxdebug("check", "--pass", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and "not a built-in pass" in bad.stderr
    assert "Traceback" not in bad.stderr


DETERMINISM = textwrap.dedent("""
    import operator, sys, torch, torchvision, fxdebug
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxdebug.trace(model)
    bn1 = [n for n in gm.graph.nodes if n.meta.get("fxdebug_key") == "layer2.0.bn1"][0]
    with gm.graph.inserting_after(bn1):
        new = gm.graph.call_function(operator.mul, (bn1, 1.5))
    bn1.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    gm.recompile()
    print(fxdebug.check_equivalence(model, gm, x, grads=True).table())
    plain = torch.fx.symbolic_trace(model)
    print(fxdebug.check_equivalence(model, plain, x, localize=True).table())
    with gm.graph.inserting_after(new):
        log = gm.graph.call_function(torch.log, (new,))
    new.replace_all_uses_with(log, delete_user_cb=lambda user: user is not log)
    gm.recompile()
    print(fxdebug.find_nonfinite(gm, x).table())
    grad_gm = fxdebug.trace(model)
    conv1 = [n for n in grad_gm.graph.nodes if n.meta.get("fxdebug_key") == "layer3.1.conv1"][0]
    with grad_gm.graph.inserting_after(conv1):
        cut = grad_gm.graph.call_method("detach", (conv1,))
    conv1.replace_all_uses_with(cut, delete_user_cb=lambda user: user is not cut)
    grad_gm.recompile()
    print(fxdebug.check_equivalence(model, grad_gm, x, grads=True).table())
""")


def test_tables_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(DETERMINISM, OMP_NUM_THREADS="1")
    assert outputs[0] == outputs[1] == outputs[2]
    assert "first divergence: layer2.0.bn1" in outputs[0]
    assert "forward: first non-finite" in outputs[0]
    assert "first gradient divergence (backward order): layer3.1.conv1" in outputs[0]
    assert not re.search(r"0x[0-9a-f]{6,}", outputs[0])
