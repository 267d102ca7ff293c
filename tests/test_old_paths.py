"""What Records pickled and folders dumped before the modules moved name still loads.

Pickle finds a class by the module it was defined in (a protocol-0 pickle spells it out as
``c<module>\\n<name>\\n``), and a dumped folder's module.py imports ``fxdebug.runtime``'s
node functions by name; these paths stay.
"""

import pickle

import pytest
import torch

import fxdebug


@pytest.mark.parametrize("module, name, where", [
    ("fxdebug.runtime.stats", "Stats", "fxdebug.stats.summary"),  # old path on purpose
    ("fxdebug.runtime.records", "Records", "fxdebug.runtime.records"),
    ("fxdebug.runtime.record", "Record", "fxdebug.runtime.record"),
    ("fxdebug.runtime.record", "BatchedStatsRecord", "fxdebug.runtime.record"),
    ("fxdebug.runtime.compiled_stats", "StatsSink", "fxdebug.runtime.compiled_stats"),
    ("fxdebug.runtime.nodes", "Recorder", "fxdebug.runtime.nodes"),
    ("fxdebug.runtime.placement", "Placement", "fxdebug.runtime.placement"),
    ("fxdebug.runs.sharded", "ShardedRecords", "fxdebug.distributed.sharded"),  # old path on purpose
    ("fxdebug.runs.sharded", "ShardedRecord", "fxdebug.distributed.sharded"),  # old path on purpose
    ("fxdebug.runs.saved_runs", "SavedRecords", "fxdebug.runs.saved_runs"),
    ("fxdebug.instrument", "_instrument_mode", "fxdebug.instrumenting"),  # old path on purpose
    ("fxdebug.instrument", "_after_mode_switch", "fxdebug.instrumenting"),  # old path on purpose
])
def test_an_old_pickle_path_finds_the_class(module, name, where):
    found = pickle.loads(f"c{module}\n{name}\n.".encode())
    assert found.__name__ == name and found.__module__ == where
    assert type(fxdebug.instrument).__name__ == "function"  # never hidden by a module


def test_records_pickled_with_the_old_path_of_stats_load():
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 2)), mode="stats")
    gm(torch.ones(2, 3))
    records = fxdebug.records(gm)
    stats = records["0"]
    data = pickle.dumps(stats, protocol=0)
    assert b"cfxdebug.stats.summary\nStats\n" in data
    old = data.replace(b"cfxdebug.stats.summary\nStats\n", b"cfxdebug.runtime.stats\nStats\n")
    assert pickle.loads(old) == stats


@pytest.mark.parametrize("name", ["begin_run", "capture", "capture_stats", "own_value",
                                  "record_grads", "stops_disabled"])
def test_what_a_dumped_folder_imports_is_where_it_was(name):
    import fxdebug.runtime.nodes
    assert callable(getattr(fxdebug.runtime, name))
    assert fxdebug.runtime.nodes.Recorder is fxdebug.runtime.Recorder
