"""Real model families under real parallelism plans: every verdict right, every planted bug named?

The matrix of issue 42: Hugging Face ``llama``, ``gpt2``, ``qwen2``, timm ``mixer`` and
``vit``, torchvision ``resnet18`` (tiny, random, seeded: ``tests/sharded_families.py``) x
``fsdp`` (FSDP2 fp32), ``fsdp_bf16`` (bf16 ``MixedPrecisionPolicy``), ``tp`` (a hand plan),
``tp_hf`` (transformers' ``base_model_tp_plan``) on 2 gloo ranks, ``fsdp_tp`` (dp x tp on a
2x2 mesh) and ``hsdp`` (replicate x shard) on 4. Every rank runs the same input. For each
pair that applies:

1. **instrumented**: ``fxdebug.instrument(model, folder=...)`` and one forward;
2. **captures match**: ground truth computed another way: forward hooks on the unsharded
   model give every key's value; each rank's capture (read back from its folder) must be
   that value, this rank's piece of it (chunked along the dim that differs, by tensor-parallel
   rank), or an addend of it (summed over the tensor-parallel group: a RowwiseParallel output
   before its all-reduce);
3. **compare verdict**: ``fxdebug.compare_runs(unsharded, sharded, reference=float64 run)``
   must be EQUAL with every key compared (bf16: judged by the float64 reference; the column
   shows how near the nearest key came to the reference's bound);
4. **planted bugs named**: each bug below that applies, planted in a fresh copy; ground
   truth is forward hooks on the plain (uninstrumented) buggy sharded model: the first key,
   in execution order, whose value on some rank no longer matches the unsharded hooks (as in
   2), and the ranks where it does not. ``compare_runs`` must be DIFFERENT, name that key and
   those ranks, and find every earlier key ok;
5. **seconds**: the row on every rank (the unsharded and float64 runs of the family, shared
   by its rows, not included).

Planted bugs (``BUGS``; in block 1 of each model, ``SITES``):

- ``all_reduce``: the block's RowwiseParallel given ``output_layouts=Partial()``: its
  all-reduce never runs (tensor-parallel configurations);
- ``col_for_row``: ColwiseParallel where the plan's RowwiseParallel belongs: torch's sharding
  propagation rejects the shapes in the plain model already; the check is that the
  instrumented model raises the same error (nothing to compare);
- ``scaled``: rank 1's shard of a weight scaled by 1.01 (the first Linear/conv of the block);
- ``norm``: rank 1's LayerNorm / RMSNorm (resnet18: BatchNorm) weight scaled by 1.01;
- ``eps``: that norm's eps set to 0.1 on every rank (a configuration that differs).

Writes the table to stdout (and ``--out``). Run (from the repository root)::

    python benchmarks/sharded_zoo.py                      # the whole matrix (minutes)
    python benchmarks/sharded_zoo.py --quick              # mixer and resnet18 only
    python benchmarks/sharded_zoo.py --only llama,mixer --configs tp,fsdp_tp
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import fxdebug  # noqa: E402
import sharded_families as families  # noqa: E402

WORLD = {"fsdp": 2, "fsdp_bf16": 2, "tp": 2, "tp_hf": 2, "fsdp_tp": 4, "hsdp": 4}
BUGS = ("all_reduce", "col_for_row", "scaled", "norm", "eps")
TP_CONFIGS = ("tp", "tp_hf", "fsdp_tp")
SCALE, EPS = 1.01, 0.1

# block 1's sites: the plan's RowwiseParallel (relative to the plan's base), the weight to scale,
# the norm (its weight and its eps attribute)
_HF_SITES = dict(rowwise="layers.1.mlp.down_proj", scaled="model.layers.1.mlp.gate_proj",
                 norm="model.layers.1.post_attention_layernorm", eps="variance_epsilon")
SITES = {
    "llama": _HF_SITES, "qwen2": _HF_SITES,
    "gpt2": dict(rowwise=None, scaled="transformer.h.1.mlp.c_fc", norm="transformer.h.1.ln_2",
                 eps="eps"),
    "mixer": dict(rowwise="blocks.1.mlp_channels.fc2", scaled="blocks.1.mlp_channels.fc1",
                  norm="blocks.1.norm2", eps="eps"),
    "vit": dict(rowwise="blocks.1.mlp.fc2", scaled="blocks.1.mlp.fc1", norm="blocks.1.norm2",
                eps="eps"),
    "resnet18": dict(rowwise=None, scaled="layer3.0.conv1", norm="layer3.0.bn1", eps="eps"),
}


def bug_applies(family: str, config: str, bug: str) -> str:
    """``""`` where ``bug`` can be planted in ``family`` under ``config``, else why not."""
    if config == "fsdp_bf16":
        return "bf16: bugs are planted in the fp32 configurations"
    if bug in ("all_reduce", "col_for_row"):
        if config not in TP_CONFIGS:
            return "no RowwiseParallel in a data-parallel configuration"
        if SITES[family]["rowwise"] is None:
            return f"{family}: no tensor-parallel plan"
    return ""


def plan_with(family: str, config: str, bug: str | None) -> dict | None:
    """The configuration's TP plan, block by block, with ``bug`` planted at the Rowwise site."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if config not in TP_CONFIGS or bug not in ("all_reduce", "col_for_row"):
        return None
    plan = families.tp_plan(family, "hf" if config == "tp_hf" else "hand")
    plan = {path.replace("*", str(i)): copy.deepcopy(style) for path, style in plan.items()
            for i in (range(2) if "*" in path else (0,))}
    plan[SITES[family]["rowwise"]] = (RowwiseParallel(output_layouts=Partial())
                                      if bug == "all_reduce" else ColwiseParallel())
    return plan


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def plant(model: torch.nn.Module, family: str, bug: str | None, when: str) -> None:
    """Plant ``bug`` (``when``: "before" configuring, on every rank; "after", on rank 1)."""
    import torch.distributed as dist
    site = SITES[family]
    if bug == "eps" and when == "before":
        setattr(model.get_submodule(site["norm"]), site["eps"], EPS)
    if bug in ("scaled", "norm") and when == "after" and dist.get_rank() == 1:
        weight = model.get_submodule(site["scaled" if bug == "scaled" else "norm"]).weight
        with torch.no_grad():
            _local(weight).mul_(SCALE)


def hooked(model: torch.nn.Module):
    """Forward hooks keying every module call's outputs as fxdebug does; ``(seen, handles)``."""
    from fxdebug.runtime.values import named_leaves
    seen: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def hook(out, name):
        count = calls.get(name, 0)
        calls[name] = count + 1
        for key, leaf in named_leaves(out, name if count == 0 else f"{name}_{count}"):
            if isinstance(leaf, torch.Tensor):
                seen[key] = leaf.detach().clone()

    handles = [module.register_forward_hook(lambda m, a, o, name=name: hook(o, name))
               for name, module in model.named_modules() if name]
    return seen, handles


_TP_GROUPS: dict[int, list] = {}


class Truth:
    """Does a rank's value of a key match the unsharded model's (whole, piece or addend)?"""

    def __init__(self, unsharded: dict, config: str, world: int, tolerance: float) -> None:
        import torch.distributed as dist
        self.unsharded, self.tolerance = unsharded, tolerance
        self.group, self.index, self.size = None, 0, 1
        if config in TP_CONFIGS:  # the tensor-parallel group: ranks 2k, 2k+1 on 2 and on 2x2
            rank = dist.get_rank()
            if world not in _TP_GROUPS:  # every rank makes every group, in the same order
                _TP_GROUPS[world] = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
            self.group, self.index, self.size = _TP_GROUPS[world][rank // 2], rank % 2, 2

    def _close(self, value, truth) -> bool:
        return value.shape == truth.shape and torch.allclose(
            value.float(), truth.float(), rtol=self.tolerance, atol=self.tolerance)

    def bad_keys(self, keys: list[str], values) -> list[str]:
        """The keys (every rank calls with the same keys) whose value here matches nothing."""
        import torch.distributed as dist
        bad = []
        for key in keys:
            value = values[key]
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            value = value.detach()
            summed = None
            if self.group is not None:  # every rank of the group, every key: a collective
                summed = value.float().clone()
                dist.all_reduce(summed, group=self.group)
            truth = self.unsharded.get(key)
            if truth is None:
                bad.append(key)
                continue
            piece = truth
            if value.shape != truth.shape and value.dim() == truth.dim():
                dims = [d for d in range(truth.dim()) if truth.shape[d] != value.shape[d]]
                if len(dims) == 1 and truth.shape[dims[0]] == self.size * value.shape[dims[0]]:
                    piece = truth.chunk(self.size, dims[0])[self.index]
            addend = summed is not None and self._close(summed, truth)
            if not (self._close(value, piece) or addend):
                bad.append(key)
        return bad


def first_bad(order: list[str], bad: list[str]) -> tuple[str | None, tuple[int, ...]]:
    """The first key of ``order`` some rank holds wrong, and the ranks that do (a collective)."""
    import torch.distributed as dist
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, bad)
    for key in order:
        ranks = tuple(r for r, keys in enumerate(every) if key in keys)
        if ranks:
            return key, ranks
    return None, ()


def _summary(report) -> dict:
    first = report.first_divergence
    reference = report.reference
    return dict(ok=report.ok, verdict=report.verdict_text, complete=report.complete,
                compared=report.to_dict()["compared"], entries=len(report.entries),
                statuses=[(e.key, e.status) for e in report.entries],
                first=None if first is None else (first.key, tuple(first.ranks), first.status,
                                                  first.detail),
                nearest=None if reference is None or reference.largest is None
                else reference.largest)


class Family:
    """The unsharded runs of one family on one rank: fp32 records, float64 records, hooks."""

    def __init__(self, family: str, folder: str) -> None:
        import torch.distributed as dist
        self.name = family
        self.model, self.inputs = families.make(family)
        # the same on every rank: made once (on rank 0), read back by the others
        world = dist.get_world_size()
        runs = {"fp32": os.path.join(folder, f"{family}-{world}-unsharded"),
                "fp64": os.path.join(folder, f"{family}-{world}-float64")}
        if dist.get_rank() == 0:
            for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
                gm = fxdebug.instrument(copy.deepcopy(self.model).to(dtype))
                gm(*[x.to(dtype) if x.is_floating_point() else x for x in self.inputs])
                fxdebug.save_records(fxdebug.records(gm), runs[name], overwrite=True)
        dist.barrier()  # saved under a process group: in the folder's rank-0
        self.records = fxdebug.load_records(os.path.join(runs["fp32"], "rank-0"))
        self.keys = self.records.keys()
        self.reference = fxdebug.load_records(os.path.join(runs["fp64"], "rank-0"))
        eager = copy.deepcopy(self.model)
        self.hooks, _ = hooked(eager)
        self.output = families.output_tensor(eager(*self.inputs)).detach()

    def sharded(self, config: str, world: int, bug: str | None = None) -> torch.nn.Module:
        model = copy.deepcopy(self.model)
        plant(model, self.name, bug, "before")
        families.configure(model, self.name, config, world, plan=plan_with(self.name, config, bug))
        plant(model, self.name, bug, "after")
        return model

    def truth(self, model, config: str, world: int, tolerance: float):
        """Ground truth on the plain sharded ``model``: first key wrong, ranks, output error."""
        seen, handles = hooked(model)
        try:
            output = families.output_tensor(model(*self.inputs))
        finally:
            for handle in handles:
                handle.remove()
        output = output.full_tensor() if hasattr(output, "full_tensor") else output
        judge = Truth(self.hooks, config, world, tolerance)
        order = [key for key in self.keys if key in seen]
        missing = [key for key in self.keys if key not in seen]
        key, ranks = first_bad(self.keys, judge.bad_keys(order, seen) + missing)
        return key, ranks, float((output.float() - self.output).abs().max())


def correct_row(fam: Family, config: str, world: int, folder: str) -> dict:
    """Checks 1-3 for one configuration on this rank (a collective)."""
    import torch.distributed as dist
    start = time.perf_counter()
    tolerance = 6e-2 if config == "fsdp_bf16" else 1e-4
    model = fam.sharded(config, world)
    truth_key, truth_ranks, output_error = fam.truth(model, config, world, tolerance)
    row: dict = dict(output_error=output_error, truth_first_bad=truth_key)
    try:
        gm = fxdebug.instrument(model, folder=folder)  # each rank writes folder/rank-R
        gm(*fam.inputs)
        fxdebug.records(gm)
        saved = fxdebug.records(gm)  # read back from the folder
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        row.update(instrumented=f"NO: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                   seconds=time.perf_counter() - start)
        return row
    keys = saved.keys()
    judge = Truth(fam.hooks, config, world, tolerance)
    order = [key for key in keys if key in fam.hooks]
    bad = judge.bad_keys(order, saved) + [key for key in keys if key not in fam.hooks]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, bad)
    wrong = sorted({key for keys_ in every for key in keys_})
    report = fxdebug.compare_runs(fam.records, saved, reference=fam.reference)
    row.update(instrumented="yes", keys=len(keys), expected_keys=len(fam.keys),
               same_keys=keys == fam.keys, wrong=wrong, compare=_summary(report),
               seconds=time.perf_counter() - start)
    return row


def bug_row(fam: Family, config: str, world: int, bug: str) -> dict:
    """Check 4 for one planted bug on this rank (a collective)."""
    start = time.perf_counter()
    if bug == "col_for_row":
        found = {}
        for name, wrap in (("plain", lambda m: m), ("instrumented", fxdebug.instrument)):
            try:
                wrap(fam.sharded(config, world, bug))(*fam.inputs)
                found[name] = "ran"
            except Exception as exc:  # noqa: BLE001 - the plain model's error is the truth
                found[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return dict(raised=found, seconds=time.perf_counter() - start)
    model = fam.sharded(config, world, bug)
    truth_key, truth_ranks, output_error = fam.truth(model, config, world, 1e-4)
    gm = fxdebug.instrument(model)
    gm(*fam.inputs)
    report = _summary(fxdebug.compare_runs(fam.records, fxdebug.records(gm),
                                           reference=fam.reference))
    return dict(truth=(truth_key, truth_ranks), output_error=output_error, compare=report,
                seconds=time.perf_counter() - start)


def bug_named(family: str, bug: str, per_rank: list[dict]) -> str:
    """``""`` where every rank's :func:`bug_row` names the planted bug as it should, else why not.

    A run whose captures carry a placement (tensor parallel) is compared as one sharded run on
    every rank: each rank's report names the key and the ranks. Data-parallel captures (FSDP2,
    HSDP: each rank holds whole activations) are compared rank by rank: the ranks that hold the
    bug are those whose own report is DIFFERENT at that key, the others' reports are EQUAL.
    """
    found = per_rank[0]
    if bug == "col_for_row":
        plain, instrumented = found["raised"]["plain"], found["raised"]["instrumented"]
        if plain == "ran":
            return "the plain model ran: not the loud bug this check expects"
        return "" if instrumented == plain else f"instrumented: {instrumented} vs plain: {plain}"
    truth_key, truth_ranks = found["truth"]
    if truth_key is None:
        return "ground truth: no key differs"
    sharded = any(f["compare"]["first"] and f["compare"]["first"][1] for f in per_rank)
    blamed = tuple(r for r, f in enumerate(per_rank) if f["compare"]["verdict"] == "DIFFERENT")
    if sharded and blamed != tuple(range(len(per_rank))):
        return f"a sharded comparison DIFFERENT on ranks {blamed} only"
    for rank, f in enumerate(per_rank):
        report = f["compare"]
        if rank not in blamed:
            if not sharded and rank not in truth_ranks and report["ok"]:
                continue  # this rank's own run is correct, and its report says so
            return f"rank {rank}: verdict {report['verdict']}"
        key, ranks, _, detail = report["first"]
        keys = [k for k, _ in report["statuses"]]
        expected = {truth_key}
        if bug == "all_reduce":  # the pending sum reaches truth_key; its last held term is named
            site = SITES[family]["rowwise"]
            site = ("model." + site) if family in ("llama", "qwen2") else site
            if site in keys and truth_key in keys and "unreduced terms of a sum" in detail:
                expected |= set(keys[keys.index(site):keys.index(truth_key)])
        if key not in expected:
            return f"rank {rank}: named {key}, ground truth {truth_key}"
        if (ranks if sharded else blamed) != truth_ranks:
            return f"ranks {ranks if sharded else blamed}, ground truth {truth_ranks}"
        earlier = [(k, s) for k, s in report["statuses"][:keys.index(key)]
                   if s not in ("equal", "close", "rounding")]
        if earlier:
            return f"rank {rank}: earlier keys not ok: {earlier[:3]}"
    return ""


def family_rows(rank: int, world: int, family: str, jobs: list, folder: str) -> dict:
    """Every job ``(config, bugs)`` of ``family`` on this rank: ``{config: row}``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    fam = Family(family, folder)
    rows = {}
    for config, bugs in jobs:
        row = correct_row(fam, config, world, os.path.join(folder, f"{family}-{config}"))
        row["bugs"] = {bug: bug_row(fam, config, world, bug) for bug in bugs}
        rows[config] = row
    del fam
    gc.collect()  # the instrumented models and their folder writers go (nothing left to flush)
    return rows


def verdict_problems(row: dict, config: str) -> list[str]:
    """What is wrong with a correct configuration's row (empty: it holds)."""
    if row["instrumented"] != "yes":
        return [row["instrumented"]]
    problems = []
    if not row["same_keys"]:
        problems.append(f"keys {row['keys']} vs unsharded {row['expected_keys']}")
    if row["wrong"]:
        problems.append(f"captures differ from hooks: {row['wrong'][:3]}")
    report = row["compare"]
    if not (report["ok"] and report["verdict"] == "EQUAL" and report["complete"]
            and report["compared"] == row["expected_keys"]):
        problems.append(f"compare: {report['verdict']}, {report['compared']} compared, first "
                        f"{report['first']}")
    return problems


# -- the table -----------------------------------------------------------------------------
def run_matrix(family_names, configs, bugs, on_ranks, folder: str) -> list[dict]:
    """Rows ``{family, config, world, why, row, per_rank}`` for every pair, run with ``on_ranks``
    (``instrument(folder=)`` folders under ``folder``)."""
    out = []
    for family in family_names:
        for world in sorted({WORLD[c] for c in configs}):
            jobs = []
            for config in [c for c in configs if WORLD[c] == world]:
                why = families.unsupported(family, config, world)
                out.append(dict(family=family, config=config, world=world, why=why, row=None))
                if not why:
                    jobs.append((config, [b for b in bugs if not bug_applies(family, config, b)]))
            if not jobs:
                continue
            start = time.perf_counter()
            results = on_ranks(family_rows, world, family, jobs, folder, timeout=600)
            print(f"{family} on {world} ranks: {time.perf_counter() - start:.1f} s", flush=True)
            for entry in out:
                if entry["family"] == family and entry["world"] == world and not entry["why"]:
                    entry["row"] = results[0][entry["config"]]
                    entry["per_rank"] = [found[entry["config"]] for found in results]
    return out


def _cells(entry: dict) -> list[str]:
    row = entry["row"]
    if row is None:
        return [entry["family"], entry["config"], str(entry["world"]), "n/a", "-", "-", "-", "-"]
    problems = [p for r in entry["per_rank"] for p in verdict_problems(r, entry["config"])]
    if row["instrumented"] != "yes":
        return [entry["family"], entry["config"], str(entry["world"]), row["instrumented"], "-",
                "-", "-", f"{row['seconds']:.1f}"]
    report = row["compare"]
    matched = row["keys"] - len(row["wrong"])
    verdict = f"{report['verdict']} ({report['compared']}/{row['expected_keys']} compared)"
    if report["nearest"] is not None and entry["config"] == "fsdp_bf16":
        verdict += f", nearest {report['nearest'][0]:.2g} of the bound"
    if problems and report["ok"]:
        verdict += "; " + "; ".join(problems)
    named = []
    for bug in row["bugs"]:
        why = bug_named(entry["family"], bug, [r["bugs"][bug] for r in entry["per_rank"]])
        named.append(f"{bug}: " + ("yes" if not why else f"NO ({why})"))
    seconds = row["seconds"] + sum(found["seconds"] for found in row["bugs"].values())
    return [entry["family"], entry["config"], str(entry["world"]), "yes",
            f"{matched}/{row['keys']}", verdict, "; ".join(named) or "-", f"{seconds:.1f}"]


def render(entries: list[dict], command: str) -> str:
    lines = [f"`{command}` (torch {torch.__version__}, gloo on the CPU, 1 thread a rank):", "",
             "| family | configuration | ranks | instrumented | captures match hooks | "
             "compare verdict (float64 reference) | planted bug named | seconds |",
             "|---|---|---:|---|---:|---|---|---:|"]
    lines += ["| " + " | ".join(_cells(entry)) + " |" for entry in entries]
    skipped = [f"- {e['family']} x {e['config']}: {e['why']}" for e in entries if e["why"]]
    if skipped:
        lines += ["", "Pairs that do not apply:", ""] + skipped
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from ranks import close_all, on_ranks
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="mixer and resnet18 only")
    parser.add_argument("--only", default="", help="comma-separated families")
    parser.add_argument("--configs", default="", help="comma-separated configurations")
    parser.add_argument("--bugs", default=",".join(BUGS), help="comma-separated planted bugs")
    parser.add_argument("--threads", type=int, default=0, help="ignored: one thread a rank")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or (
        ["mixer", "resnet18"] if args.quick else list(families.FAMILIES))
    configs = [c for c in args.configs.split(",") if c] or list(families.CONFIGS)
    bugs = [b for b in args.bugs.split(",") if b]
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--out")]
    start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="fxdebug-sharded-zoo-")
    try:
        entries = run_matrix(names, configs, bugs, on_ranks, folder)
    finally:
        close_all()
        shutil.rmtree(folder, ignore_errors=True)
    text = render(entries, " ".join(["python benchmarks/sharded_zoo.py", *shown]))
    text += f"\nTotal {time.perf_counter() - start:.0f} s on {os.cpu_count()} cores.\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
