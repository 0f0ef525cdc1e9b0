"""Calibration: read runs and their Kineto traces, attribute device time to the cost model's ops, and
fit the cost model's efficiencies to them (``coplan calibrate``).

Depends on ``coplan.spec`` and ``coplan.costmodel``; nothing below the CLI imports it. Its modules,
in the order data flows through them:

- :mod:`.kineto` reads a trace file; :mod:`.attribution` attributes its work to the cost model's op
  names and classes; :mod:`.host_profile` reads the host side of its profiled steps.
- :mod:`.terms` gives the cost model's unit-efficiency roofline terms of a plan's ops; :mod:`.runs`
  pairs them with a run directory's measured ops (:class:`coplan.spec.RunDir`) as samples, once
  :mod:`.run_inputs` has checked the run's files (a corrupt one refused, a missing optional one noted).
- :mod:`.device_fit` fits each op class's efficiencies to the samples; :mod:`.step_price` prices a
  run's step under a calibration; :mod:`.host_fit` fits the host costs to the measured steps.
- :mod:`.assemble` turns the fits into a Calibration; :mod:`.collective_fit` fits a tier's
  collectives to a measured sweep; :mod:`.cli` is the ``coplan calibrate`` verb.
- For the report (the ``coplan report`` verb hands them in): :mod:`.points` prices a calibration's
  samples with and without it; :func:`.attribution.trace_class_times` sums a run's traces per op class.
"""

from coplan.calibration.assemble import calibrate
from coplan.calibration.attribution import (MeasuredOp, TraceAttribution, attribute, attribute_file, classify_kernel,
                                            trace_class_times)
from coplan.calibration.collective_fit import (CollectiveFit, CollectiveFitError, Sweep, apply_to_topology, fit_sweep,
                                               load_sweep, merge_into_calibration)
from coplan.calibration.device_fit import FitResult, fit, predict
from coplan.calibration.host_fit import HostFit, fit_host_launch_cost
from coplan.calibration.host_profile import HostProfile, host_profile, host_speed_index
from coplan.calibration.kineto import TraceError, load_trace
from coplan.calibration.points import calibration_points
from coplan.calibration.runs import CalibrationError, RunSamples, Sample, measured_moments, run_samples
from coplan.calibration.step_price import predict_median_step, predict_step_time

__all__ = [
    "CalibrationError", "CollectiveFit", "CollectiveFitError", "FitResult", "HostFit", "HostProfile", "MeasuredOp",
    "RunSamples", "Sample", "Sweep", "TraceAttribution", "TraceError", "apply_to_topology", "attribute", "attribute_file",
    "calibrate", "calibration_points", "classify_kernel", "fit", "fit_host_launch_cost", "fit_sweep", "host_profile", "host_speed_index",
    "load_sweep", "load_trace", "measured_moments", "merge_into_calibration", "predict", "predict_median_step",
    "predict_step_time", "run_samples", "trace_class_times",
]
