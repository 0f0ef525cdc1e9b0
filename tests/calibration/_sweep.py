"""Synthetic collective sweeps: times from the cost model itself, with log-normal noise, for checking
that the sweep fit recovers what it should."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from coplan.calibration.collective_fit import FIT_KINDS, Sweep, SweepPoint, predict_time
from coplan.spec.topology import Topology


def synthesize_sweep(topology: Topology, world_size: int, sizes: Sequence[float], *, noise: float = 0.0, seed: int = 0,
                     kinds: Sequence[str] = FIT_KINDS, dtype: str = "bf16") -> Sweep:
    """A sweep whose times are the cost model's on ``topology``, times log-normal noise of ``noise``."""
    rng = np.random.default_rng(seed)
    pts = []
    for k in kinds:
        t = predict_time(topology, k, np.asarray(sizes, dtype=float), world_size)
        t = t * np.exp(rng.normal(0.0, noise, size=len(sizes))) if noise else t
        pts += [SweepPoint(k, dtype, float(s), float(x)) for s, x in zip(sizes, t)]
    return Sweep(world_size, tuple(pts), topology.gpu.name, f"synthetic:{topology.name}")
