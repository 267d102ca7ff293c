"""Statistics of every selected module over training steps, on disk, across ranks.

::

    training_monitor.py  fxdebug.monitor(model, every=N, ...): the monitor you leave on;
                         step(loss)
    moment_records.py    the logged forward's captures: the large ones summarized as made
    update_copies.py     the parameters' copy for the update, in buffers kept between
                         logged steps
    selection.py   select= by module-name pattern and module class
    statistics.py  the stats of a moment summary and their names <key>.<kind>.<stat>
    folder.py      the series folder: a JSON-lines file per rank, global lines, a manifest
    sinks.py       a TensorBoard SummaryWriter, any callable
    series.py      fxdebug.load_series(folder): .keys(), .get(key, stat, kind, rank), .drift()
    drift.py       DriftReport: the keys that moved most over a window
    hf_callback.py         HFMonitorCallback: the monitor in a Hugging Face Trainer
    lightning_callback.py  LightningMonitorCallback: the monitor in a Lightning Trainer
    trainer_common.py      what both share: options, a training run's monitor

The trainer callbacks are imported by their module (``from fxdebug.monitoring.hf_callback import
HFMonitorCallback``), not here: each needs its trainer's package.

The statistics are moment summaries (:mod:`fxdebug.stats.moments`); their
reduction over ranks is :mod:`fxdebug.distributed.summaries`.
"""

from .drift import DriftReport
from .training_monitor import Monitor, monitor
from .series import Series, load_series
from .statistics import KINDS, STATS

__all__ = ["monitor", "Monitor", "load_series", "Series", "DriftReport", "KINDS", "STATS"]
