"""The "must show" matrix of issue 42 on gloo (2 and 4 ranks): real families x real parallelism.

Families (``sharded_families``): Hugging Face llama, gpt2, qwen2; timm mixer, vit; torchvision
resnet18. Configurations: FSDP2 fp32 and bf16, TP (a hand plan; transformers'
``base_model_tp_plan`` where shipped), FSDP x TP on 2x2, HSDP. Every rank runs the same input.

For each pair tested (``benchmarks/sharded_zoo.py`` runs every pair; the tests keep a
subset that covers every family, configuration and planted bug, see ``TESTED``):

- ground truth, computed another way: forward hooks on the unsharded model (each rank's
  capture is the whole value, its tensor-parallel piece, or an addend whose sum over the
  tensor-parallel group is the value), ``DTensor.full_tensor()`` of the output;
- ``compare_runs(unsharded, sharded, reference=float64 run)`` is ``.ok``, EQUAL, every key
  compared (bf16: judged by the float64 reference);
- each planted bug (a missing all-reduce, Colwise where Rowwise belongs, one rank's shard
  scaled, a norm weight changed on one rank, an eps changed) is named at the key where the
  plain buggy model's hooks first differ, with the ranks that hold it, every earlier key ok.
"""

from __future__ import annotations

import pytest

import sharded_families as families
import sharded_zoo as zoo
from ranks import on_ranks

# family -> [(configuration, planted bugs)]; world from zoo.WORLD
TESTED = {
    "llama": [("tp", ("all_reduce", "norm", "eps")), ("tp_hf", ()), ("fsdp_bf16", ()),
              ("fsdp_tp", ("scaled",))],
    "gpt2": [("fsdp", ("norm",))],
    "qwen2": [("tp_hf", ("all_reduce",))],
    "mixer": [("fsdp", ("scaled", "eps")), ("fsdp_bf16", ()), ("tp", ("col_for_row", "scaled")),
              ("fsdp_tp", ("all_reduce", "scaled", "norm")), ("hsdp", ("scaled",))],
    "vit": [("tp", ("eps", "norm")), ("fsdp_bf16", ())],
    "resnet18": [("fsdp", ("norm",)), ("hsdp", ("eps",))],
}

# pairs that apply but run in the benchmark only (runtime: 2 shared cores, <= 3 minutes here)
BENCHMARK_ONLY = {
    ("llama", "fsdp"), ("llama", "hsdp"), ("gpt2", "fsdp_bf16"),
    ("gpt2", "hsdp"), ("qwen2", "fsdp"), ("qwen2", "fsdp_bf16"), ("qwen2", "tp"),
    ("qwen2", "fsdp_tp"), ("qwen2", "hsdp"), ("vit", "fsdp"), ("vit", "fsdp_tp"), ("vit", "hsdp"),
}

# pairs that do not apply, and why (families.unsupported on the configuration's world)
NOT_APPLICABLE = {
    ("gpt2", "tp"): "gpt2: torch's ColwiseParallel/RowwiseParallel shard nn.Linear only",
    ("gpt2", "tp_hf"): "gpt2: transformers ships no base_model_tp_plan for it",
    ("gpt2", "fsdp_tp"): "gpt2: torch's ColwiseParallel/RowwiseParallel shard nn.Linear only",
    ("mixer", "tp_hf"): "mixer: transformers ships no base_model_tp_plan for it",
    ("vit", "tp_hf"): "vit: transformers ships no base_model_tp_plan for it",
    ("resnet18", "fsdp_bf16"): "resnet18: BatchNorm's float32 running statistics meet bf16 "
                               "parameters (F.batch_norm refuses mixed dtypes)",
    ("resnet18", "tp"): "resnet18: torch's ColwiseParallel/RowwiseParallel shard nn.Linear only",
    ("resnet18", "tp_hf"): "resnet18: transformers ships no base_model_tp_plan for it",
    ("resnet18", "fsdp_tp"): "resnet18: torch's ColwiseParallel/RowwiseParallel shard nn.Linear "
                             "only",
}


def test_every_pair_is_tested_benchmarked_or_listed_with_its_reason():
    pytest.importorskip("transformers")  # gpt2's HF plan is read from its config
    found = {(f, c): families.unsupported(f, c, zoo.WORLD[c]) for f in families.FAMILIES
             for c in families.CONFIGS}
    assert {pair: why for pair, why in found.items() if why} == NOT_APPLICABLE
    tested = {(f, c) for f, jobs in TESTED.items() for c, _ in jobs}
    applies = {pair for pair, why in found.items() if not why}
    assert tested | BENCHMARK_ONLY == applies and not tested & BENCHMARK_ONLY
    # the tested subset still covers every family, configuration and planted bug
    assert {f for f, _ in tested} == set(families.FAMILIES)
    assert {c for _, c in tested} == set(families.CONFIGS)
    planted = {(c, b) for jobs in TESTED.values() for c, bugs in jobs for b in bugs}
    assert {b for _, b in planted} == set(zoo.BUGS)
    for family, jobs in TESTED.items():  # and a bug is planted only where it applies
        for config, bugs in jobs:
            assert [b for b in bugs if zoo.bug_applies(family, config, b)] == [], (family, config)


def _check(family: str, world: int, per_rank: list[dict]) -> None:
    for config, bugs in TESTED[family]:
        if zoo.WORLD[config] != world:
            continue
        rows = [found[config] for found in per_rank]
        for rank, row in enumerate(rows):
            # ground truth first: the correct configuration computes the unsharded output
            assert row["output_error"] < (5e-2 if config == "fsdp_bf16" else 1e-4), (config, row)
            assert row["truth_first_bad"] is None, (config, rank, row["truth_first_bad"])
            assert zoo.verdict_problems(row, config) == [], (family, config, rank)
            report = row["compare"]
            assert report["compared"] == row["expected_keys"] == row["keys"] > 10
        for bug in bugs:
            found = [row["bugs"][bug] for row in rows]
            if bug != "col_for_row":
                truth_key, _ = found[0]["truth"]
                assert found[0]["output_error"] > 1e-4, (config, bug)  # the bug changes the output
                site = zoo.SITES[family]["scaled" if bug == "scaled" else "norm"]
                if bug != "all_reduce":  # the planted change itself: the first key it touches
                    assert truth_key == site, (config, bug, truth_key)
                else:
                    assert ".1" in truth_key, truth_key  # block 1, after the missing all-reduce
            assert zoo.bug_named(family, bug, found) == "", (family, config, bug, found[0])


def _run(family: str, world: int, folder: str) -> None:
    jobs = [(c, bugs) for c, bugs in TESTED[family] if zoo.WORLD[c] == world]
    if not jobs:
        return
    if family in families.HF:
        pytest.importorskip("transformers")
    pytest.importorskip("timm" if family in ("mixer", "vit") else "torchvision")
    _check(family, world, on_ranks(zoo.family_rows, world, family, jobs, folder, timeout=400))


@pytest.mark.parametrize("family", list(TESTED))
def test_two_ranks(family, tmp_path):
    _run(family, 2, str(tmp_path))


@pytest.mark.parametrize("family", [f for f, jobs in TESTED.items()
                                    if any(zoo.WORLD[c] == 4 for c, _ in jobs)])
def test_four_ranks(family, tmp_path):
    _run(family, 4, str(tmp_path))
