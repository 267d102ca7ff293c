"""value_facts' proofs checked against torch's own machinery.

value_facts proves, before any run, that two values of a graph have equal dtypes
(shapes) on every run. Ground truth here is torch itself, never value_facts:

* torch.fx's ``ShapeProp`` (torch's interpreter recording each node's dtype and
  shape on a real run) at two input shapes and batch sizes, in float32, float64
  and bfloat16 (the model converted with ``.to``), and under CPU autocast;
* torch's dispatcher, which says which ops have an autocast kernel on which
  device, for every op the "dtype-keeping" modules and functions run;
* the ops themselves on every pair of input and weight dtypes;
* eager: the lowered graph's outputs and gradients, bitwise.
"""

from __future__ import annotations

import copy
import itertools
import operator

import pytest
import torch
import torchvision
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn import functional as F

import fxdebug
from fxdebug.tracing import value_facts
from fxdebug.tracing.value_facts import ValueFacts

LOWERED = "fxdebug_lowered_from"
SHAPES = ((1, 64, 64), (3, 48, 80))  # (batch, height, width)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# -- the models --------------------------------------------------------------------------------
def small_densenet():
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16,
                                       bn_size=2, num_classes=10)


class ConvVariety(nn.Module):
    """Strides, paddings ("same", "valid", reflect), dilations, kernels; several sum up."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.b = nn.Conv2d(3, 4, 1, stride=2)
        self.c = nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2)
        self.same = nn.Conv2d(3, 4, 3, padding="same", dilation=2)
        self.plain = nn.Conv2d(3, 4, 3, padding=1)
        self.reflect = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.wide = nn.Conv2d(3, 4, 5, stride=3, padding=1)
        self.rect = nn.Conv2d(3, 4, (3, 1), stride=(1, 2), padding=(1, 0))
        self.valid = nn.Conv2d(3, 4, 3, padding="valid")
        self.line = nn.Conv1d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        a = self.a(x)
        a += self.b(x)               # (H - 1) // 2 + 1 both
        a += self.c(x)
        s = self.same(x)
        s += self.plain(x)           # H both
        s += self.reflect(x)
        s -= self.bn(self.plain(x))  # a batch norm: stays (float32 under MPS autocast)
        w = self.wide(x) * 2.0
        w /= 3
        line = self.line(x.flatten(2))
        line += 1
        return a, s, w, self.rect(x), self.valid(x), line


class LinearAndViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.one, self.two = nn.Linear(8, 6), nn.Linear(8, 6)
        self.weight = nn.Parameter(torch.randn(8, 5))

    def forward(self, x):
        y = self.one(x)
        y += self.two(x)
        z = y @ y.transpose(-1, -2)
        z += torch.matmul(y, y.transpose(-1, -2))
        m = torch.matmul(x, self.weight)
        m *= 0.5
        flat = torch.flatten(y, 0, -2)
        views = (y.view(-1, 6), y.reshape(-1), y.unsqueeze(0), torch.unsqueeze(y, -1).squeeze(-1),
                 y.transpose(0, -1), y.contiguous(), y.clone(), y.detach(),
                 flat.t(), y.expand_as(y), torch.relu(y), F.gelu(y), torch.sigmoid(y), y.relu())
        return z, m, flat, views


class Broadcasts(nn.Module):
    """``x += y`` where ``y`` is smaller (pooled, a bias row), and a product that is larger."""

    def __init__(self):
        super().__init__()
        self.conv, self.gate, self.other = (nn.Conv2d(3, 4, 3, padding=1) for _ in range(3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.rows = nn.AdaptiveAvgPool2d((None, 1))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a = self.conv(x)
        a += self.pool(self.gate(x))       # N,4,H,W += N,4,1,1
        b = self.other(x)
        b *= self.rows(self.gate(x))       # N,4,H,W *= N,4,H,1
        g = self.pool(self.gate(x))
        big = g * self.other(x)            # N,4,1,1 * N,4,H,W: the larger shape
        t = self.lin(a.mean((2, 3)))
        t += self.lin.bias                 # a bias row into a batch
        return a, b, big, t


class DtypeMixing(nn.Module):
    """``x += y.half()`` stays in place (float32 ``x``); dtype-changing methods end labels."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x):
        y = self.a(x)
        y += self.b(x).half()              # float32 += float16: float32 in place, so too a + b
        z = self.a(x)
        z += self.b(x).to(torch.float64)   # float32 in place; z + w would be float64
        return y, z, y.float(), x.double() + x.double()


class IntegerOps(nn.Module):
    """An integer input: sigmoid and tanh make float32 of it, relu and views keep it."""

    def forward(self, x):
        h = x * x
        return h, torch.sigmoid(x), torch.tanh(x), torch.relu(x), x.view(-1), h + x, h // 2


def _float_input(batch, height, width):
    return torch.randn(batch, 3, height, width)


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), _float_input),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
                           _float_input),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(num_classes=10),
                        _float_input),
    "densenet": (small_densenet, _float_input),
    "conv_variety": (ConvVariety, _float_input),
    "linear_and_views": (LinearAndViews,
                         lambda b, h, w: torch.randn(b, 8) if b == 1 else torch.randn(b, h % 7, 8)),
    "broadcasts": (Broadcasts, lambda b, h, w: torch.randn(b, 3, h // 8, w // 8)),
    "dtype_mixing": (DtypeMixing, lambda b, h, w: torch.randn(b, h % 5 + 1, 5)),
}


# -- what the facts claim ----------------------------------------------------------------------
def claims(gm):
    """``(dtype pairs, shape pairs, floating nodes, broadcast pairs)`` value_facts proves."""
    facts = ValueFacts(gm.graph, gm)
    nodes = list(gm.graph.nodes)
    for node in nodes:
        facts.visit(node)
    pairs = list(itertools.combinations(nodes, 2))
    return ([(a.name, b.name) for a, b in pairs if facts.same_dtype(a, b)],
            [(a.name, b.name) for a, b in pairs if facts.same_shape(a, b)],
            [n.name for n in nodes if facts.floating(n)],
            [(a.name, b.name) for a in nodes for b in nodes
             if a is not b and facts.broadcasts_into(a, b)])


def observed(gm, x):
    """``{node name: (dtype, shape)}`` of every tensor a real run makes, by torch's ShapeProp."""
    with torch.no_grad():
        ShapeProp(gm).propagate(x)
    seen = {}
    for node in gm.graph.nodes:
        meta = node.meta.pop("tensor_meta", None)
        if hasattr(meta, "dtype") and hasattr(meta, "shape"):
            seen[node.name] = (meta.dtype, tuple(meta.shape))
    return seen


def check_claims(gm, x, claimed):
    """Every claim holds on this run; returns how many pairs were checked."""
    dtypes, shapes, floating, broadcasts = claimed
    seen = observed(gm, x)
    checked = 0
    for a, b in dtypes:
        if a in seen and b in seen:
            assert seen[a][0] == seen[b][0], (a, b, seen[a], seen[b])
            checked += 1
    for a, b in shapes:
        if a in seen and b in seen:
            assert seen[a][1] == seen[b][1], (a, b, seen[a], seen[b])
            checked += 1
    for node in floating:
        if node in seen:
            assert seen[node][0].is_floating_point or seen[node][0].is_complex, node
    for a, b in broadcasts:
        if a in seen and b in seen:
            assert torch.broadcast_shapes(seen[a][1], seen[b][1]) == seen[a][1], (a, b)
    return checked


def _configs(make_input):
    """(dtype the model is converted to, input, autocast dtype or None)."""
    (b1, h1, w1), (b2, h2, w2) = SHAPES
    return [(torch.float32, make_input(b1, h1, w1), None),
            (torch.float32, make_input(b2, h2, w2), None),
            (torch.float64, make_input(b1, h1, w1), None),
            (torch.bfloat16, make_input(b2, h2 // 2, w2 // 2), None),
            (torch.float32, make_input(b1, h1, w1), torch.bfloat16),
            (torch.float32, make_input(b2, h2 // 2, w2 // 2), torch.float16)]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_dtype_and_shape_fact_holds_on_real_runs_at_other_shapes_dtypes_and_autocast(name):
    make_model, make_input = MODELS[name]
    torch.manual_seed(0)
    gm = fxdebug.trace(make_model().eval())
    claimed = claims(gm)
    assert len(claimed[0]) >= 10 and len(claimed[1]) >= 5, name  # the facts prove something
    checked = 0
    for dtype, x, autocast in _configs(make_input):
        model = copy.deepcopy(gm).to(dtype)
        x = x.to(dtype)
        if autocast is None:
            checked += check_claims(model, x, claimed)
        else:
            with torch.autocast("cpu", dtype=autocast):
                checked += check_claims(model, x, claimed)
    assert checked >= 6 * (len(claimed[0]) + len(claimed[1])) * 0.9, (name, checked)


class ConvSweep(nn.Module):
    """Every kernel, stride, padding and dilation up to small sizes, side by side."""

    def __init__(self):
        super().__init__()
        configs = itertools.product((1, 2, 3, 5), (1, 2, 3), (0, 1, 2), (1, 2))
        self.convs = nn.ModuleList(nn.Conv2d(1, 1, k, stride=s, padding=p, dilation=d)
                                   for k, s, p, d in configs if d * (k - 1) + 1 <= 5 + 2 * p)

    def forward(self, x):
        return [conv(x) for conv in self.convs]


def test_convolution_output_sizes_proven_equal_are_equal_at_every_input_size():
    gm = fxdebug.trace(ConvSweep())
    claimed = claims(gm)
    assert len(claimed[1]) >= 50  # pairs of convolutions proven to give one output size
    for height, width in itertools.product(range(5, 12), (5, 8)):
        check_claims(gm, torch.randn(1, 1, height, width), claimed)


def test_integer_inputs_no_fact_through_sigmoid_and_the_ops_that_make_floats():
    gm = fxdebug.trace(IntegerOps())
    claimed = claims(gm)
    for x in (torch.arange(6).view(2, 3), torch.arange(20, dtype=torch.int32).view(4, 5),
              torch.ones(3, 1, dtype=torch.uint8)):
        check_claims(gm, x, claimed)
    names = set(claimed[0])
    assert ("x", "mul") in names and ("x", "view") in names  # x * x and a view of x keep it
    assert not any("sigmoid" in pair or "tanh" in pair for pair in names)


class IntegerPlusSigmoid(nn.Module):
    def forward(self, x):
        h = x * x
        h += torch.sigmoid(x)        # int64 += float32: an error in place, float32 out of place
        return h


def test_an_integer_tensor_plus_its_sigmoid_stays_in_place_and_fails_as_in_eager():
    gm = fxdebug.trace(IntegerPlusSigmoid())
    assert not any(LOWERED in n.meta for n in gm.graph.nodes)
    for module in (IntegerPlusSigmoid(), gm):
        with pytest.raises(RuntimeError, match="can't be cast"):
            module(torch.arange(6))


class Grow(nn.Module):
    def forward(self, t):
        t.resize_(2, *t.shape)       # code fx does not see (a leaf) grows its input in place
        return t


class GrownThroughAnAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.ident, self.grow = nn.Identity(), Grow()

    def forward(self, x):
        a = self.a(x)
        self.grow(self.ident(a))     # the very tensor a
        c = self.b(x)
        c += a                       # 1x4x4x4 += 2x1x4x4x4: an error in place, larger out of it
        return c


def test_a_tensor_a_leaf_may_reshape_through_an_alias_has_no_shape_and_the_write_stays():
    gm = fxdebug.trace(GrownThroughAnAlias(), leaf_modules=[Grow])
    assert not any(LOWERED in n.meta for n in gm.graph.nodes)
    for module in (GrownThroughAnAlias(), gm):
        with torch.no_grad(), pytest.raises(RuntimeError, match="doesn't match the broadcast"):
            module(torch.randn(1, 3, 4, 4))


# -- the hand lists against torch's dispatcher and the ops themselves ----------------------------
AUTOCAST_KEYS = [key for key in dir(torch._C.DispatchKey) if key.startswith("Autocast")]


def aten_ops(fn, *args):
    """Every aten op a call runs, composite ones and what they decompose into (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sorted({event.name[len("aten::"):] for event in prof.events()
                   if event.name.startswith("aten::")})


# The profiler names ops without their overload. mean's CPU kernel sums with at::sum_out
# (ATen's ReduceOps.cpp, mean_out), whose overload has no autocast kernel (checked below);
# the functional sum has one on CUDA, MPS and XPU (float32).
CALLED_OVERLOADS = {"sum": ("IntList_out",)}


def autocast_kernels(op: str) -> list[str]:
    """``overload@AutocastKey`` for each autocast kernel torch registered for an aten op."""
    found = []
    for overload in CALLED_OVERLOADS.get(op, getattr(torch.ops.aten, op).overloads()):
        name = f"aten::{op}" if overload == "default" else f"aten::{op}.{overload}"
        try:
            found += [f"{name}@{key}" for key in AUTOCAST_KEYS
                      if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)]
        except RuntimeError:  # a TorchScript-only overload (aten::to.prim_Device): no kernels
            continue
    return found


MODULE_ARGS = {nn.MaxPool1d: (2,), nn.MaxPool2d: (2,), nn.AdaptiveAvgPool1d: (1,),
               nn.AdaptiveAvgPool2d: (1,), nn.BatchNorm1d: (2,), nn.BatchNorm2d: (2,),
               nn.BatchNorm3d: (2,)}
FUNCTION_ARGS = {torch.transpose: (0, 1), torch.permute: ((3, 2, 1, 0),),
                 torch.reshape: ((-1,),), torch.unsqueeze: (0,)}
METHOD_ARGS = {"view": (-1,), "reshape": (-1,), "permute": (3, 2, 1, 0), "transpose": (0, 1),
               "unsqueeze": (0,), "expand": (2, 2, 4, 4), "t": (), "flatten": ()}


def _keepers():
    """(what, callable, example input) for every op value_facts says keeps a dtype."""
    x4, x3 = torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4)
    for cls in value_facts._DTYPE_KEEPING_MODULES:
        for train in (True, False):
            module = cls(*MODULE_ARGS.get(cls, ())).train(train)
            yield (f"{cls.__name__}(train={train})", module,
                   x3 if cls in (nn.MaxPool1d, nn.AdaptiveAvgPool1d, nn.Dropout1d) else x4)
    for fn in value_facts._FLOAT_FUNCTIONS + value_facts._VIEW_FUNCTIONS:
        args = FUNCTION_ARGS.get(fn, ())
        yield fn.__name__, lambda x, fn=fn, args=args: fn(x, *args), x4
    for method in value_facts._DTYPE_KEEPING_METHODS:
        args = METHOD_ARGS.get(method, ())
        x = torch.randn(2, 4) if method == "t" else x4
        if method in ("view_as", "reshape_as", "expand_as"):
            args = (x,)
        yield method, lambda x, m=method, args=args: getattr(x, m)(*args), x


def test_no_dtype_keeping_op_has_an_autocast_kernel_on_any_device():
    """torch's autocast lists (CPU, CUDA, MPS, XPU ...) are kernels on the Autocast* keys."""
    assert {"AutocastCPU", "AutocastCUDA"} <= set(AUTOCAST_KEYS)
    assert autocast_kernels("conv2d") and autocast_kernels("batch_norm")  # the query works
    offenders = {}
    for what, fn, x in _keepers():
        ops = aten_ops(fn, x)
        kernels = [k for op in ops if hasattr(torch.ops.aten, op) for k in autocast_kernels(op)]
        if kernels:
            offenders[what] = kernels
    assert not offenders, offenders


def _dtype_or_error(fn, x, autocast=None):
    try:
        if autocast is None:
            return fn(x).dtype
        with torch.autocast("cpu", dtype=autocast):
            return fn(x).dtype
    except RuntimeError:
        return None


CASTING = [nn.Conv2d(2, 2, 1), nn.Conv1d(2, 2, 1), nn.Linear(4, 4), nn.BatchNorm2d(2),
           nn.BatchNorm1d(2)]


@pytest.mark.parametrize("module", CASTING, ids=lambda m: type(m).__name__)
def test_casting_ops_keep_the_input_dtype_or_raise_and_autocast_casts_to_one_dtype(module):
    """What value_facts' "cast" labels rest on: each casting op, on every pair of input and
    weight dtypes, keeps its input's dtype or raises; under autocast it gives one dtype for
    every floating input but float64 (which autocast leaves alone), or keeps every dtype."""
    assert type(module) in value_facts._CAST_MODULES
    shape = (2, 2, 4) if isinstance(module, (nn.Conv1d, nn.Linear, nn.BatchNorm1d)) else (2, 2, 4, 4)
    for train, weights in itertools.product((True, False), FLOATS):
        net = copy.deepcopy(module).to(weights).train(train)
        for dtype in FLOATS + (torch.int64, torch.int32, torch.bool):
            got = _dtype_or_error(net, torch.ones(shape).to(dtype))
            assert got in (None, dtype), (type(module).__name__, weights, dtype, got)
        for autocast in (torch.bfloat16, torch.float16):
            got = {d: _dtype_or_error(net, torch.ones(shape, dtype=d), autocast) for d in FLOATS}
            ran = {d: out for d, out in got.items() if out is not None}
            kept = all(out == d for d, out in ran.items())  # not in this device's list
            one = len({out for d, out in ran.items() if d != torch.float64}) <= 1
            assert kept or (one and got[torch.float64] in (None, torch.float64)), \
                (type(module).__name__, weights, autocast, got)


def test_floating_keepers_keep_every_floating_dtype_with_and_without_autocast():
    for (what, fn, x), dtype in itertools.product(list(_keepers()), FLOATS):
        for autocast in (None, torch.bfloat16, torch.float16):
            got = _dtype_or_error(fn, x.to(dtype), autocast)
            assert got in (None, dtype), (what, dtype, autocast, got)


# -- the lowering, end to end ------------------------------------------------------------------
def _run(module, x):
    x = x.detach().clone().requires_grad_()
    out = module(x)
    leaves = torch.utils._pytree.tree_leaves(out)
    sum(leaf.float().square().sum() for leaf in leaves if leaf.is_floating_point()).backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return leaves, x.grad, grads


@pytest.mark.parametrize("name", [name for name in MODELS
                                  if name not in ("efficientnet_b0", "densenet")])  # no +=
def test_lowered_graph_outputs_and_gradients_bitwise_eager_at_two_shapes(name):
    make_model, make_input = MODELS[name]
    torch.manual_seed(0)
    model = make_model().eval()
    reference = copy.deepcopy(model)
    gm = fxdebug.trace(model)
    lowered = [n for n in gm.graph.nodes if LOWERED in n.meta]
    # conv_variety: not "+= reflect-padded conv" (another op chain), nor "-= batch norm";
    # linear_and_views: not "matmul +=" (shape unproven); broadcasts: not "+= a bias"
    expected = {"resnet18": 8, "mobilenet_v3_small": 6, "conv_variety": 5,
                "linear_and_views": 2, "broadcasts": 2, "dtype_mixing": 0}
    assert len(lowered) == expected[name], [n.name for n in lowered]
    kept = [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv)]
    if name == "dtype_mixing":
        assert len(kept) == 2 and not lowered  # float32 += float16 / float64 stay in place
    if name == "conv_variety":
        assert [n.name for n in kept] == ["iadd_3", "isub"]
    for batch, height, width in SHAPES:
        x = make_input(batch, height, width)
        mine, theirs = _run(gm, x), _run(reference, x)
        for a, b in zip(mine[0], theirs[0]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(mine[1], theirs[1])
        assert sorted(mine[2]) == sorted(theirs[2])
        for key, grad in mine[2].items():
            assert (grad is None and theirs[2][key] is None) or torch.equal(grad, theirs[2][key])
