"""The FP8 numerics guard: per layer, an amax history and overflow counts, and a fallback to the compute
dtype for a layer whose FP8 numerics fail.

Every ``every`` steps (a *check step*, and the first step of the run) each :class:`~coplan.kernels.fp8.Float8Linear`
records, without syncing the host, its input's largest magnitude, the non-finite values of its output and of
its output's gradient, the gradient's largest magnitude, and the relative error of its FP8 output against the
same product in the compute dtype on its first rows (:data:`coplan.kernels.fp8.GUARD_ROWS`). After the check
step's backward the guard reads them back (one host sync), adds them to the layer's history, and trips a layer:

- on any non-finite value in its output or output gradient (an overflow: FP8 has no infinity, so a scale
  that overflowed or an input that did shows here),
- on a relative error above ``tol`` (the block-wise and row-wise recipes measure 2-5% on normally
  distributed operands; a layer well above that has outliers its scale blocks do not absorb),
- on an input amax more than ``spike`` times the median of its history (after ``min_history`` checks).

A tripped layer runs in the compute dtype from the next step on (its parameters are the same: only the
GEMMs change) and stays so for the run; the trip is printed on rank 0 and listed in the run's summary.
With several ranks, each check's figures are reduced to their maximum over the ranks first, so every rank
trips the same layers at the same step.

A run restarted from a checkpoint starts with every planned layer in FP8 again and re-checks at its
first step.

A fused FP8 FFN (the ``blockwise-fused`` recipe's :class:`~coplan.trainer.model.layers.FusedFp8FFN`: a
layer's ``norm2`` and FFN as one op) is watched as one unit with the same hooks and figures (its error is
the FFN output's, two FP8 GEMMs in series, against the compute dtype's) and falls back as a unit: its
layer then runs ``norm2`` and the FFN unfused in the compute dtype.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from coplan.kernels.fp8 import Float8Linear
from coplan.trainer.model.layers import FusedFp8FFN

FIELDS = ("x_amax", "out_nonfinite", "rel_error", "grad_amax", "grad_nonfinite")
"""What each checked call records (``Float8Linear._record``, ``FusedFp8FFN._record``), in the order they are reduced."""


@dataclass
class Fp8Trip:
    """One layer's fallback."""

    step: int
    module: str
    reason: str

    def describe(self) -> str:
        return f"{self.module} at step {self.step} ({self.reason})"


@dataclass
class LayerHistory:
    """One FP8 linear layer's checks."""

    amax: deque = field(default_factory=lambda: deque(maxlen=64))
    errors: deque = field(default_factory=lambda: deque(maxlen=64))
    overflows: int = 0
    """Non-finite values seen in its outputs and output gradients over all checks."""
    checks: int = 0


FUSED_SUFFIX = ".norm2+ffn"
"""A fused FFN's name in the guard: its layer's module path and this."""


def watched(model: nn.Module) -> dict[str, Float8Linear | FusedFp8FFN]:
    """The guard's units by name: every :class:`Float8Linear` (its module path) and every layer's fused FFN
    (the layer's path + :data:`FUSED_SUFFIX`), in module order."""
    out: dict[str, Float8Linear | FusedFp8FFN] = {}
    for n, m in model.named_modules():
        if isinstance(m, Float8Linear):
            out[n] = m
        fused = m.__dict__.get("fused_ffn")  # (an instance attribute: no nn.Module lookup per module)
        if isinstance(fused, FusedFp8FFN):
            out[n + FUSED_SUFFIX] = fused
    return out


def _device(m: Float8Linear | FusedFp8FFN) -> torch.device:
    return m.device if isinstance(m, FusedFp8FFN) else m.weight.device


class Fp8Guard:
    """Watches the model's :class:`Float8Linear` modules and fused FP8 FFNs (see the module docstring)."""

    def __init__(self, model: nn.Module, *, every: int = 50, tol: float = 0.15, spike: float = 256.0,
                 min_history: int = 4, world: int = 1) -> None:
        if every < 0 or not tol > 0 or not spike > 1:
            raise ValueError(f"Fp8Guard: every >= 0, tol > 0 and spike > 1 (got {every}, {tol}, {spike})")
        self.modules: dict[str, Float8Linear | FusedFp8FFN] = watched(model)
        self.every, self.tol, self.spike, self.min_history, self.world = every, tol, spike, min_history, world
        self.history = {n: LayerHistory() for n in self.modules}
        self.trips: list[Fp8Trip] = []
        self.checking = False
        self.first: int | None = None

    @property
    def active(self) -> bool:
        return bool(self.modules) and self.every > 0

    def begin_step(self, step: int) -> None:
        """Before the step's first forward: turn the modules' recording on for a check step."""
        if not self.active:
            return
        if self.first is None:
            self.first = step
        self.checking = step == self.first or step % self.every == 0
        for m in self.modules.values():
            m.check = self.checking and m.fp8_enabled
            m.stats.clear()

    def end_step(self, step: int) -> list[Fp8Trip]:
        """After the step's backward: read a check step's figures back, and trip the layers that fail."""
        if not (self.active and self.checking):
            return []
        names = [n for n, m in self.modules.items() if m.check]
        rows = []
        for n in names:
            m = self.modules[n]
            dev = _device(m)
            cell = []
            for f in FIELDS:
                vals = [s[f].float() for s in m.stats if f in s]
                cell.append(torch.stack(vals).amax() if vals else torch.full((), float("nan"), device=dev))
            rows.append(torch.stack([c.to(dev) for c in cell]))
        for m in self.modules.values():
            m.check = False
            m.stats.clear()
        self.checking = False
        if not rows:
            return []
        table = torch.stack(rows)
        if self.world > 1 and dist.is_initialized():
            # NaN (a figure a call did not record) must not win the max: -1 stands for it while reducing
            table = torch.nan_to_num(table, nan=-1.0)
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
            table = torch.where(table < 0, torch.full_like(table, float("nan")), table)
        values = table.cpu().tolist()
        new: list[Fp8Trip] = []
        for n, (x_amax, out_bad, err, g_amax, g_bad) in zip(names, values):
            h = self.history[n]
            h.checks += 1
            bad = sum(v for v in (out_bad, g_bad) if not math.isnan(v))
            h.overflows += int(bad)
            reason = None
            if bad > 0:
                reason = f"{int(bad)} non-finite value(s) in its output or output gradient"
            elif not math.isnan(err) and err > self.tol:
                reason = f"FP8 output {err:.1%} off the compute dtype's (tolerance {self.tol:.0%})"
            elif (not math.isnan(x_amax) and len(h.amax) >= self.min_history
                  and x_amax > self.spike * max(statistics.median(h.amax), 1e-30)):
                reason = f"input amax {x_amax:.3g}, {x_amax / statistics.median(h.amax):.0f}x its median of {len(h.amax)} checks"
            if not math.isnan(x_amax):
                h.amax.append(x_amax)
            if not math.isnan(err):
                h.errors.append(err)
            if reason is not None:
                self.modules[n].fp8_enabled = False
                new.append(Fp8Trip(step, n, reason))
        self.trips += new
        return new

    def fallen_back(self) -> list[str]:
        return [n for n, m in self.modules.items() if not m.fp8_enabled]

    def note(self) -> str:
        """For the run's summary."""
        if not self.modules:
            return ""
        fused = sum(isinstance(m, FusedFp8FFN) for m in self.modules.values())
        what = f"{len(self.modules) - fused} FP8 linear layer(s)"
        if fused:
            what += f" and {fused} fused FP8 FFN(s) ({', '.join(m.name for m in self.modules.values() if isinstance(m, FusedFp8FFN))})"
        if not self.active:
            return f"FP8 guard off ({what} unchecked)"
        checks = max((h.checks for h in self.history.values()), default=0)
        errs = [e for h in self.history.values() for e in h.errors]
        s = (f"FP8 guard: {what} checked {checks} time(s) (every {self.every} steps), "
             f"FP8 error median {statistics.median(errs):.1%} max {max(errs):.1%}" if errs else
             f"FP8 guard: {what}, {checks} check(s)")
        overflows = sum(h.overflows for h in self.history.values())
        s += f"; {overflows} non-finite value(s)"
        if self.trips:
            s += "; fell back to the compute dtype: " + ", ".join(t.describe() for t in self.trips)
        else:
            s += "; no layer fell back"
        return s


__all__ = ["FIELDS", "FUSED_SUFFIX", "Fp8Guard", "Fp8Trip", "LayerHistory", "watched"]
