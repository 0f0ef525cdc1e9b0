"""Jagged balance: the per-rank cost of one global batch of jagged samples, split in order ('none')
and by the plan's balancing policy.

The lengths are drawn from the workload's length distribution (seeded), each sample is priced with
the cost model's per-sample cost (:func:`coplan.costmodel.compute.seq_cost`: forward + backward
seconds as a polynomial in the primary sequence's length), and the batch is split with the very
balancer the trainer runs (:func:`coplan.costmodel.jagged.balance`). The step waits for the slowest
rank, so the gap between the top of the bars (or curve) and the mean is time every other rank idles.
With thousands of ranks, per-rank bars would be unreadable: ranks are then sorted by cost and the
sorted profile is drawn at a few hundred quantiles, always keeping the slowest and fastest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from coplan.costmodel.compute import seq_cost
from coplan.costmodel.jagged import balance, bin_loads
from coplan.reports.layout import base_layout, best_time_unit, fmt_pct, fmt_s
from coplan.reports.palette import SERIES_COLOURS
from coplan.spec import Plan
from coplan.spec.workload import sample_lengths

MAX_BARS = 128
"""Most ranks drawn as one bar each."""

PROFILE_POINTS = 400
"""Points of the sorted profile drawn for larger worlds."""


@dataclass(frozen=True, slots=True)
class BalanceSample:
    """Per-rank loads of one sampled global batch under two policies."""

    sequence: str
    policy: str
    loads_none: np.ndarray
    """Seconds per rank, split in order."""
    loads_policy: np.ndarray
    """Seconds per rank, split by ``policy``."""
    samples: int
    seed: int
    expected_imbalance: float
    """The cost model's expected max/mean under the plan's policy (what the prediction used)."""

    @property
    def ratio_none(self) -> float:
        m = self.loads_none.mean()
        return float(self.loads_none.max() / m) if m > 0 else 1.0

    @property
    def ratio_policy(self) -> float:
        m = self.loads_policy.mean()
        return float(self.loads_policy.max() / m) if m > 0 else 1.0


def sample_balance(plan: Plan, context, *, seed: int = 0) -> BalanceSample | None:
    """Draw one global batch and split it both ways; None when the workload has no jagged sequence."""
    seq = context.primary_sequence
    if seq is None:
        return None
    dist = plan.workload.sequence(seq).length
    n = context.global_batch
    ranks = plan.world_size
    lengths = sample_lengths(dist, n, seed)
    cost = seq_cost(context, plan.kernels)(lengths)
    M = context.micro_batches
    policy = plan.balancing.policy
    loads = {}
    for p in ("none", policy):
        bins = balance(cost, ranks, p, num_micro_batches=M)
        # bins are rank-major (rank = bin // M): a rank's step load is its micro-batches' sum
        loads[p] = bin_loads(cost, bins // M, ranks)
    return BalanceSample(seq, policy, loads["none"], loads[policy], n, seed, plan.balancing.expected_imbalance)


def _profile(loads: np.ndarray, points: int) -> tuple[np.ndarray, np.ndarray]:
    """(x = fraction of ranks, y = load) of the descending sorted loads at ``points`` quantiles."""
    s = np.sort(loads)[::-1]
    idx = np.unique(np.linspace(0, s.size - 1, min(points, s.size)).round().astype(int))
    return idx / max(1, s.size - 1) * 100.0, s[idx]


def jagged_balance(plan: Plan, context, *, seed: int = 0) -> go.Figure | None:
    """Per-rank cost before and after balancing (None when there is nothing jagged to balance)."""
    bs = sample_balance(plan, context, seed=seed)
    if bs is None:
        return None
    R = plan.world_size
    unit, scale = best_time_unit(max(bs.loads_none.max(), bs.loads_policy.max()))
    fig = go.Figure()
    series = (("none (split in order)", bs.loads_none, SERIES_COLOURS["unbalanced"], bs.ratio_none),
              (f"{bs.policy} (the plan's policy)", bs.loads_policy, SERIES_COLOURS["balanced"], bs.ratio_policy))
    if bs.policy == "none":
        series = series[:1]
    mean = float(bs.loads_none.mean())
    if R <= MAX_BARS:
        x = np.arange(R)
        for name, loads, colour, ratio in series:
            fig.add_trace(go.Bar(
                x=x, y=loads / scale, name=f"{name}: max/mean {ratio:.3f}", marker_color=colour,
                customdata=[fmt_s(v) for v in loads],
                hovertemplate=f"rank %{{x}}<br>{name}: %{{customdata}} of jagged compute per step<extra></extra>",
            ))
        fig.update_layout(barmode="group", bargap=0.15)
        fig.update_xaxes(title_text="rank")
        title_extra = ""
    else:
        for name, loads, colour, ratio in series:
            px, py = _profile(loads, PROFILE_POINTS)
            fig.add_trace(go.Scatter(
                x=px, y=py / scale, mode="lines", name=f"{name}: max/mean {ratio:.4f}", line={"color": colour, "width": 2},
                customdata=[fmt_s(v) for v in py],
                hovertemplate=f"{name}<br>%{{x:.2f}}% of ranks are at least this slow: %{{customdata}}<extra></extra>",
            ))
        fig.update_xaxes(title_text=f"% of the {R:,} ranks, slowest first", ticksuffix="%")
        title_extra = " (ranks sorted by cost)"
    fig.add_hline(y=mean / scale, line={"color": "#555", "dash": "dot", "width": 1},
                  annotation_text=f"mean {fmt_s(mean)}", annotation_position="bottom right")
    fig.update_yaxes(title_text=f"jagged compute / step ({unit})", rangemode="tozero")
    sub = (f"one global batch of {bs.samples:,} '{bs.sequence}' lengths drawn from the workload (seed {bs.seed}), each sample priced by the cost model; "
           f"slowest rank {fmt_pct(bs.ratio_none - 1, 1)} over the mean unbalanced, {fmt_pct(bs.ratio_policy - 1, 2)} with {bs.policy}; "
           f"the plan priced {fmt_pct(bs.expected_imbalance - 1, 2)}")
    if title_extra:
        sub += f"; ranks sorted by cost, {PROFILE_POINTS} quantiles drawn"
    return base_layout(fig, "Jagged balance: per-rank cost before and after balancing" + title_extra, subtitle=sub, height=440)


__all__ = ["BalanceSample", "jagged_balance", "sample_balance"]
