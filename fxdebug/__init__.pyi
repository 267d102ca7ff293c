"""What type checkers and IDEs see of ``import fxdebug``: written by
``python tests/test_api.py`` from ``fxdebug._LAZY`` (the one list of public names);
do not edit."""

__version__: str

from .frontend import trace as trace
from .instrumenting import instrument as instrument
from .instrumenting import records as records
from .instrumenting import accumulate_stats as accumulate_stats
from .instrumenting import set_step as set_step
from .runtime import Records as Records
from .runtime import Record as Record
from .runtime import Stats as Stats
from .partial import PartialReport as PartialReport
from .partial import traced_parts as traced_parts
from .partial import part_inputs as part_inputs
from . import passes as passes
from .pass_manager import PassManager as PassManager
from .pass_manager import PassManagerResult as PassManagerResult
from .pass_manager import PassReport as PassReport
from .reporting import print_tabular as print_tabular
from .reporting import GraphDiff as GraphDiff
from .reporting import DiffRow as DiffRow
from .reporting.graph_diff import diff as diff
from .reporting.html import report as report
from .reporting import plots as plots
from .dumping import dump as dump
from .equivalence import check_equivalence as check_equivalence
from .equivalence import EquivalenceReport as EquivalenceReport
from .equivalence import jacobian_norms as jacobian_norms
from .equivalence import JacobianNorms as JacobianNorms
from .equivalence.vector_jacobian import vjp as vjp
from . import testing as testing
from .nonfinite import find_nonfinite as find_nonfinite
from .nonfinite import NonfiniteReport as NonfiniteReport
from .nonfinite import NonfiniteWatch as NonfiniteWatch
from .nonfinite import WatchReport as WatchReport
from .nonfinite import RankNonfiniteReport as RankNonfiniteReport
from .compiled import check_compiled as check_compiled
from .compiled import CompiledReport as CompiledReport
from .compiled import backend as backend
from .compiled import InstrumentingBackend as InstrumentingBackend
from .compiled import watch_nonfinite as watch_nonfinite
from .hazards import lint_inplace as lint_inplace
from .hazards import Hazard as Hazard
from .hazards import Hazards as Hazards
from .runs import save_records as save_records
from .runs import load_records as load_records
from .runs import SavedRecords as SavedRecords
from .runs import ShardedRecords as ShardedRecords
from .runs import RunComparison as RunComparison
from .runs.run_comparison import compare_runs as compare_runs
from .distributed import compare_ranks as compare_ranks
from .distributed import RankReport as RankReport
from .monitoring.training_monitor import monitor as monitor
from .monitoring import Monitor as Monitor
from .monitoring import load_series as load_series
from .monitoring import Series as Series
from .monitoring import DriftReport as DriftReport
from .monitoring.spike_report import SpikeReport as SpikeReport
from .passes.fake_precision import fake_precision as fake_precision
from .precision import precision_sensitivity as precision_sensitivity
from .precision import SensitivityReport as SensitivityReport
from .precision import SensitivityEntry as SensitivityEntry
from .precision import PrecisionChoice as PrecisionChoice
from .errors import FxdebugError as FxdebugError
from .errors import TraceFailure as TraceFailure
from .errors import SelectionError as SelectionError
from .errors import PassEquivalenceError as PassEquivalenceError
from .errors import StaleCaptureError as StaleCaptureError
from .errors import SavedRunError as SavedRunError
from .errors import GraphChangedError as GraphChangedError
from .errors import ReferenceMismatchError as ReferenceMismatchError
from .errors import FxdebugWarning as FxdebugWarning
from .errors import EagerFallbackWarning as EagerFallbackWarning
from .errors import FidelityWarning as FidelityWarning
from .errors import PerformanceWarning as PerformanceWarning
from .errors import FxdebugDeprecationWarning as FxdebugDeprecationWarning

__all__ = [
    'trace',
    'instrument',
    'records',
    'accumulate_stats',
    'set_step',
    'Records',
    'Record',
    'Stats',
    'PartialReport',
    'traced_parts',
    'part_inputs',
    'passes',
    'PassManager',
    'PassManagerResult',
    'PassReport',
    'print_tabular',
    'GraphDiff',
    'DiffRow',
    'diff',
    'report',
    'plots',
    'dump',
    'check_equivalence',
    'EquivalenceReport',
    'jacobian_norms',
    'JacobianNorms',
    'vjp',
    'testing',
    'find_nonfinite',
    'NonfiniteReport',
    'NonfiniteWatch',
    'WatchReport',
    'RankNonfiniteReport',
    'check_compiled',
    'CompiledReport',
    'backend',
    'InstrumentingBackend',
    'watch_nonfinite',
    'lint_inplace',
    'Hazard',
    'Hazards',
    'save_records',
    'load_records',
    'SavedRecords',
    'ShardedRecords',
    'RunComparison',
    'compare_runs',
    'compare_ranks',
    'RankReport',
    'monitor',
    'Monitor',
    'load_series',
    'Series',
    'DriftReport',
    'SpikeReport',
    'fake_precision',
    'precision_sensitivity',
    'SensitivityReport',
    'SensitivityEntry',
    'PrecisionChoice',
    'FxdebugError',
    'TraceFailure',
    'SelectionError',
    'PassEquivalenceError',
    'StaleCaptureError',
    'SavedRunError',
    'GraphChangedError',
    'ReferenceMismatchError',
    'FxdebugWarning',
    'EagerFallbackWarning',
    'FidelityWarning',
    'PerformanceWarning',
    'FxdebugDeprecationWarning',
]
