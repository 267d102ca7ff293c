"""fxdebug.diff: renames node references by parsing, never inside strings; rows as before at scale."""

import random

import torch
import torch.fx as fx

import fxdebug
from fxdebug.reporting.graph_diff import snapshot
from fxdebug.tracing.keys import inherit_key


def tag(t, label):
    return t


fx.wrap("tag")  # traced as a call_function node whose second argument is a string


class Tagged(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return tag(y, "sigmoid") + tag(y, "relu")


def replace_relu_by_sigmoid(gm: fx.GraphModule) -> fx.GraphModule:
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    with gm.graph.inserting_after(relu):
        new = gm.graph.call_function(torch.sigmoid, relu.args)
    relu.replace_all_uses_with(new)
    gm.graph.erase_node(relu)
    inherit_key(new, relu)
    gm.recompile()
    return gm


def test_rename_does_not_rewrite_inside_strings():
    before = fxdebug.trace(Tagged())
    old = snapshot(before)
    after = replace_relu_by_sigmoid(before)
    assert any(n.name == "sigmoid" for n in after.graph.nodes)  # the string equals the new name
    d = fxdebug.diff(old, after)
    assert [(row.key, row.changes[0]) for row in d.changed] == [("relu", "replaces relu")]
    # the taggers' only difference is the renamed node: unchanged, strings and all
    taggers = [row for row in d.rows if row.view.target.endswith("tag")]
    assert [row.mark for row in taggers] == [" ", " "]


def test_a_changed_string_is_still_a_change():
    before = fxdebug.trace(Tagged())
    old = snapshot(before)
    node = next(n for n in before.graph.nodes if n.args[1:] == ("relu",))
    node.args = (node.args[0], "other")
    d = fxdebug.diff(old, before)
    assert [row.changes for row in d.changed] == [("args (relu, 'relu') -> (relu, 'other')",)]


def chain(n: int) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    for _ in range(n):
        x = graph.call_function(torch.relu, (x,))
    graph.output(x)
    return fx.GraphModule(torch.nn.Module(), graph)


def reference_rows(old_names, new_names):
    """Marks and names by brute force: removed old nodes right before the next surviving one."""
    new_set, position = set(new_names), {name: i for i, name in enumerate(old_names)}
    rows, done = [], set()
    for name in new_names:
        if name not in position:
            rows.append(("+", name))
            continue
        for old in old_names[:position[name]]:
            if old not in new_set and old not in done:
                done.add(old)
                rows.append(("-", old))
        rows.append((" ", name))
    rows += [("-", old) for old in old_names if old not in new_set and old not in done]
    return rows


def test_many_removals_and_additions_in_order():
    gm = chain(1000)
    old = snapshot(gm)
    rng = random.Random(0)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in rng.sample(nodes, 150):  # remove 150 relus (their users take their input)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    for node in rng.sample([n for n in gm.graph.nodes if n.op == "call_function"], 100):
        with gm.graph.inserting_after(node):  # add 100 identity-like nodes, unused
            gm.graph.call_function(torch.abs, (node,))
    gm.recompile()
    d = fxdebug.diff(old, gm)
    got = [(row.mark if row.mark != "~" else " ", row.view.name) for row in d.rows]
    expected = reference_rows([v.name for v in old.views], [n.name for n in gm.graph.nodes])
    assert [m for m, _ in got].count("-") == 150 and [m for m, _ in got].count("+") == 100
    assert got == expected
