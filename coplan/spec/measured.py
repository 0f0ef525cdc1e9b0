"""What calibration measures of runs, as typed values the report draws: the device time a run's traces
spend per op class, and every sample of a calibration's source runs with its measured and predicted
times. Calibration computes them; the report verb hands them to the figures, so that the figures read
values and never the code that reads traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceClassTimes:
    """Device seconds per optimizer step by op class and collective (``comm:<kind>``), per traced rank."""

    measured: dict[str, list[float]]
    """Class → seconds per step, one per rank in ``ranks_read``."""
    unattributed: list[float]
    """Per rank: trace time no op claimed, per step."""
    ranks_read: tuple[int, ...]
    on_device: bool
    """False for CPU traces, where top-level CPU ops stand in for kernels."""


@dataclass(frozen=True, slots=True)
class CalibrationPoints:
    """Samples of a calibration's source runs with their measured and predicted seconds (per micro-batch)."""

    names: list[str]
    """'<run>: <op> (<phase>)'."""
    op_class: list[str]
    measured: np.ndarray
    before: np.ndarray
    """Predicted with the cost model's default efficiencies."""
    after: np.ndarray
    """Predicted with the calibration."""
    runs: list[str]
    skipped: list[str]
    """Source runs that could not be read, with the reason."""
    held_out: bool = False
    """The samples come from a run the calibration was not fitted on (none of its source runs was readable)."""

    def class_error(self, which: str) -> dict[str, float]:
        """|Σ predicted − Σ measured| / Σ measured per class (the calibration's own definition)."""
        pred = self.after if which == "after" else self.before
        out = {}
        for c in sorted(set(self.op_class)):
            idx = [i for i, k in enumerate(self.op_class) if k == c]
            m = float(self.measured[idx].sum())
            out[c] = abs(float(pred[idx].sum()) - m) / m if m > 0 else 0.0
        return out

    def median_error(self, which: str) -> float:
        pred = self.after if which == "after" else self.before
        return float(np.median(np.abs(pred - self.measured) / self.measured)) if self.measured.size else 0.0


__all__ = ["CalibrationPoints", "TraceClassTimes"]
