"""Calibration accuracy on held-out runs (issue 8): 12 variants of gem-h200 on the H200, calibrate on
half, predict the other half's step time and per-op-class time with the default and the calibrated
cost model.

Each variant is a real ``coplan.trainer.train`` run under ``torch.distributed.run`` (one process) with
a short profiled window at its end. Variants differ in batch size, history length distribution, model
width and depth, recompute, attention backend (Triton / the padded PyTorch reference at a small
batch) and MoE on/off. With two GPUs, two variants run at a time (one per GPU: ``CUDA_VISIBLE_DEVICES``
and distinct master ports); each pair is one calibration variant and one held-out variant, so a run
cut short by the time budget loses both halves evenly.

Each variant runs the planner's plan of its workload on ``h200-1gpu`` (``coplan plan --gpus 1`` with
every table pinned table-wise, ``--pin-table NAME=table_wise``: each table whole on the GPU); the
recompute variants then recompute every InterFormer layer, a layer choice no pin expresses
(:func:`coplan.planner.given.with_layers`, which re-prices the plan and says so in it). The lent GPU
machines have no OR-Tools: ``--plan-only --plans DIR`` makes the plans on any machine beforehand, and
``--plans DIR`` runs them.

The split is fixed (``VARIANTS``, ``split`` field) and covers every factor on both sides:

====  =========  ==============================================  ==========================
pair  fit (T)    held out (H)                                    factors varied in T | H
====  =========  ==============================================  ==========================
1     base       b32                                             batch: T2,T6 | H1
2     b32 h512   h512 d512                                       history: T2 | H2,H5
3     d512 L6    L6                                              width: T3 | H2,H4; depth: T3,T6 | H3
4     rc noMoE   rc d768                                         recompute: T4 | H4
5     ref b8     ref b8 h512                                     attention: T5 | H5
6     noMoE b32 L2  noMoE h1536                               MoE off: T4,T6 | H6
====  =========  ==============================================  ==========================

What is compared. *Measured step*: the run's p50 step time from CUDA events over the steps between
warm-up and the profiled window (``summary.json``). *Predicted step*: the pricer's step time for the
variant's plan (``coplan.calibration.step_price.predict_step_time``: what ``coplan plan`` would say), on
the measured length moments of those steps, (i) ``default``: the topology's default efficiencies;
(ii) ``calibrated``: the calibration fitted on the T half with ``host=True``: efficiencies fitted to
device time, and a host cost h per priced launch and a device-step factor f (device work no priced op
accounts for; since round 7) fitted to the T half's measured steps; the pricer prices the step at
max(f × device step, priced launches × h), host and device running concurrently (see
``coplan.calibration``). Three readings outside the cost model, for context: ``device_only``
(the device fit without the host cost), ``additive`` (device step + priced launches × h_add, h_add
fitted on the T half: the form used before the max form), ``device_factor`` (the device step times the T half's median
measured/device ratio) and ``phases`` (the sum over forward, backward and optimizer of max(device_p,
launches_p × h_ph), h_ph fitted on the T half: what the step would be if the host could not run ahead
across a phase boundary; the trainer has no sync there, so this is a reading, not the model). Per op class: the runs' traced device time per (op, phase) against the
roofline under the default and the fitted efficiencies, summed per class. The padded reference pads
each micro-batch to its longest history: its runs are priced at the longest lengths of the batches that
ran (``known_longest``: the data set regenerated here, deterministic, and used only when every step's
(n, ΣL, ΣL²) equals the run's ``seq_stats``), as the other runs are at their measured E[L], E[L²].
``step_error_calibrated_vs_mean`` is a reading against the mean step (the pricer prices an expected
step; the reference's step swings with its batch's longest length, so its mean is far above its p50).

Sequence lookups are priced at the bag layout each run used (``seq_chunk`` from its summary's options;
absent: 0, whole histories, all runs before the trainer's switch), and the calibrated step adds the
fitted per-sample host cost to the launches' host time (``coplan.calibration``). ``FRESH2`` is
a third held-out set, defined before any of its runs existed (``--variant-set fresh2``), reported as
its own split; ``FRESH3`` (``--variant-set fresh3``), a fourth, likewise.

The host side. Each run's profiled steps are also read on the host (``coplan.calibration.host_profile.host_profile``:
forward, backward and after-backward host time, launches issued in each, FSDP2's hooks, the optimizer,
TorchRec's ranges, and the median host duration of common ATen and launch calls, i.e. how fast that host
ran); ``host_speed_index`` is each run's host speed against the fit runs' mean. The readings
``speed_fit`` and ``speed_known`` are the host fit with that speed taken into account (see
:data:`STEP_KEYS`).

    python benchmarks/calibration_h200.py --plan-only --plans benchmarks/results/plans   # anywhere, first
    python benchmarks/calibration_h200.py --budget-s 420 --plans benchmarks/results/plans  # on the 2-GPU H200 host
    python benchmarks/calibration_h200.py --analyze runs/calib                 # re-run the analysis only
    python benchmarks/calibration_h200.py --device cpu --workload gem-tiny --steps 6 --warmup 2 \\
        --trace-steps 2 --budget-s 600 --runs-root /tmp/calib-smoke            # CPU smoke test
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import plan_command, plan_facts, planned, table_pins  # noqa: E402  (the scripts run by path)

from coplan.spec import RunDir  # noqa: E402

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Variant:
    """One trainer run: changes to the base workload and plan."""

    name: str
    split: str  # "fit" | "heldout" | "fresh" | "fresh2" | "fresh3" | "fit_db" | "fresh4" | "fresh5" | "fresh6" | "fresh7" | "fresh8" | "fresh9"
    batch: float = 1.0
    """Local batch as a fraction of the base's (reference attention: see ``ref_batch``)."""
    history_mean: float = 1.0
    """History length mean as a fraction of the base's."""
    history_sigma: float | None = None
    width: float = 1.0
    """Model dim as a fraction of the base's (heads of the base's head dim)."""
    depth: float = 1.0
    """InterFormer layers as a fraction of the base's."""
    recompute: bool = False
    """Activation checkpointing of every InterFormer layer."""
    attention: str = "triton"
    ref_batch: int | None = None
    """Absolute local batch (the reference backend pads to the longest history: small batches only)."""
    moe: bool = True
    notes: str = ""


VARIANTS: tuple[tuple[Variant, Variant], ...] = (
    (Variant("base", "fit"), Variant("b32", "heldout", batch=0.5)),
    (Variant("b32-h512", "fit", batch=0.5, history_mean=0.5, history_sigma=0.8),
     Variant("h512-d512", "heldout", history_mean=0.5, history_sigma=0.8, width=0.5)),
    (Variant("d512-L6", "fit", width=0.5, depth=1.5), Variant("L6", "heldout", depth=1.5)),
    (Variant("rc-nomoe", "fit", recompute=True, moe=False), Variant("rc-d768", "heldout", recompute=True, width=0.75)),
    (Variant("ref-b8", "fit", attention="reference", ref_batch=8),
     Variant("ref-b8-h512", "heldout", attention="reference", ref_batch=8, history_mean=0.5, history_sigma=0.8)),
    (Variant("nomoe-b32-L2", "fit", moe=False, batch=0.5, depth=0.5),
     Variant("nomoe-h1536", "heldout", moe=False, history_mean=1.5, history_sigma=0.7)),
)

FRESH: tuple[Variant, ...] = (
    Variant("b48-h768", "fresh", batch=0.75, history_mean=0.75, history_sigma=0.9),
    Variant("d896-L5", "fresh", width=0.875, depth=1.25),
    Variant("rc-L3-b48", "fresh", recompute=True, depth=0.75, batch=0.75),
    Variant("ref-b12-h768", "fresh", attention="reference", ref_batch=12, history_mean=0.75, history_sigma=0.9),
    Variant("nomoe-b48-h1280", "fresh", moe=False, batch=0.75, history_mean=1.25, history_sigma=0.8),
    Variant("h2048-b16", "fresh", batch=0.25, history_mean=2.0, history_sigma=0.6),
)
"""A second held-out set, defined after the first one's results were seen (and the model changed on
them): new values of the same factors (batch 48 and 16, history means 768/1,280/2,048 with σ 0.9/0.8/
0.6, width 896, depths 5 and 3, recompute with 3 layers, the reference at batch 12, MoE off), never
used to choose anything. It is predicted from the calibration fitted on the ``fit`` runs only and
reported apart (``fresh``)."""

FRESH2: tuple[Variant, ...] = (
    Variant("b40-h640", "fresh2", batch=0.625, history_mean=0.625, history_sigma=0.75),
    Variant("d640-L7", "fresh2", width=0.625, depth=1.75),
    Variant("d1152-b56", "fresh2", width=1.125, batch=0.875, history_sigma=0.85),
    Variant("rc-L2-h896", "fresh2", recompute=True, depth=0.5, history_mean=0.875, history_sigma=0.65),
    Variant("nomoe-b56-s05", "fresh2", moe=False, batch=0.875, history_sigma=0.5),
    Variant("ref-b10-h384", "fresh2", attention="reference", ref_batch=10, history_mean=0.375, history_sigma=0.55),
)
"""A third held-out set, **defined on 2026-11-29 before any run of it existed** (after rounds 2-3 had
seen every run of ``VARIANTS`` and ``FRESH``, and after the host-time and sequence-lookup pricing of
issue 8 were written): six variants with factor values no earlier variant used: local batch 40, 56
and the reference backend at 10; history means 640, 896 and 384 with σ 0.75, 0.65, 0.55 and σ 0.85 /
0.5 at the base mean; widths 640 and 1,152; depth 7; recompute on 2 layers; MoE off at batch 56. Runs of
the trainer with sequence bags of ``seq_chunk`` ids (its default, 32) test the lookup pricing at a bag
layout the fit runs (whole histories) never had. Predicted from the calibration fitted on the ``fit``
runs only and reported as its own split (``fresh2``); nothing may be chosen on its results."""

FRESH3: tuple[Variant, ...] = (
    Variant("b72-h1152", "fresh3", batch=1.125, history_mean=1.125, history_sigma=0.95),
    Variant("d1280-L1", "fresh3", width=1.25, depth=0.25),
    Variant("d384-L9", "fresh3", width=0.375, depth=2.25),
    Variant("rc-L8-b24", "fresh3", recompute=True, depth=2.0, batch=0.375),
    Variant("nomoe-b44-h256", "fresh3", moe=False, batch=0.6875, history_mean=0.25, history_sigma=0.45),
    Variant("ref-b14-s04", "fresh3", attention="reference", ref_batch=14, history_sigma=0.4),
)
"""A fourth held-out set, **defined on 2026-11-29 at about 20:30 UTC, before any run of it existed** (after
round 4 had seen every run of ``VARIANTS``, ``FRESH`` and ``FRESH2``, and after the host-speed reading of
the host fit was written on round 4's runs): six variants whose changed factors take values no earlier
variant used: local batch 72, 24 and 44, the reference backend at 14; history means 1,152 and 256 with σ
0.95 and 0.45, σ 0.4 at the base mean; widths 1,280 (one InterFormer layer) and 384 (nine layers);
recompute over eight layers; MoE off at batch 44. They span the host-bound extreme (d384-L9: many small
launches), the device-bound one (b72-h1152, d1280-L1) and a small batch over many launches (rc-L8-b24).
Predicted from the calibration fitted on the ``fit`` runs only and reported as its own split
(``fresh3``); nothing may be chosen on its results."""

# The device-bound round: the trainer's own operating point (Trainer v6: 256 samples per step, GPU idle
# ~1%), where a step is decided by the device, not by the host's speed (rounds 1-5 ran at 24-72 samples,
# host-bound, and missed the step goal on the host). Its own fit set (split "fit_db") and held-out set
# (split "fresh4"), both defined on 2026-11-29 at about 23:20 UTC, before any run of either existed.
DB_FIT: tuple[Variant, ...] = (
    Variant("B256", "fit_db", batch=4.0),
    Variant("B192-h768", "fit_db", batch=3.0, history_mean=0.75, history_sigma=0.9),
    Variant("B256-d768-L6", "fit_db", batch=4.0, width=0.75, depth=1.5),
    Variant("B256-rc-nomoe", "fit_db", batch=4.0, recompute=True, moe=False),
    Variant("ref-b12", "fit_db", attention="reference", ref_batch=12),
    Variant("B128-nomoe-L2", "fit_db", batch=2.0, moe=False, depth=0.5),
)
FRESH4: tuple[Variant, ...] = (
    Variant("B288-h1152", "fresh4", batch=4.5, history_mean=1.125, history_sigma=0.95),
    Variant("B224-d1152", "fresh4", batch=3.5, width=1.125),
    Variant("B256-d640-L7", "fresh4", batch=4.0, width=0.625, depth=1.75),
    Variant("B160-rc-L6", "fresh4", batch=2.5, recompute=True, depth=1.5),
    Variant("B320-nomoe-h640", "fresh4", batch=5.0, moe=False, history_mean=0.625, history_sigma=0.75),
    Variant("ref-b10-s06", "fresh4", attention="reference", ref_batch=10, history_sigma=0.6),
)
"""The device-bound held-out set: local batch 288, 224, 256, 160 and 320 (the fit set: 256, 192, 128), history
mean 1,152 (σ 0.95) and 640 (σ 0.75), widths 1,152 and 640, depth 7 and 6 with recompute, MoE off at 320, the
reference backend at 10 samples with σ 0.6. Predicted from the calibration fitted on ``DB_FIT`` only (the
analysis fits on ``fit_db`` runs whenever any are present) and reported as split ``fresh4``; nothing may be
chosen on its results. Run (one GPU each, ~5 min): ``--variant-set device-bound`` (fit and held-out variants
alternating)."""

# Round 7: a second device-bound held-out set, defined on 2026-11-30 at about 00:55 UTC, before any run of it
# existed, after round 6 (DB_FIT / FRESH4) had been run and analysed and before the cost model's step form was
# changed on what round 6 showed (a device step ~7% under the measured one on device-bound runs: device work the
# ops do not price). The calibration is fitted on DB_FIT runs of the same lease (re-run), FRESH5 predicted.
FRESH5: tuple[Variant, ...] = (
    Variant("B240-h896", "fresh5", batch=3.75, history_mean=0.875, history_sigma=0.85),
    Variant("B208-d896-L5", "fresh5", batch=3.25, width=0.875, depth=1.25),
    Variant("B272-d512-L8", "fresh5", batch=4.25, width=0.5, depth=2.0),
    Variant("B176-rc-h1280", "fresh5", batch=2.75, recompute=True, history_mean=1.25, history_sigma=0.8),
    Variant("B304-nomoe-d896", "fresh5", batch=4.75, moe=False, width=0.875),
    Variant("ref-b11-h896", "fresh5", attention="reference", ref_batch=11, history_mean=0.875, history_sigma=0.7),
)
"""The second device-bound held-out set (split ``fresh5``): local batch 240, 208, 272, 176 and 304 and the reference
at 11 (no earlier variant used these); history mean 896 (σ 0.85 and 0.7) and 1,280 (σ 0.8) with recompute; widths
896 and 512 at depths 5 and 8; MoE off at width 896. Fitted on ``DB_FIT`` (re-run in the same lease), nothing may
be chosen on its results. Run: ``--variant-set device-bound-2`` (DB_FIT and FRESH5 alternating)."""

# Round 8: defined on 2026-11-30 at about 04:40 UTC, before any run of it existed, after the reference's pad to
# a multiple of 16 and the host-cost fit over every run priced per measured step (segments between the host's
# syncs) were committed. The fit set is DB_FIT plus a second reference run (DB_FIT_REF2, split "fit_db"), so that
# the reference's host time, exposed at its syncs, is fitted on two runs (a host term needs two host-bound runs).
DB_FIT_REF2: tuple[Variant, ...] = (
    Variant("ref-b14-h640", "fit_db", attention="reference", ref_batch=14, history_mean=0.625, history_sigma=0.8),
)
FRESH6: tuple[Variant, ...] = (
    Variant("B232-h1088", "fresh6", batch=3.625, history_mean=1.0625, history_sigma=0.8),
    Variant("B160-d1408-L3", "fresh6", batch=2.5, width=1.375, depth=0.75),
    Variant("B248-d384-L9", "fresh6", batch=3.875, width=0.375, depth=2.25),
    Variant("B192-rc-h1152-L5", "fresh6", batch=3.0, recompute=True, history_mean=1.125, history_sigma=0.75, depth=1.25),
    Variant("B336-nomoe-h768", "fresh6", batch=5.25, moe=False, history_mean=0.75, history_sigma=0.85),
    Variant("ref-b13-h960", "fresh6", attention="reference", ref_batch=13, history_mean=0.9375, history_sigma=0.75),
)
"""The third device-bound held-out set (split ``fresh6``): local batch 232, 160, 248, 192 with recompute and 336
and the reference at 13 (no earlier variant used these); history mean 1,088 (σ 0.8), 1,152 (σ 0.75), 768 (σ 0.85)
and 960 (σ 0.75); widths 1,408 at depth 3 and 384 at depth 9; recompute at depth 5; MoE off at batch 336. Fitted
on DB_FIT + DB_FIT_REF2 (run in the same lease), nothing may be chosen on its results. Run:
``--variant-set device-bound-3``."""

# Round 9: defined on 2026-11-30 at about 03:35 UTC, before any run of it existed, after round 8 (FRESH6) had been
# run and analysed and the trainer's FFN activation moved from the ffn_up op range to norm_act (the trace charged
# the SiLU to the GEMM; the cost model prices it with the norms). Fitted on DB_FIT + DB_FIT_REF2 re-run in the
# same lease.
FRESH7: tuple[Variant, ...] = (
    Variant("B216-h832", "fresh7", batch=3.375, history_mean=0.8125, history_sigma=0.85),
    Variant("B144-d1536-L2", "fresh7", batch=2.25, width=1.5, depth=0.5),
    Variant("B264-d640-L6", "fresh7", batch=4.125, width=0.625, depth=1.5),
    Variant("B208-rc-L6", "fresh7", batch=3.25, recompute=True, depth=1.5),
    Variant("B288-nomoe-h1152-L5", "fresh7", batch=4.5, moe=False, history_mean=1.125, history_sigma=0.7, depth=1.25),
    Variant("ref-b15-h704", "fresh7", attention="reference", ref_batch=15, history_mean=0.6875, history_sigma=0.8),
)
"""The fourth device-bound held-out set (split ``fresh7``): local batch 216, 144, 264, 208 with recompute and 288
and the reference at 15 (no earlier variant used these); history mean 832 (σ 0.85), 1,152 (σ 0.7) and 704 (σ 0.8);
widths 1,536 at depth 2 and 640 at depth 6; recompute at depth 6; MoE off at depth 5. Fitted on DB_FIT +
DB_FIT_REF2 (run in the same lease), nothing may be chosen on its results. Run: ``--variant-set device-bound-4``."""

# Round 10: defined on 2026-11-30 at about 04:20 UTC, before any run of it existed, after round 9 (FRESH7) had been
# run and analysed and the reference's pricing changed on what rounds 8-9 showed (its bytes at a memory efficiency
# of its own, Calibration.unfused_memory_efficiency; its host's forward after each sync exposed, not overlapped).
FRESH8: tuple[Variant, ...] = (
    Variant("B224-h960", "fresh8", batch=3.5, history_mean=0.9375, history_sigma=0.8),
    Variant("B184-d1152-L3", "fresh8", batch=2.875, width=1.125, depth=0.75),
    Variant("B240-d512-L7", "fresh8", batch=3.75, width=0.5, depth=1.75),
    Variant("B200-rc-h896-L3", "fresh8", batch=3.125, recompute=True, history_mean=0.875, history_sigma=0.85, depth=0.75),
    Variant("B312-nomoe-L6", "fresh8", batch=4.875, moe=False, depth=1.5),
    Variant("ref-b11-s09", "fresh8", attention="reference", ref_batch=11, history_sigma=0.9),
)
"""The fifth device-bound held-out set (split ``fresh8``): local batch 224, 184, 240, 200 with recompute and 312
and the reference at 11 with σ 0.9; history mean 960 (σ 0.8) and 896 (σ 0.85); widths 1,152 at depth 3 and 512 at
depth 7; recompute at depth 3; MoE off at depth 6. Fitted on DB_FIT + DB_FIT_REF2 (run in the same lease), nothing
may be chosen on its results. Run: ``--variant-set device-bound-5``."""

# Round 11: defined on 2026-11-30 at about 04:10 UTC, before any run of it existed, after round 10 (FRESH8) had been
# run and analysed and the reference's pricing changed again (a device floor per extra ATen kernel,
# Calibration.unfused_kernel_s; a syncing run's host cost fitted on each of its steps, not its p50). Every run of
# the round reads 32 distinct batches (--data-batches 32: no batch repeats within the timed steps, so a step-time
# p50 does not jump between clusters of repeated batches, which moved the reference's p50 by up to 15%).
FRESH9: tuple[Variant, ...] = (
    Variant("B248-h1024s07", "fresh9", batch=3.875, history_sigma=0.7),
    Variant("B176-d1280-L3", "fresh9", batch=2.75, width=1.25, depth=0.75),
    Variant("B232-d640-L8", "fresh9", batch=3.625, width=0.625, depth=2.0),
    Variant("B216-rc-h768-L4", "fresh9", batch=3.375, recompute=True, history_mean=0.75, history_sigma=0.8),
    Variant("B280-nomoe-h1216", "fresh9", batch=4.375, moe=False, history_mean=1.1875, history_sigma=0.75),
    Variant("ref-b13-h832", "fresh9", attention="reference", ref_batch=13, history_mean=0.8125, history_sigma=0.85),
)
"""The sixth device-bound held-out set (split ``fresh9``): local batch 248, 176, 232, 216 with recompute and 280
and the reference at 13 with history mean 832 (σ 0.85); history σ 0.7 at the base mean, mean 768 (σ 0.8) and
1,216 (σ 0.75); widths 1,280 at depth 3 and 640 at depth 8; recompute at depth 4; MoE off. Fitted on DB_FIT +
DB_FIT_REF2 (run in the same lease), nothing may be chosen on its results. Run: ``--variant-set device-bound-6
--data-batches 32``."""

ALL_VARIANTS: dict[str, Variant] = ({v.name: v for pair in VARIANTS for v in pair} | {v.name: v for v in FRESH}
                                    | {v.name: v for v in FRESH2} | {v.name: v for v in FRESH3}
                                    | {v.name: v for v in DB_FIT} | {v.name: v for v in FRESH4}
                                    | {v.name: v for v in FRESH5} | {v.name: v for v in DB_FIT_REF2}
                                    | {v.name: v for v in FRESH6} | {v.name: v for v in FRESH7}
                                    | {v.name: v for v in FRESH8} | {v.name: v for v in FRESH9})


# ---------------------------------------------------------------------------------------------
# Building the variants
# ---------------------------------------------------------------------------------------------


def variant_workload(base, v: Variant, *, cpu: bool):
    """The base workload with ``v``'s changes, validated like any workload file."""
    from coplan.spec import Workload, parse_spec

    doc = base.model_dump(mode="json")
    doc["name"] = f"{base.name}-{v.name}"
    b = doc["batch"]
    lb = b.get("local_batch_size") or b.get("global_batch_size")
    if v.ref_batch is not None and not cpu:
        new_b = v.ref_batch
    elif v.ref_batch is not None:
        new_b = max(4, lb // 8)
    else:
        new_b = max(2, int(round(lb * v.batch)))
    doc["batch"] = {"local_batch_size": new_b}
    for s in doc["sequences"]:
        ln = s["length"]
        if "mean" in ln:
            ln["mean"] = max(1.0, ln["mean"] * v.history_mean)
            if v.history_sigma is not None and "sigma" in ln:
                ln["sigma"] = v.history_sigma
    blocks = []
    for blk in doc["blocks"]:
        t = blk["type"]
        if t == "moe" and not v.moe:
            continue
        if t in ("interformer", "kunlun", "moe") and v.width != 1.0:
            hd = blk.get("head_dim")
            if hd:
                heads = max(1, int(round(blk["model_dim"] * v.width / hd)))
                blk["num_heads"] = heads
                blk["model_dim"] = heads * hd
            else:
                blk["model_dim"] = max(8, int(round(blk["model_dim"] * v.width / 8)) * 8)
            if t == "moe":
                blk["expert_hidden_dim"] = max(8, int(round(blk["expert_hidden_dim"] * v.width / 8)) * 8)
        if t == "interformer" and v.depth != 1.0:
            blk["num_layers"] = max(1, int(round(blk["num_layers"] * v.depth)))
        if t == "heads" and v.width != 1.0:
            blk["input_dim"] = next(x["model_dim"] for x in blocks if x["type"] in ("interformer", "kunlun"))
        blocks.append(blk)
    # the trainer feeds MoE the interaction tokens: one width for kunlun and moe
    kun = [x["model_dim"] for x in blocks if x["type"] == "kunlun"]
    for blk in blocks:
        if blk["type"] == "moe" and kun:
            blk["model_dim"] = kun[0]
    # the tower input is the last sequence/interaction block's width
    widths = [x["model_dim"] for x in blocks if x["type"] in ("interformer", "kunlun", "moe")]
    for blk in blocks:
        if blk["type"] == "heads" and widths:
            blk["input_dim"] = widths[-1]
    doc["blocks"] = blocks
    doc.setdefault("kernels", {})["attention"] = v.attention
    return parse_spec(Workload, doc, f"variant {v.name}")


def variant_plan(w, topo, v: Variant, plans_dir: Path | None = None):
    """The variant's plan: ``coplan plan --gpus 1`` of its workload (attention backend included) with every
    table pinned table-wise (each whole on the GPU); a recompute variant then recomputes every
    InterFormer layer, a layer choice no pin expresses (:func:`coplan.planner.given.with_layers`)."""
    from coplan.planner.given import with_layers
    from coplan.spec.workload import InterFormerBlock

    plan = planned(f"calib-{w.name}", w, topo, 1, tables=table_pins(w), plans_dir=plans_dir, log=log)
    if v.recompute:
        rc = [f"{b.name}.{i}" for b in w.blocks if isinstance(b, InterFormerBlock) for i in range(b.num_layers)]
        plan = with_layers(plan, recompute=rc)
    return plan


def plan_only(args) -> int:
    """``--plan-only``: every selected variant's plan, made (or checked) and described; nothing runs."""
    from coplan.spec import load_topology, load_workload

    base, topo = load_workload(args.workload), load_topology(args.topology)
    failed = 0
    for v in (v for row in selected_rows(args) for v in row):
        try:
            w = variant_workload(base, v, cpu=args.device == "cpu")
            plan = variant_plan(w, topo, v, args.plans)
            log(f"{v.name}: {plan_command(w, 1, tables=table_pins(w))}"
                + (" + every InterFormer layer recomputed" if v.recompute else "") + f": {json.dumps(plan_facts(plan))}")
        except Exception as e:
            failed += 1
            log(f"{v.name}: no plan: {type(e).__name__}: {e}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    variant: Variant
    plan_path: Path
    data: Path
    run_dir: Path
    gpu: int
    port: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    log_path: Path | None = None
    log_file: object = None
    result: dict = field(default_factory=dict)


def _env(args, gpu: int) -> dict:
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", OMP_NUM_THREADS="4")
    if args.device == "cuda":
        # ``gpu`` indexes this process's visible devices (a parent may have narrowed them to one GPU)
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if gpu < len(visible) else str(gpu)
    else:
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def start(job: Job, args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
           "--master-addr=127.0.0.1", f"--master-port={job.port}", "-m", "coplan.trainer.train", str(job.plan_path),
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--runs-root", str(job.run_dir.parent), "--run-id", job.run_dir.name, "--data", str(job.data), "--no-progress",
           "--trace", f"{args.steps - args.trace_steps}:{args.steps}", "--checkpoint-every", "-1",
           "--log-every", str(args.steps),
           # eager layers: a compiled region drops the profiler's op ranges the calibration attributes by
           "--compile", "off"]
    if job.run_dir.exists():
        shutil.rmtree(job.run_dir)
    job.log_path = job.run_dir.parent / f"{job.run_dir.name}.log"
    job.log_file = fh = open(job.log_path, "w")
    # own session: a timed-out run is ended with its children (the torchrun agent and the worker)
    job.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(args, job.gpu), start_new_session=True)
    job.started = time.monotonic()
    log(f"start {job.variant.name} ({job.variant.split}) on {'GPU ' + str(job.gpu) if args.device == 'cuda' else 'cpu'}, port {job.port}")


def wait_pair(jobs: list[Job], deadline: float) -> None:
    while any(j.proc and j.proc.poll() is None for j in jobs):
        if time.monotonic() > deadline:
            for j in jobs:
                if j.proc and j.proc.poll() is None:
                    log(f"timeout: ending {j.variant.name} (pid {j.proc.pid})")
                    try:
                        os.killpg(j.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    j.proc.wait()
                    j.result["timed_out"] = True
            break
        time.sleep(0.5)
    for j in jobs:
        if j.log_file is not None:
            j.log_file.close()
        rc = j.proc.returncode if j.proc else None
        j.result.update(returncode=rc, wall_s=time.monotonic() - j.started, ok=(rc == 0 and RunDir(j.run_dir).summary_path.is_file()))
        if not j.result["ok"]:
            tail = j.log_path.read_text()[-4000:] if j.log_path and j.log_path.is_file() else ""
            j.result["log_tail"] = tail
        log(f"done {j.variant.name}: rc={rc} ok={j.result['ok']} wall {j.result['wall_s']:.1f}s")


def shrink_run(run_dir: Path) -> None:
    """Keep what the analysis reads (plan, metrics, summary, rank-0 trace gzipped); drop checkpoints."""
    rd = RunDir(run_dir)
    shutil.rmtree(rd.checkpoints_dir, ignore_errors=True)
    for p in rd.trace_paths():
        if p.suffix != ".json":
            continue
        if p == rd.trace_path(0):
            with open(p, "rb") as f, gzip.open(str(p) + ".gz", "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
        p.unlink()


def selected_rows(args) -> list[tuple[Variant, ...]]:
    """The variants this invocation runs, as rows run together (a pair of the main set; with
    ``--only`` or the fresh set, consecutive variants two by two on two GPUs, one by one on one)."""
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in ALL_VARIANTS]
        if unknown:
            raise SystemExit(f"--only: unknown variant(s) {unknown}; known: {sorted(ALL_VARIANTS)}")
        chosen = [ALL_VARIANTS[n] for n in names]
    elif args.variant_set == "fresh":
        chosen = list(FRESH)
    elif args.variant_set == "fresh2":
        chosen = list(FRESH2)
    elif args.variant_set == "fresh3":
        chosen = list(FRESH3)
    elif args.variant_set == "device-bound":
        chosen = [v for pair in zip(DB_FIT, FRESH4) for v in pair]
    elif args.variant_set == "device-bound-2":
        chosen = [v for pair in zip(DB_FIT, FRESH5) for v in pair]
    elif args.variant_set == "device-bound-3":
        chosen = [v for pair in zip(DB_FIT + DB_FIT_REF2, FRESH6 + (None,)) for v in pair if v is not None]
    elif args.variant_set == "device-bound-4":
        chosen = [v for pair in zip(DB_FIT + DB_FIT_REF2, FRESH7 + (None,)) for v in pair if v is not None]
    elif args.variant_set == "device-bound-5":
        chosen = [v for pair in zip(DB_FIT + DB_FIT_REF2, FRESH8 + (None,)) for v in pair if v is not None]
    elif args.variant_set == "device-bound-6":
        chosen = [v for pair in zip(DB_FIT + DB_FIT_REF2, FRESH9 + (None,)) for v in pair if v is not None]
    else:
        first = max(1, args.pair_from) - 1
        main = (VARIANTS[: args.pairs] if args.pairs else VARIANTS)[first:]
        if args.variant_set == "main":
            return list(main)
        chosen = [v for pair in main for v in pair] + list(FRESH) + list(FRESH2) + list(FRESH3)
    k = 2 if args.gpus >= 2 else 1
    return [tuple(chosen[i : i + k]) for i in range(0, len(chosen), k)]


def run_all(args) -> Path:
    from coplan.spec import dump_spec, load_topology, load_workload
    from coplan.trainer.data import data_sha256, generate_dataset

    base = load_workload(args.workload)
    topo = load_topology(args.topology)
    root = args.runs_root
    root.mkdir(parents=True, exist_ok=True)
    cpu = args.device == "cpu"
    pairs = selected_rows(args)
    manifest = {"workload": base.name, "topology": topo.name, "device": args.device, "steps": args.steps,
                "warmup": args.warmup, "trace_steps": args.trace_steps, "variants": []}
    # One GPU runs the pairs in several invocations (--pair-from) into one runs root: keep the
    # variants an earlier invocation recorded that this one does not run again.
    ours = {v.name for pair in pairs for v in pair}
    old = root / "manifest.json"
    if old.is_file():
        manifest["variants"] = [e for e in json.loads(old.read_text()).get("variants", []) if e.get("name") not in ours]
    # plans and datasets first: variants with the same inputs and batch share one dataset
    jobs: list[list[Job]] = []
    datasets: dict[tuple[str, int], Path] = {}
    port = args.port
    for pi, pair in enumerate(pairs):
        row = []
        for gi, v in enumerate(pair):
            try:
                w = variant_workload(base, v, cpu=cpu)
                plan = variant_plan(w, topo, v, args.plans)
                lb = w.batch.local_batch_size or w.batch.global_batch_size
                key = (data_sha256(w)[:10], int(lb))
                if key not in datasets:
                    d = root / "data" / f"{key[0]}-b{key[1]}"
                    if not (d / "dataset.json").is_file():
                        t = time.monotonic()
                        n = lb * args.data_batches
                        generate_dataset(w, d, n, seed=0, rows_per_file=n)
                        log(f"dataset {d.name}: {n} samples in {time.monotonic() - t:.1f}s")
                    datasets[key] = d
                (root / "plans").mkdir(exist_ok=True)
                pp = dump_spec(plan, root / "plans" / f"{v.name}.json")
            except Exception as e:  # a variant that does not build is recorded, the rest run
                manifest["variants"].append({"name": v.name, "split": v.split, "ok": False, "error": f"{type(e).__name__}: {e}"})
                log(f"variant {v.name} does not build: {e}")
                continue
            port += 1
            row.append(Job(v, pp, datasets[key], root / v.name, gpu=gi % max(1, args.gpus), port=port))
        jobs.append(row)

    reserve = args.analysis_reserve_s
    walls: list[float] = []
    for row in jobs:
        # two GPUs: the pair runs side by side; one GPU: its two runs one after the other
        groups = [row] if args.gpus >= 2 or len(row) <= 1 else [[j] for j in row]
        for group in groups:
            left = args.budget_s - reserve - (time.monotonic() - T0)
            # the first run compiles the Triton kernels (cold cache): later ones are judged by the later ones
            need = (max(walls[1:]) if len(walls) > 1 else walls[0]) * 1.05 if walls else args.min_run_s
            if left < need:
                for j in group:
                    j.result.update(ok=False, skipped=f"time budget: {left:.0f}s left, a run takes ~{need:.0f}s")
                    log(f"skip {j.variant.name}: {j.result['skipped']}")
                continue
            t = time.monotonic()
            for j in group:
                start(j, args)
            wait_pair(group, time.monotonic() + min(args.run_timeout_s, max(10.0, left)))
            walls.append(time.monotonic() - t)
        for j in row:
            if j.result.get("ok"):
                shrink_run(j.run_dir)
        _write_manifest(root, manifest, jobs)
    _write_manifest(root, manifest, jobs)
    return root


def _write_manifest(root: Path, manifest: dict, jobs: list[list["Job"]]) -> None:
    """After every pair: a run cut short from outside still leaves what finished analysable."""
    manifest = {**manifest, "variants": list(manifest["variants"])}
    for row in jobs:
        for j in row:
            manifest["variants"].append({"name": j.variant.name, "split": j.variant.split, "run_dir": j.run_dir.name,
                                         "variant": j.variant.__dict__, "gpu": j.gpu, **j.result})
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# Analysis (re-runnable from the run directories)
# ---------------------------------------------------------------------------------------------


STEP_KEYS = ("default", "calibrated", "calibrated_pooled", "device_only", "additive", "device_factor", "phases", "speed_fit",
             "speed_known")
"""Step-time predictions compared: the cost model with default efficiencies; with the calibration
(device fit, and the step priced at max(device step, priced launches x host cost h), what ``coplan plan
--calibration`` prices). Since round 8 these two are the median over the run's measured steps of the step
priced at each one's lengths (:func:`coplan.calibration.step_price.predict_median_step`), the p50's counterpart;
``calibrated_pooled`` is the calibrated price of the steps' pooled moments (rounds 1-7's reading: the mean
step's counterpart). Then readings outside the cost model, for context: the device fit alone,
device + launches x h_add (the additive form, h_add fitted on the fit half), and the device fit times a
step factor fitted on the fit half; ``speed_fit``: the host costs fitted with each fit run's host time
scaled by its host's speed (``coplan calibrate --host-speed``), priced at the fit runs' mean host speed;
``speed_known``: the same at the run's own host speed, read from its own trace (a diagnostic, not a
prediction)."""


def topo_dtype(plan) -> str:
    return plan.workload.precision.compute_dtype


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else float("nan")


def merged_manifest(root: Path, overlays: list[Path] | tuple[Path, ...] = ()) -> list[tuple[dict, Path]]:
    """``root``'s manifest entries, each with the root its run directory lies under; an entry of an
    overlay root (later ones win) replaces the entry of the same name (a re-measured variant) or is
    added (a new one). Only overlay entries whose run finished replace anything."""
    entries: dict[str, tuple[dict, Path]] = {}
    for i, r in enumerate([root, *overlays]):
        mf = r / "manifest.json"
        if not mf.is_file():
            raise FileNotFoundError(f"{mf}: no manifest (is {r} a runs root of this script?)")
        for v in json.loads(mf.read_text()).get("variants", []):
            if i == 0 or v.get("ok") or v["name"] not in entries:
                entries[v["name"]] = (v, r)
    return list(entries.values())


FRESH_SPLITS = ("fresh", "fresh2", "fresh3", "fresh4", "fresh5", "fresh6", "fresh7", "fresh8", "fresh9")
SPLITS = ("fit", "heldout", "fit_db", *FRESH_SPLITS)
"""``fit``: calibrated on; ``heldout``: the first held-out set (seen when the model was changed:
docs/benchmarks-log/calibration.md); ``fresh``: the second, defined afterwards (:data:`FRESH`), also seen
since; ``fresh2``: the
third (:data:`FRESH2`), defined before any of its runs existed; ``fresh3``: the fourth (:data:`FRESH3`),
likewise; ``fit_db`` / ``fresh4``: the device-bound round's fit and held-out sets (:data:`DB_FIT`,
:data:`FRESH4`), defined before any of their runs."""


def _plan_attention(run_dir: Path) -> str | None:
    try:
        return json.loads(RunDir(run_dir).plan_path.read_text())["kernels"]["attention"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def known_longest(run_dir: Path, plan, data_batches: int = 8) -> tuple[dict | None, str]:
    """Per step, per sequence, the longest length of the run's (one) micro-batch, read from its data set
    regenerated here (:func:`run_all` writes it deterministically: seed 0, ``local batch x data_batches``
    samples), and checked against the run's own ``seq_stats`` (n, ΣL, ΣL² of every step): a data set that
    does not reproduce them is not used. (None, why) when the run's batches cannot be known this way."""
    import tempfile

    import numpy as np

    from coplan.trainer.data import ParquetSource, feature_layout, generate_dataset

    w = plan.workload
    lb = w.batch.local_batch_size or w.batch.global_batch_size
    if plan.mesh.dense_shard * plan.mesh.dense_replicate != 1:
        return None, "more than one rank: the balancer's split would be needed"
    if (w.batch.micro_batches or 1) != 1:
        return None, "more than one micro-batch: the trainer's micro-batch split would be needed"
    metrics = RunDir(run_dir).metrics()
    with tempfile.TemporaryDirectory() as tmp:
        n = int(lb) * data_batches
        generate_dataset(w, Path(tmp), n, seed=0, rows_per_file=n, progress=False)
        src = ParquetSource(Path(tmp), feature_layout(w))
        out: dict[int, dict[str, list[int]]] = {}
        for m in metrics:
            if "step" not in m or not m.get("seq_stats"):
                continue
            t = src.rows(int(m["step"]) * int(lb), int(lb))
            row = {}
            for seq, st in m["seq_stats"].items():
                L = t.column(f"len_{seq}").to_numpy().astype(np.int64)
                if [float(len(L)), float(L.sum()), float((L * L).sum())] != [float(x) for x in st]:
                    return None, f"step {m['step']}: regenerated '{seq}' lengths differ from the run's seq_stats"
                row[seq] = [int(L.max()) if len(L) else 0]
            out[int(m["step"])] = row
    return out, "regenerated data set, every step's (n, ΣL, ΣL²) equal to the run's"


def analyze(root: Path, overlays: list[Path] | tuple[Path, ...] = ()) -> dict:
    import numpy as np

    from coplan.calibration.assemble import calibrate
    from coplan.calibration.host_fit import fit_host_launch_cost
    from coplan.calibration.device_fit import predict
    from coplan.calibration.step_price import predict_median_step, predict_step_time, step_launches
    from coplan.calibration.runs import run_samples, run_step_moments
    from coplan.costmodel.efficiency import resolve_efficiencies

    rows: dict[str, dict] = {}
    runs = {}
    for v, vroot in merged_manifest(root, overlays):
        name = v["name"]
        row = {k: v.get(k) for k in ("split", "ok", "wall_s", "returncode", "skipped", "error", "timed_out")}
        # the split is the script's, not the manifest's: a variant keeps its role whichever run measured it
        if name in ALL_VARIANTS:
            row["split"] = ALL_VARIANTS[name].split
        row["variant"] = v.get("variant")
        row["runs_root"] = str(vroot)
        rows[name] = row
        d = vroot / v.get("run_dir", name)
        rd = RunDir(d)
        if not v.get("ok") or not rd.summary_path.is_file():
            continue
        try:
            longest = None
            if _plan_attention(d) == "reference" and '"seq_max"' not in rd.metrics_path.read_text():
                # the padded reference pads each micro-batch to its longest: price it at the batches that ran
                try:
                    longest, row["padded_lengths"] = known_longest(d, rd.plan())
                except Exception as e:  # without them the run is priced at the length pmf's E[max]
                    row["padded_lengths"] = f"not known ({type(e).__name__}: {e})"
            rs = run_samples(d, longest=longest)
            s = rd.result()
            mom = rs.step_moments or rs.moments
            runs[name] = (d, rs)
            row.update(
                measured_step_s=s.step_time.p50_s if s.step_time else None,
                measured_step_mean_s=s.step_time.mean_s if s.step_time else None,
                measured_mfu=s.measured_mfu, device=s.device, versions=s.versions,
                traced_step_s=rs.window_s or None, traced_idle_s=rs.idle_s or None,
                traced_busy_s=(rs.window_s - rs.idle_s) if rs.window_s else None,
                trace_attributed_share=rs.attributed_share,
                unpriced_s_per_step=rs.unpriced_s, samples=len(rs.samples),
                moments=mom, peak_memory_gib=[m / 2**30 for m in s.peak_memory_bytes],
            )
            row["_moments"] = mom
        except Exception as e:  # one unreadable run does not sink the analysis
            row["analysis_error"] = f"{type(e).__name__}: {e}"
            runs.pop(name, None)
    # the device-bound round fits on its own fit set whenever one of its runs is present
    fit_split = "fit_db" if any(r["split"] == "fit_db" and n in runs for n, r in rows.items()) else "fit"
    fit_names = [n for n, r in rows.items() if r["split"] == fit_split and n in runs]
    held_names = [n for n, r in rows.items() if r["split"] == "heldout" and n in runs]
    # the fresh held-out sets, each reported apart under its split's name
    fresh_by_split = {sp: [n for n, r in rows.items() if r["split"] == sp and n in runs] for sp in FRESH_SPLITS}
    fresh_names_all = [n for sp in FRESH_SPLITS for n in fresh_by_split[sp]]
    out: dict = {"variants": rows, "fit_split": fit_split, "fit_runs": fit_names, "heldout_runs": held_names,
                 **{f"{sp}_runs": fresh_by_split[sp] for sp in FRESH_SPLITS},
                 "overlays": [str(o) for o in overlays]}
    if not fit_names:
        out["error"] = "no calibration run finished"
        return out
    cal, res, fit_rs = calibrate([runs[n][0] for n in fit_names], force=True, host=True,
                                 prepared=[runs[n][1] for n in fit_names])
    out["calibration"] = cal.model_dump(mode="json")
    hf = fit_host_launch_cost(fit_rs, res, per_sample=True, fit_device_factor=True)  # what calibrate(host=True) wrote
    out["host_fit"] = None if hf is None else {
        "host_s_per_launch": hf.h_s, "host_s_per_sample": hf.sample_s, "device_step_factor": hf.device_factor,
        "host_bound": hf.host_bound().tolist(), "local_batch": hf.batch, "runs": hf.runs, "measured_step_s": hf.measured_s, "device_step_s": hf.device_s,
        "launches_per_step_priced": hf.launches, "fit_median_abs_error": hf.median_abs_error, "fit_max_abs_error": hf.max_abs_error}
    topo = runs[fit_names[0]][1].plan.topology
    default = resolve_efficiencies(topo, default_gap=False)  # per-op defaults (the gap is a step-level term)
    # the pricer prices the reference attention at the compute dtype's default: so does the default here
    dflt_compute = dict(default.compute)
    for (c, dt), v in list(default.compute.items()):
        if c == "attention" and dt == topo_dtype(runs[fit_names[0]][1].plan):
            dflt_compute.setdefault(("attention", "fp32"), v)
    cal_launch = {**default.launch_s, **res.launch_s}
    for n in fit_names + held_names + fresh_names_all:  # per run and class: traced device time vs the fitted roofline
        smp = runs[n][1].samples
        mm = np.array([x.measured_s for x in smp])
        pp = predict(smp, res.compute, res.memory, cal_launch, res.lookup_id_s)
        rows[n]["op_class_calibrated"] = {c: _err(float(pp[[i for i, x in enumerate(smp) if x.op_class == c]].sum()),
                                                  float(mm[[i for i, x in enumerate(smp) if x.op_class == c]].sum()))
                                          for c in sorted({x.op_class for x in smp})}

    # step times: (i) default, (ii) calibrated = max(f x device fit step, priced launches x h) (what `coplan plan`
    # prices with the calibration), plus readings that are not in the cost model
    for n in fit_names + held_names + fresh_names_all:
        r = rows[n]
        plan = runs[n][1].plan
        try:
            ch = runs[n][1].seq_chunk
            r["seq_chunk"] = ch
            # (since round 8) each measured step priced at its own lengths, the median compared with the p50
            each = run_step_moments(runs[n][1])
            r["priced_steps"] = len(each)
            r["predicted_step_default_s"] = predict_median_step(plan, None, each, seq_chunk=ch)
            r["predicted_step_calibrated_s"] = predict_median_step(plan, cal, each, seq_chunk=ch)
            r["predicted_step_calibrated_pooled_s"] = predict_step_time(plan, cal, r["_moments"], seq_chunk=ch)
            dev, nl = step_launches(plan, res, r["_moments"], seq_chunk=ch)
            r["predicted_step_device_only_s"] = dev
            r["priced_launches_per_step"] = nl
            r["local_batch"] = plan.workload.batch.local(plan.mesh.world_size)
        except Exception as e:
            r["prediction_error"] = f"{type(e).__name__}: {e}"
    # additive reading (the previous calibrated form, kept for comparison only): step = device + launches x h_add,
    # h_add fitted on the fit half alone
    ha = fit_host_launch_cost(fit_rs, res, form="additive")
    h_add = ha.h_s if ha else 0.0
    out["host_additive_form"] = {"host_s_per_launch": h_add, "fitted_on": list(ha.runs) if ha else [],
                                 "meaning": "step = device step under the device fit + priced launches x h_add; not in the cost model"}
    for n in fit_names + held_names + fresh_names_all:
        r = rows[n]
        if r.get("predicted_step_device_only_s") is not None:
            r["predicted_step_additive_s"] = r["predicted_step_device_only_s"] + h_add * r["priced_launches_per_step"]
            # the pricer's max form against the same form rebuilt from its parts (the fit's slope): must agree
            if hf is not None and r.get("predicted_step_calibrated_s") is not None:
                lb = runs[n][1].plan.workload.batch.local(runs[n][1].plan.mesh.world_size)
                rebuilt = max(hf.device_factor * r["predicted_step_device_only_s"],
                              hf.h_s * r["priced_launches_per_step"] + hf.sample_s * lb)
                r["max_form_consistency"] = _err(r["predicted_step_calibrated_s"], rebuilt)
    # per-phase reading (not in the cost model): step = sum over forward, backward, optimizer of
    # max(device_p, launches_p x h_ph), h_ph fitted on the fit half like h; it would hold if the host could
    # not run ahead across a phase boundary (see the module docstring: the traces say it does)
    from _calibration_extras import fit_host_phase_form, step_phases

    h_ph, _ = fit_host_phase_form(fit_rs, res)
    out["host_phase_form"] = {"host_s_per_launch": h_ph, "meaning": "step = sum over phases (fwd, bwd, optimizer) of "
                              "max(device_p, priced launches_p x h_ph); not in the cost model"}
    for n in fit_names + held_names + fresh_names_all:
        r = rows[n]
        try:
            D, N = step_phases(runs[n][1].plan, res, r["_moments"], seq_chunk=runs[n][1].seq_chunk)
            r["device_s_by_phase"], r["priced_launches_by_phase"] = D.tolist(), N.tolist()
            r["predicted_step_phases_s"] = float(np.maximum(D, h_ph * N).sum())
        except Exception as e:
            r["phase_reading_error"] = f"{type(e).__name__}: {e}"
    # the host side of the profiled steps (coplan.calibration.host_profile.host_profile), and the host fit with each
    # fit run's host time scaled by its host's speed (fit_host_launch_cost(host_speed=True)): 'speed_fit'
    # prices every run at the fit runs' mean host speed (what `coplan calibrate --host-speed` writes);
    # 'speed_known' scales the host terms by the run's own host speed, read from its own trace: a diagnostic
    # of whether the host's speed is what the model misses, not a prediction
    from coplan.calibration.host_profile import host_speed_index

    hsp = fit_host_launch_cost(fit_rs, res, per_sample=True, host_speed=True, fit_device_factor=True)
    ref_us = hsp.host_reference_us if hsp else {}
    out["host_speed_fit"] = None if hsp is None else {
        "host_s_per_launch": hsp.h_s, "host_s_per_sample": hsp.sample_s, "device_step_factor": hsp.device_factor,
        "runs": hsp.runs, "speed": hsp.speed,
        "host_reference_us": ref_us, "fit_median_abs_error": hsp.median_abs_error, "fit_max_abs_error": hsp.max_abs_error,
        "meaning": "step = max(device, k x (priced launches x h + local samples x s)), k each fit run's host speed "
                   "against the fit runs' geometric mean; predicted at k = 1 ('speed_fit') and at the run's own k "
                   "('speed_known', a diagnostic: k is read from the run's own trace)"}
    for n in fit_names + held_names + fresh_names_all:
        r = rows[n]
        hp = runs[n][1].host
        if hp is not None:
            r["host_trace"] = {"step_ms": hp.step_s * 1e3, "fwd_ms": hp.fwd_s * 1e3, "bwd_ms": hp.bwd_s * 1e3,
                               "post_ms": hp.post_s * 1e3, "launches_fwd": hp.launches_fwd, "launches_bwd": hp.launches_bwd,
                               "launches_post": hp.launches_post, "fsdp_fwd_ms": hp.fsdp_fwd_s * 1e3,
                               "fsdp_bwd_ms": hp.fsdp_bwd_s * 1e3, "optimizer_ms": hp.optimizer_s * 1e3,
                               "sparse_ms": hp.sparse_s * 1e3, "op_median_us": hp.op_median_us}
            r["host_speed_index"] = host_speed_index(hp, ref_us) if ref_us else None
        if hsp is None or r.get("predicted_step_device_only_s") is None:
            continue
        plan = runs[n][1].plan
        cal_sp = cal.model_copy(update={"host_launch_s": min(1.0, hsp.h_s) or None,
                                        "host_sample_s": min(1.0, hsp.sample_s) or None, "host_op_median_us": ref_us,
                                        "device_step_factor": hsp.device_factor})
        try:
            r["predicted_step_speed_fit_s"] = predict_step_time(plan, cal_sp, r["_moments"], seq_chunk=runs[n][1].seq_chunk)
            k = r.get("host_speed_index")
            if k:
                cal_k = cal_sp.model_copy(update={"host_launch_s": min(1.0, k * hsp.h_s) or None,
                                                  "host_sample_s": min(1.0, k * hsp.sample_s) or None})
                r["predicted_step_speed_known_s"] = predict_step_time(plan, cal_k, r["_moments"], seq_chunk=runs[n][1].seq_chunk)
        except Exception as e:
            r["speed_reading_error"] = f"{type(e).__name__}: {e}"
    ratios = [rows[n]["measured_step_s"] / rows[n]["predicted_step_device_only_s"] for n in fit_names
              if rows[n].get("measured_step_s") and rows[n].get("predicted_step_device_only_s")]
    k = float(np.median(ratios)) if ratios else 1.0
    out["step_factor"] = {"value": k, "fitted_on": fit_names, "ratios": ratios,
                          "meaning": "median measured / device-fit step over the fit half; not in the cost model"}
    for n in fit_names + held_names + fresh_names_all:
        r = rows[n]
        if r.get("predicted_step_device_only_s") is not None:
            r["predicted_step_device_factor_s"] = k * r["predicted_step_device_only_s"]
        for key in STEP_KEYS:
            if r.get(f"predicted_step_{key}_s") is not None and r.get("measured_step_s"):
                r[f"step_error_{key}"] = _err(r[f"predicted_step_{key}_s"], r["measured_step_s"])
        # a reading: the pricer prices an expected step, and a run whose step cost swings with its batch
        # (the padded reference: its longest length) has a mean well above its p50
        if r.get("predicted_step_calibrated_s") is not None and r.get("measured_step_mean_s"):
            r["step_error_calibrated_vs_mean"] = _err(r["predicted_step_calibrated_s"], r["measured_step_mean_s"])

    def summary(names: list[str]) -> dict:
        o: dict = {}
        for key in STEP_KEYS:
            e = [abs(rows[n][f"step_error_{key}"]) for n in names if rows[n].get(f"step_error_{key}") is not None]
            o[f"step_{key}"] = {"median_abs": float(np.median(e)) if e else None, "max_abs": float(np.max(e)) if e else None, "n": len(e)}
        e = [abs(rows[n]["step_error_calibrated_vs_mean"]) for n in names if rows[n].get("step_error_calibrated_vs_mean") is not None]
        o["step_calibrated_vs_mean_reading"] = {"median_abs": float(np.median(e)) if e else None,
                                                "max_abs": float(np.max(e)) if e else None, "n": len(e)}
        # per op class: summed traced time vs summed roofline, over the runs' samples
        samples = [s for n in names for s in runs[n][1].samples]
        if samples:
            meas = np.array([s.measured_s for s in samples])
            for key, (ce, me, la) in (("default", (dflt_compute, default.memory, default.launch_s)),
                                      ("calibrated", (res.compute, res.memory, cal_launch))):
                pred = predict(samples, ce, me, la, None if key == "default" else res.lookup_id_s)
                per = {}
                for c in sorted({s.op_class for s in samples}):
                    idx = [i for i, s in enumerate(samples) if s.op_class == c]
                    per[c] = {"measured_ms": float(meas[idx].sum() * 1e3), "predicted_ms": float(pred[idx].sum() * 1e3),
                              "error": _err(float(pred[idx].sum()), float(meas[idx].sum()))}
                rel = np.abs(pred - meas) / meas
                o[f"op_class_{key}"] = per
                # attention apart per backend: the fused Triton kernels and the padded fp32 reference are
                # one op class but two very different implementations
                by_be: dict[str, dict] = {}
                for be in sorted({runs[n][1].plan.kernels.attention for n in names}):
                    idx = [i for i, s in enumerate(samples) if s.op_class == "attention"
                           and runs[s.run][1].plan.kernels.attention == be] if all(s.run in runs for s in samples) else []
                    if idx:
                        by_be[be] = {"measured_ms": float(meas[idx].sum() * 1e3), "predicted_ms": float(pred[idx].sum() * 1e3),
                                     "error": _err(float(pred[idx].sum()), float(meas[idx].sum()))}
                o[f"attention_by_backend_{key}"] = by_be
                o[f"per_op_{key}"] = {"median_abs": float(np.median(rel)), "p90_abs": float(np.quantile(rel, 0.9)), "n": len(samples)}
        return o

    out["fit"] = summary(fit_names)
    out["heldout"] = summary(held_names)
    for sp in FRESH_SPLITS:
        out[sp] = summary(fresh_by_split[sp]) if fresh_by_split[sp] else {}

    def goals(h: dict) -> dict:
        if not h:
            return {}
        cal_cls = h.get("op_class_calibrated", {})
        return {
            "median_step_error_le_5pct": {k2: (h[f"step_{k2}"]["median_abs"] is not None and h[f"step_{k2}"]["median_abs"] <= 0.05)
                                         for k2 in STEP_KEYS},
            "max_step_error_le_12pct": {k2: (h[f"step_{k2}"]["max_abs"] is not None and h[f"step_{k2}"]["max_abs"] <= 0.12)
                                        for k2 in STEP_KEYS},
            "per_class_error_le_10pct_calibrated": bool(cal_cls) and all(abs(v["error"]) <= 0.10 for v in cal_cls.values()),
        }

    out["goals"] = goals(out["heldout"])
    for sp in FRESH_SPLITS:
        out[f"goals_{sp}"] = goals(out[sp])
    for r in rows.values():
        r.pop("_moments", None)
    return out


def print_table(res: dict) -> None:
    rows = res.get("variants", {})
    cols = STEP_KEYS
    print(f"{'variant':<14}{'split':<8}{'meas ms':>9}" + "".join(f"{c[:10]:>11}" for c in cols) + "   (ms, error)")
    for n, r in rows.items():
        if r.get("measured_step_s") is None:
            print(f"{n:<14}{r.get('split', ''):<8} {r.get('skipped') or r.get('error') or r.get('analysis_error') or 'failed'}")
            continue
        cells = []
        for c in cols:
            v, e = r.get(f"predicted_step_{c}_s"), r.get(f"step_error_{c}")
            cells.append(f"{v * 1e3:6.1f} {100 * e:+4.0f}%" if v is not None and e is not None else f"{'-':>11}")
        print(f"{n:<14}{r['split']:<8}{r['measured_step_s'] * 1e3:9.1f}" + "".join(f"{x:>11}" for x in cells))
    for label, part, gkey in (("fit (in-sample)", "fit", "goals_fit"), ("held-out", "heldout", "goals"),
                              *((f"{sp} held-out", sp, f"goals_{sp}") for sp in FRESH_SPLITS)):
        h = res.get(part) or {}
        if not h:
            continue
        for key in STEP_KEYS:
            s = h.get(f"step_{key}")
            if s and s["median_abs"] is not None:
                print(f"{label} step error ({key}): median {s['median_abs']:.1%}, max {s['max_abs']:.1%} over {s['n']} runs")
        for key in ("default", "calibrated"):
            per = h.get(f"op_class_{key}", {})
            if per:
                print(f"{label} per-class device time ({key}): " + ", ".join(f"{c} {100 * v['error']:+.1f}%" for c, v in per.items()))
            be = h.get(f"attention_by_backend_{key}", {})
            if be:
                print(f"{label} attention per backend ({key}): " + ", ".join(f"{b} {100 * v['error']:+.1f}%" for b, v in be.items()))
        print(f"{label} goals:", json.dumps(res.get(gkey, {})))
    if res.get("host_fit"):
        print(f"host cost per priced launch: {res['host_fit']['host_s_per_launch'] * 1e6:.1f} us, "
              f"per local sample: {res['host_fit'].get('host_s_per_sample', 0.0) * 1e6:.1f} us")
    if (res.get("calibration") or {}).get("lookup_id_latency_s") is not None:
        print(f"sequence lookup: {res['calibration']['lookup_id_latency_s'] * 1e9:.0f} ns per serial id")
    hs = res.get("host_speed_fit")
    if hs:
        print(f"host fit with each fit run's host speed: {hs['host_s_per_launch'] * 1e6:.1f} us per priced launch, "
              f"{hs['host_s_per_sample'] * 1e6:.1f} us per local sample")
    print(f"{'variant':<14}{'split':<8}{'meas':>7}{'trace':>7}{'fwd':>6}{'bwd':>6}{'post':>6}{'fsdp':>6}"
          f"{'L fwd':>7}{'L bwd':>7}{'priced':>7}{'B':>4}{'speed':>7}   (host side of the profiled steps, ms)")
    for n, r in rows.items():
        ht = r.get("host_trace")
        if not ht or r.get("measured_step_s") is None:
            continue
        k = r.get("host_speed_index")
        print(f"{n:<14}{r['split']:<8}{r['measured_step_s'] * 1e3:7.1f}{ht['step_ms']:7.1f}{ht['fwd_ms']:6.1f}{ht['bwd_ms']:6.1f}"
              f"{ht['post_ms']:6.1f}{ht['fsdp_fwd_ms'] + ht['fsdp_bwd_ms']:6.1f}{ht['launches_fwd']:7.0f}{ht['launches_bwd']:7.0f}"
              f"{r.get('priced_launches_per_step') or 0:7.0f}{r.get('local_batch') or 0:4.0f}{k if k else float('nan'):7.2f}")
    if res.get("host_phase_form"):
        print(f"per-phase reading: host cost per priced launch {res['host_phase_form']['host_s_per_launch'] * 1e6:.1f} us")
    if res.get("error"):
        print("error:", res["error"])


def _provenance(args) -> dict:
    info: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except Exception as e:
        info["torch_error"] = str(e)
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    commit = os.environ.get("COPLAN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                    cwd=Path(__file__).resolve().parent).stdout.strip() or None
        except Exception:
            commit = None
    info["git_commit"] = commit or "unknown (set COPLAN_COMMIT)"
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gem-h200")
    p.add_argument("--topology", default="h200-1gpu")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", type=int, default=2, help="variants run at a time, one per GPU (1: one at a time)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trace-steps", type=int, default=2, help="the last steps, run under the profiler")
    p.add_argument("--data-batches", type=int, default=8, help="distinct batches generated per dataset (steps cycle)")
    p.add_argument("--pairs", type=int, default=0, help="run only the first N pairs (0: all 6)")
    p.add_argument("--pair-from", type=int, default=1,
                   help="start at this pair (1-based); earlier pairs already in --runs-root's manifest are kept")
    p.add_argument("--runs-root", type=Path, default=Path("runs/calib"))
    p.add_argument("--port", type=int, default=29610, help="master ports start above this")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the whole invocation")
    p.add_argument("--run-timeout-s", type=float, default=150.0, help="a pair still running after this is ended")
    p.add_argument("--min-run-s", type=float, default=45.0, help="assumed length of the first pair (budget check)")
    p.add_argument("--analysis-reserve-s", type=float, default=75.0, help="budget kept for the analysis")
    p.add_argument("--variant-set", choices=["main", "fresh", "fresh2", "fresh3", "device-bound", "device-bound-2", "device-bound-3", "device-bound-4", "device-bound-5", "device-bound-6", "all"], default="main",
                   help="main: the 12 variants (6 fit, 6 held out); fresh: the second held-out set; fresh2: the third "
                        "(defined before any of its runs); fresh3: the fourth (likewise); device-bound: the 12 variants at "
                        "the trainer's operating point (6 fit_db, 6 fresh4, alternating); device-bound-2: 6 fit_db, 6 fresh5; "
                        "all: every set but the device-bound ones")
    p.add_argument("--only", default="", metavar="NAMES",
                   help="run only these variants (comma-separated names, any set), e.g. ref-b8,ref-b8-h512")
    p.add_argument("--analyze", type=Path, default=None, metavar="DIR", help="only analyse the runs under DIR (its manifest.json)")
    p.add_argument("--overlay", type=Path, action="append", default=[], metavar="DIR",
                   help="with --analyze: runs roots whose finished variants replace (or add to) DIR's of the same name; repeatable")
    p.add_argument("--keep", type=Path, default=None, help="copy the compact run directories here (e.g. $OUT/runs)")
    p.add_argument("--plans", type=Path, default=None, metavar="DIR",
                   help="run the plans in DIR made beforehand (plan-calib-<variant workload>.json); a missing one is planned "
                        "here (OR-Tools) and written there")
    p.add_argument("--plan-only", action="store_true", help="make (or check) the selected variants' plans, print them, and stop")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/calibration_h200.json"))
    args = p.parse_args(argv)
    if args.plan_only:
        return plan_only(args)

    if args.analyze is None and args.steps - args.trace_steps <= args.warmup:
        p.error("--steps must leave measured steps between --warmup and the traced window")
    root = args.analyze
    if root is None and args.device == "cuda":
        try:
            import torch

            n = torch.cuda.device_count()
            if 0 < n < args.gpus:
                log(f"only {n} GPU(s) visible: running {n} variant(s) at a time")
                args.gpus = n
        except Exception as e:
            log(f"could not count GPUs ({e}); assuming --gpus {args.gpus}")
    if root is None:
        if args.overlay:
            p.error("--overlay goes with --analyze")
        names = [v.name for row in selected_rows(args) for v in row]
        log(f"running {len(names)} variants of {args.workload} ({', '.join(names)}), budget {args.budget_s:.0f}s")
        root = run_all(args)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for item in root.iterdir():
                if item.name in ("data", "plans"):
                    continue
                dst = args.keep / item.name
                if item.is_dir():
                    shutil.copytree(item, dst, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, dst)
    log(f"analysing {root}")
    try:
        res = analyze(root, args.overlay)
    except Exception as e:
        import traceback

        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    out = {
        "benchmark": "calibration accuracy on held-out runs (issue 8)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/calibration_h200.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": _provenance(args),
        "runs_root": str(root),
        "split": {n: v.split for n, v in ALL_VARIANTS.items()},
        "wall_s": time.monotonic() - T0,
        **res,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print_table(res)
    log(f"wrote {args.out}")
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
