"""``check_equivalence``: is a transformed module still the same function, and if not, where not?

Call tree::

    check_equivalence(reference, candidate, *inputs)
      ├─ ControlledRuns          eval mode, same RNG state and buffers, cloned inputs
      ├─ run both -> compare_values(outputs)       (+ parameter gradients with grads=True)
      ├─ outputs differ: localize
      │    ├─ instrument(reference / candidate, capture="all")   every node captured
      │    ├─ match_nodes                                       by key, inputs, position
      │    ├─ refuted_matches   a match whose candidate computes another node's value
      │    │                    (a fused Linear+ReLU: the ReLU's) is withdrawn; match again
      │    └─ compare every matched value in the reference's execution order
      │         -> first_divergence, divergences, table()
      └─ grads=True, outputs agree, gradients differ: localize in the backward
           └─ activation_grads (tensor hooks) of both, compared in backward order
                -> first_grad_divergence
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from ..errors import FxdebugError, TraceFailure
from ..passes import Capture
from ..runtime import RECORDER_ATTR, outputs_loss
from ..base.formatting import value_text
from ..tracing import keyed_copy
from ..frontend import keyed_module, trace
from ..tracing.keys import META_PROVENANCE, META_SOURCE, node_key, op_name, target_name
from .activation_grads import activation_grads
from .compare import Comparison, compare_tensors, compare_values
from .controlled_run import ControlledRuns
from .equivalence_report import EquivalenceReport, NodeComparison
from .node_matching import (NodeMatching, arguments_text, match_nodes, refuted_matches,
                            value_nodes)

__all__ = ["check_equivalence", "EquivalenceReport", "NodeComparison"]

def _describe_inputs(inputs) -> str:
    return ", ".join(map(value_text, inputs)) or "none"


def _model_name(model: torch.nn.Module) -> str:
    name = type(model).__name__
    if isinstance(model, fx.GraphModule) and name != "GraphModule":
        return f"GraphModule {name}"
    return name


def _param_grads(model: torch.nn.Module, output: Any, notes: list[str], role: str):
    """Gradients of ``sum(output.sum())`` for every named parameter that requires grad."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad():  # the caller may be under no_grad; grads=True asks for them
        loss = outputs_loss(output)
        if not named or loss is None:
            why = "no parameter requires grad" if not named else "no output requires grad"
            notes.append(f"grads=True: the {role} has no parameter gradient to compare ({why})")
            return {}
        found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: grad for (name, _), grad in zip(named, found)}


def _compare_grads(ref_grads: dict, cand_grads: dict, rtol, atol, equal_nan,
                   notes: list[str]) -> list[Comparison]:
    rows: list[Comparison] = []
    missing = []
    for name, ref_grad in ref_grads.items():
        if name not in cand_grads:
            missing.append(name)
            continue
        cand_grad = cand_grads[name]
        path = f"grad/{name}"
        if ref_grad is None and cand_grad is None:
            continue
        if ref_grad is None or cand_grad is None:
            side = "candidate" if cand_grad is None else "reference"
            rows.append(Comparison(path, False, math.inf, math.inf,
                                   detail=f"no gradient reaches it in the {side}"))
            continue
        rows.append(compare_tensors(ref_grad, cand_grad, path, rtol, atol, equal_nan))
    if missing:
        notes.append(f"parameters without a counterpart in the candidate (gradients not "
                     f"compared): {', '.join(missing)}")
    extra = [name for name in cand_grads if name not in ref_grads]
    if extra:
        notes.append(f"parameters only in the candidate (gradients not compared): "
                     f"{', '.join(extra)}")
    return rows


def check_equivalence(reference: torch.nn.Module, candidate: torch.nn.Module, *inputs,
                      rtol: float | None = None, atol: float | None = None,
                      grads: bool = False, train: bool = False, equal_nan: bool = False,
                      localize: bool | None = None) -> EquivalenceReport:
    """Compare ``candidate`` with ``reference`` on ``inputs``; where they differ, name the node.

    Both run in eval mode (``train=True``: training mode) on their own copies
    of the inputs, from the same random-number state and buffers; both get
    their training flags and buffers back afterwards. Outputs are compared
    through any nesting (tuples, lists, dicts, namedtuples, dataclasses) with
    ``torch.allclose`` semantics and the dtype-aware default tolerances of
    ``torch.testing.assert_close`` unless ``rtol`` / ``atol`` are given.

    When the outputs differ (or ``localize=True``), both models run once more
    with every node captured; nodes are matched by key (a pass that replaces a
    node keeps it with :func:`fxdebug.passes.inherit_key`), else by identical
    inputs or by position, never by guessing, and the first node in the
    reference's execution order whose value differs is
    ``report.first_divergence``. A match by inputs or position that the
    values refute (the candidate node computes another reference node's
    value) is withdrawn; a node whose candidate reads another reference
    node's counterpart in some argument slot is named with the change
    (``first_divergence.arguments``: ``"(fc2, fc1) -> (fc2, fc1_relu)"``).

    Args:
        reference: the module the candidate must reproduce (any ``nn.Module``).
        candidate: the transformed module (a GraphModule, or any module).
        inputs: positional inputs for both.
        rtol, atol: tolerances; each one left ``None`` takes the dtype default.
        grads: also compare the gradients of ``sum(out.sum())`` with respect
            to every parameter, by parameter name.
        train: run in training mode instead of eval mode.
        equal_nan: NaN equals NaN.
        localize: ``None`` localize only when the outputs differ; ``True``
            always; ``False`` never.

    Returns:
        :class:`EquivalenceReport`: ``ok``, ``first_divergence``,
        ``max_error``, ``table()``.

    Example::

        >>> import operator, torch, fxdebug
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
        ...                             torch.nn.Linear(4, 2))
        >>> gm = fxdebug.trace(model)
        >>> relu = [n for n in gm.graph.nodes if n.meta["fxdebug_key"] == "1"][0]
        >>> relu.op, relu.target = "call_function", torch.sigmoid   # a faulty transform
        >>> _ = gm.recompile()
        >>> report = fxdebug.check_equivalence(model, gm, torch.randn(3, 4))
        >>> report.ok, report.first_divergence.key, report.first_divergence.candidate_op
        (False, '1', 'torch.sigmoid')
    """
    for role, module in (("reference", reference), ("candidate", candidate)):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"check_equivalence: the {role} must be an nn.Module (or a "
                            f"GraphModule), got {type(module).__name__}.")
    if not inputs:
        raise FxdebugError("check_equivalence needs example inputs: "
                           "check_equivalence(reference, candidate, x) with x the model input(s).")
    notes: list[str] = []
    mode = "train" if train else "eval"
    with ControlledRuns([reference, candidate], inputs, train=bool(train)) as runs:
        ref_out = runs.run(reference, grad=grads)
        ref_grads = _param_grads(reference, ref_out, notes, "reference") if grads else {}
        cand_out = runs.run(candidate, grad=grads)
        cand_grads = _param_grads(candidate, cand_out, notes, "candidate") if grads else {}
        outputs = compare_values(ref_out, cand_out, "out", rtol, atol, equal_nan)
        grad_rows = _compare_grads(ref_grads, cand_grads, rtol, atol, equal_nan, notes)
        ok = all(c.ok for c in outputs) and all(c.ok for c in grad_rows)
        outputs_ok = all(c.ok for c in outputs)
        want = (not outputs_ok) if localize is None else bool(localize)
        nodes: list[NodeComparison] = []
        unmatched_ref: list[str] = []
        unmatched_cand: list[str] = []
        grad_nodes: list[NodeComparison] = []
        if grads and outputs_ok and (not ok or localize) and localize is not False:
            grad_nodes = _localize_grads(reference, candidate, runs, rtol, atol, equal_nan,
                                         notes)
        if not want and not outputs_ok:
            notes.append("node values were not compared (localize=False)")
        if want:
            localized = _localize(reference, candidate, runs, ref_out, cand_out, rtol, atol,
                                  equal_nan, notes)
            if localized is not None:
                nodes, unmatched_ref, unmatched_cand = localized
        if not outputs_ok and nodes and all(node.ok for node in nodes):
            notes.append("every compared node agrees, yet the outputs differ: the difference "
                         "lies in nodes without a counterpart (listed above), in values that "
                         "are not tensors, or in in-place writes after a node ran")
    return EquivalenceReport(
        ok=ok, outputs=outputs, grads=grad_rows, nodes=nodes,
        unmatched_reference=unmatched_ref, unmatched_candidate=unmatched_cand, mode=mode,
        rtol=rtol, atol=atol, reference_name=_model_name(reference),
        candidate_name=_model_name(candidate), inputs=_describe_inputs(inputs),
        localized=want and (bool(nodes) or bool(unmatched_ref) or bool(unmatched_cand)),
        notes=notes, grad_nodes=grad_nodes)


# -- localization ------------------------------------------------------------------------

def _instrumented(model: torch.nn.Module, role: str, notes: list[str]):
    """A keyed copy of ``model`` with every node captured (Capture("all")), or None and a note."""
    try:
        gm = keyed_copy(model) if isinstance(model, fx.GraphModule) else trace(model)
    except TraceFailure as exc:
        if next(model.children(), None) is not None:  # instrument() would go part by part
            notes.append(f"node values not compared: the {role} cannot be traced as a whole; "
                         f"compare its traced parts (fxdebug.traced_parts, fxdebug.part_inputs)")
        else:
            notes.append(f"node values not compared: the {role} could not be instrumented: "
                         f"{' '.join(str(exc).split())}")
        return None
    Capture("all")(gm)
    return gm


def _values_by_node(gm: fx.GraphModule) -> dict[str, list[tuple[str, torch.Tensor]]]:
    recorder = getattr(gm, RECORDER_ATTR, None)
    if recorder is None:  # nothing to capture in this graph
        return {}
    keys = {node_key(node): None for node in value_nodes(gm.graph)}
    found: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for record in recorder.latest.records():
        base, _, sub = record.key.partition("/")
        if base in keys and record.value is not None:
            found.setdefault(base, []).append((sub, record.value))
    return found


def _localize_grads(reference, candidate, runs: ControlledRuns, rtol, atol, equal_nan,
                    notes: list[str]) -> list[NodeComparison]:
    """Activation gradients of both, compared in the reference's backward order."""
    try:
        ref_gm, cand_gm = keyed_module(reference), keyed_module(candidate)
    except FxdebugError as exc:
        notes.append(f"activation gradients not compared: {' '.join(str(exc).split())}")
        return []
    ref_grads = runs.run(lambda *args: activation_grads(ref_gm, args, outputs_loss), grad=True)
    cand_grads = runs.run(lambda *args: activation_grads(cand_gm, args, outputs_loss), grad=True)
    matching = match_nodes(ref_gm, cand_gm)
    rows: list[NodeComparison] = []
    for ref, grad in ref_grads.items():
        match = matching.counterpart.get(ref)
        if match is None:
            continue
        if match.candidate in cand_grads:
            row = _compare_node(ref, ref_gm, match.candidate, cand_gm, match.how,
                                list(grad.items()), list(cand_grads[match.candidate].items()),
                                rtol, atol, equal_nan)
        else:
            row = NodeComparison(
                key=node_key(ref), op=op_name(ref, ref_gm), target=_target_text(ref),
                source=ref.meta.get(META_SOURCE), candidate_key=node_key(match.candidate),
                candidate_op=op_name(match.candidate, cand_gm), match=match.how, ok=False,
                max_abs=math.inf, max_rel=math.inf, shape="", dtype="",
                detail="no gradient reaches it in the candidate")
        rows.append(row)
    owners = {m.candidate: ref for ref, m in matching.counterpart.items()}
    for cand in cand_grads:
        ref = owners.get(cand)
        if ref is not None and ref not in ref_grads:
            rows.append(NodeComparison(
                key=node_key(ref), op=op_name(ref, ref_gm), target=_target_text(ref),
                source=ref.meta.get(META_SOURCE), candidate_key=node_key(cand),
                candidate_op=op_name(cand, cand_gm), match=matching.counterpart[ref].how, ok=False,
                max_abs=math.inf, max_rel=math.inf, shape="", dtype="",
                detail="a gradient reaches it only in the candidate"))
    return rows


def _run_and_collect(gm: fx.GraphModule, runs: ControlledRuns, eager_out, role: str, rtol, atol,
                     equal_nan, notes: list[str]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Run an instrumented module; its captured values by node key."""
    traced_out = runs.run(gm)
    if not all(c.ok for c in compare_values(eager_out, traced_out, "out", rtol, atol,
                                            equal_nan)):
        notes.append(f"the traced {role} does not reproduce the {role}'s own outputs (a branch "
                     f"fixed at trace time, or randomness): node values may mislead")
    return _values_by_node(gm)


def _target_text(node: fx.Node) -> str:
    if node.op == "call_function":
        return target_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "placeholder":
        return f"input {node.target}"
    return str(node.target)


def _compare_node(ref: fx.Node, ref_gm, cand: fx.Node, cand_gm, how: str, ref_values,
                  cand_values, rtol, atol, equal_nan) -> NodeComparison:
    ref_key, cand_key = node_key(ref), node_key(cand)
    if [sub for sub, _ in ref_values] == [sub for sub, _ in cand_values] == [""]:
        rows = [compare_tensors(ref_values[0][1], cand_values[0][1], ref_key, rtol, atol,
                                equal_nan)]
    else:
        rows = compare_values(dict(ref_values), dict(cand_values), ref_key, rtol, atol,
                              equal_nan)
    worst = max(rows, key=lambda c: (not c.ok, c.max_abs, c.max_rel)) if rows else None
    detail = ""
    if worst is not None and worst.detail:
        detail = worst.detail
    if worst is not None and not worst.ok and len(rows) > 1:
        detail = f"{worst.path}: {detail}" if detail else f"worst at {worst.path}"
    first_shape = rows[0].shape if rows else ""
    return NodeComparison(
        key=ref_key, op=op_name(ref, ref_gm), target=_target_text(ref),
        source=ref.meta.get(META_SOURCE), candidate_key=cand_key,
        candidate_op=op_name(cand, cand_gm), match=how,
        ok=all(c.ok for c in rows), max_abs=max((c.max_abs for c in rows), default=0.0),
        max_rel=max((c.max_rel for c in rows), default=0.0),
        shape=first_shape, dtype=rows[0].dtype if rows else "", detail=detail)


def _changed_modules_note(matching: NodeMatching, owners: dict) -> str:
    """What became of module calls whose module the candidate changed (a fusion, new weights)."""
    described = []
    for ref, cand in matching.changed_modules:
        seen = owners.get(cand)
        described.append(f"{node_key(ref)} (compared as {node_key(seen)})" if seen is not None
                         else f"{node_key(ref)} (not compared)")
    listed = ", ".join(described[:4]) + (f" and {len(described) - 4} more"
                                         if len(described) > 4 else "")
    return (f"the candidate changed the module of {len(described)} module call(s): its module "
            f"at the same path has other parameters or buffers (a fusion, or new weights), so "
            f"it computes another value under the same key: {listed}. Each is compared with "
            f"the reference node whose value its users read, never with the reference node of "
            f"its key. A pass can say what a new or changed node computes with "
            f"fxdebug.passes.inherit_key(new_node, old_node) (a conv with a batch norm folded "
            f"in: the batch norm's node).")


def _rewired_text(ref: fx.Node, matching: NodeMatching) -> tuple[str, str]:
    """The argument change of a reference node whose counterpart reads other nodes' counterparts,
    and what it reads where: ``("(fc2, fc1) -> (fc2, fc1_relu)", "it reads ...")``."""
    rewires = matching.rewired.get(ref)
    if not rewires:
        return "", ""
    change = f"{arguments_text(ref)} -> {arguments_text(matching.counterpart[ref].candidate)}"
    reads = ", and ".join(
        f"{node_key(r.candidate)!r}"
        + ("" if node_key(r.candidate) == node_key(r.stands_for) else
           f" (the candidate's counterpart of {node_key(r.stands_for)!r})")
        + f" where the reference reads {node_key(r.reference)!r}" for r in rewires)
    return change, f"it reads {reads}"


def _compare_matched(ref_gm, cand_gm, matching: NodeMatching, ref_values, cand_values, rtol,
                     atol, equal_nan):
    """A row for every matched node and every node read in a reference node's place, in the
    reference's execution order; and the verdict of each compared (reference, candidate) pair."""
    matched_candidates = {m.candidate: None for m in matching.counterpart.values()}
    owners = {m.candidate: ref for ref, m in matching.counterpart.items()}
    compared: list[NodeComparison] = []
    verdicts: dict[tuple[fx.Node, fx.Node], bool] = {}
    for ref in value_nodes(ref_gm.graph):
        key = node_key(ref)
        if key not in ref_values:
            continue  # not a tensor (a size, a shape): its effect shows downstream
        match = matching.counterpart.get(ref)
        if match is not None and node_key(match.candidate) in cand_values:
            row = _compare_node(ref, ref_gm, match.candidate, cand_gm, match.how,
                                ref_values[key], cand_values[node_key(match.candidate)],
                                rtol, atol, equal_nan)
            verdicts[(ref, match.candidate)] = row.ok
            change, reads = _rewired_text(ref, matching)
            if change:
                row = dataclasses.replace(row, arguments=change, detail="; ".join(
                    part for part in (reads, row.detail) if part))
            compared.append(row)
        elif match is not None:
            compared.append(NodeComparison(
                key=key, op=op_name(ref, ref_gm), target=_target_text(ref),
                source=ref.meta.get(META_SOURCE), candidate_key=node_key(match.candidate),
                candidate_op=op_name(match.candidate, cand_gm), match=match.how, ok=False,
                max_abs=math.inf, max_rel=math.inf, shape="", dtype="",
                detail="the candidate's value is not a tensor"))
        for cand, user in matching.seen_as.get(ref, ()):
            cand_key = node_key(cand)
            if cand_key not in cand_values:
                continue
            row = _compare_node(ref, ref_gm, cand, cand_gm, "in its place", ref_values[key],
                                cand_values[cand_key], rtol, atol, equal_nan)
            verdicts[(ref, cand)] = row.ok
            detail = ("only in the candidate" if cand not in matched_candidates else
                      f"the candidate's counterpart of {node_key(owners[cand])!r}")
            compared.append(dataclasses.replace(
                row, match="in its place", via=node_key(user),
                detail=f"{detail}; {row.detail}" if row.detail else detail))
    return compared, verdicts


def _refuted_note(refuted: list[tuple[fx.Node, fx.Node]], matching: NodeMatching) -> str:
    """What became of matches the values refuted (a fused node read in another node's place)."""
    owners = {m.candidate: ref for ref, m in matching.counterpart.items()}
    described = []
    for ref, cand in refuted:
        owner = owners.get(cand)
        whose = f"of {node_key(owner)!r}" if owner is not None else "of another reference node"
        described.append(f"{node_key(cand)!r} reads what {node_key(ref)!r} reads but computes "
                         f"the value {whose}, not of {node_key(ref)!r}")
    return (f"{'; '.join(described)} (a fusion): each is compared as the node whose value it "
            f"computes, and a reference node it only seemed to match is listed without a "
            f"counterpart. A pass can say what a new node computes with "
            f"fxdebug.passes.inherit_key(new_node, old_node).")


def _localize(reference, candidate, runs: ControlledRuns, ref_out, cand_out, rtol, atol,
              equal_nan, notes: list[str]):
    ref_gm = _instrumented(reference, "reference", notes)
    cand_gm = _instrumented(candidate, "candidate", notes)
    if ref_gm is None or cand_gm is None:
        return None
    ref_values = _run_and_collect(ref_gm, runs, ref_out, "reference", rtol, atol, equal_nan,
                                  notes)
    cand_values = _run_and_collect(cand_gm, runs, cand_out, "candidate", rtol, atol, equal_nan,
                                   notes)
    refuted: list[tuple[fx.Node, fx.Node]] = []
    for _ in value_nodes(ref_gm.graph):  # each round refutes at least one more match
        matching: NodeMatching = match_nodes(ref_gm, cand_gm, refuted)
        compared, verdicts = _compare_matched(ref_gm, cand_gm, matching, ref_values,
                                              cand_values, rtol, atol, equal_nan)
        more = refuted_matches(matching, lambda ref, cand: verdicts.get((ref, cand)))
        if not more:
            break
        refuted.extend(more)
    owners = {m.candidate: ref for ref, m in matching.counterpart.items()}
    changed = {ref: None for ref, _ in matching.changed_modules}
    unmatched_ref = [node_key(n) for n in matching.unmatched_reference
                     if n not in matching.seen_as and n.op != "get_attr" and n not in changed]
    if refuted:
        notes.append(_refuted_note(refuted, matching))
    if matching.changed_modules:
        notes.append(_changed_modules_note(matching, owners))
    elif (unmatched_ref and not refuted
          and not any(n.meta.get(META_PROVENANCE) for n in cand_gm.graph.nodes)):
        notes.append(f"a pass that replaces a node can pair the new node with the old one: "
                     f"fxdebug.passes.inherit_key(new_node, old_node) gives it the old node's "
                     f"key ({unmatched_ref[0]!r} and the others without a counterpart)")
    unmatched_cand = [node_key(n) for n in matching.unmatched_candidate
                      if n.op != "get_attr" and not any(
                          cand is n for entries in matching.seen_as.values()
                          for cand, _ in entries)]
    return compared, unmatched_ref, unmatched_cand
