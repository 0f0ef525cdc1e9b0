"""Specs (pydantic v2, frozen, no unknown keys, units in field names): Topology, Workload, Plan,
Calibration and RunResult, and their loaders; and the typed measurements of runs that calibration
hands to reports (:mod:`.measured`). Knows nothing of the other parts."""

from coplan.spec.base import COLLECTIVES, OP_CLASSES, SCHEMA_VERSION, Spec
from coplan.spec.calibration import Calibration, FitError, OpClassCalibration
from coplan.spec.hashing import spec_sha256
from coplan.spec.loader import (
    SPEC_KINDS,
    dump_spec,
    list_presets,
    load_any,
    load_calibration,
    load_plan,
    load_run_result,
    load_spec,
    load_topology,
    load_workload,
    parse_spec,
    write_text_atomic,
)
from coplan.spec.plan import (
    Alternative,
    BalancingPlan,
    CommPrediction,
    LayerPlan,
    MeshAxis,
    MeshPlan,
    OpPrediction,
    Plan,
    Prediction,
    SolverReport,
    TableShard,
)
from coplan.spec.measured import CalibrationPoints, TraceClassTimes
from coplan.spec.run import LoaderThroughput, RunOptions, RunResult, Startup, StepTimeStats
from coplan.spec.run_dir import RunDir, RunDirError
from coplan.spec.topology import GpuSpec, Reliability, Tier, Topology
from coplan.spec.workload import Workload

__all__ = [
    "COLLECTIVES", "OP_CLASSES", "SCHEMA_VERSION", "SPEC_KINDS", "Alternative", "BalancingPlan", "Calibration", "CalibrationPoints",
    "CommPrediction", "FitError", "GpuSpec", "LayerPlan", "MeshAxis", "MeshPlan", "OpClassCalibration", "OpPrediction", "Plan",
    "Prediction", "Reliability", "RunDir", "RunDirError", "LoaderThroughput", "RunOptions", "RunResult", "Startup", "SolverReport", "Spec", "StepTimeStats", "TableShard", "Tier",
    "Topology", "TraceClassTimes", "Workload", "dump_spec", "list_presets", "load_any", "load_calibration", "load_plan",
    "load_run_result", "load_spec", "load_topology", "load_workload", "parse_spec", "write_text_atomic", "spec_sha256",
]
