"""The cost model's roofline terms of a plan's ops at unit efficiencies: what each measured (op, phase)
is compared with. Built from the same context the planner prices with, so that the fit and the
planner cannot disagree on the form.

Each (op, phase) of the plan on one rank gives ``F / peak`` (seconds at compute efficiency 1),
``(B + B_fixed) / hbm_bw`` (seconds at memory efficiency 1) and its kernel launches, per micro-batch,
at the length moments the run measured (:func:`apply_moments`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from coplan.costmodel.compute import op_arrays
from coplan.costmodel.context import Options, build_context
from coplan.costmodel.decomposed import (FSDP_COPY_LAUNCHES, OPTIMIZER_LAUNCHES, dense_fixed_costs, seq_lookup_floor_s,
                                         table_option_costs)
from coplan.costmodel.memory import fsdp_copy_bytes
from coplan.costmodel.efficiency import UNFUSED_CLASS
from coplan.costmodel.flops import REFERENCE_MATMUL_DTYPE
from coplan.costmodel.pricer import assignment_of, collections_held, default_assignment, emb_group_launches, embedding_loads
from coplan.spec import Calibration, OpClassCalibration, Plan

CLASSES: tuple[str, ...] = ("gemm", "attention", "embedding", "elementwise")
"""The compute op classes a calibration fits."""

REFERENCE_ATTENTION_DTYPE = REFERENCE_MATMUL_DTYPE
"""The PyTorch reference attention pads and computes its scores in fp32 with TF32 matmuls
(:func:`coplan.costmodel.flops.padded_reference_attention`): its efficiency is fitted under this key,
apart from the fused kernels' (one class, two very different implementations), and the pricer reads it
under the same key."""

PADDED_SUFFIX = "@max"
"""Key suffix, in a moments dict, of (E[M], E[M²]) of M, each micro-batch's longest length: what the
padded reference attention pads to. From ``seq_max`` lines of metrics.jsonl (``{"<sequence>": [longest per
micro-batch]}``) or given to :func:`run_samples`; the pricer uses the length pmf's expectation without it.
A small data set repeats a few batches, whose longest lengths can sit far from that expectation (on
the H200's reference runs the profiled batches' E[M²] was up to ~1.9x it), and the padded reference's
quadratic terms scale with E[M²]: comparing such a run with the expectation misprices it by construction."""


def apply_moments(ctx, moments: dict[str, tuple[float, float]] | None) -> None:
    """Price ``ctx`` at measured moments: (E[L], E[L²]) per sequence, and per ``<seq>@max`` the padded
    reference's (E[M], E[M²]) (see :data:`PADDED_SUFFIX`)."""
    for seq, m in (moments or {}).items():
        if seq.endswith(PADDED_SUFFIX):
            ctx.padded_moments[seq[: -len(PADDED_SUFFIX)]] = (float(m[0]), float(m[1]))
        elif seq in ctx.moments:
            ctx.moments[seq] = m
    ctx.cache.clear()

def unit_calibration(device: str) -> Calibration:
    """Efficiencies of 1 and no launch cost: the context then yields the raw roofline terms."""
    ones = {dt: 1.0 for dt in ("bf16", "fp16", "fp8", "tf32", "fp32")}
    return Calibration(
        device=device,
        op_classes={c: OpClassCalibration(compute_efficiency=ones, memory_efficiency=1.0, launch_overhead_s=0.0) for c in CLASSES},
        lookup_id_latency_s=0.0, unfused_memory_efficiency=1.0, unfused_kernel_s=0.0,
    )

@dataclass(frozen=True, slots=True)
class UnitTerm:
    """The roofline terms of one (op, phase) at unit efficiencies, per micro-batch of one rank."""

    name: str
    phase: str
    op_class: str
    dtype: str
    flop_s: float
    mem_s: float
    launches: float
    micro_batches: int
    members: tuple[str, ...] = ()
    """For the merged embedding sample ('sparse'): the op names whose measured time it sums."""
    serial_mem_s: float = 0.0
    """See :attr:`coplan.calibration.runs.Sample.serial_mem_s`."""
    mem_class: str = ""
    """See :attr:`coplan.calibration.runs.Sample.mem_class`."""
    extra_kernels: float = 0.0
    """See :attr:`coplan.calibration.runs.Sample.extra_kernels`."""
    lookup_groups: tuple[tuple[float, float], ...] = ()
    """See :attr:`coplan.calibration.runs.Sample.lookup_groups`."""


def context_options(seq_chunk: int | None) -> Options:
    """The cost model's options for a run's bag layout (None: the cost model's default)."""
    return Options() if seq_chunk is None else Options(seq_chunk=int(seq_chunk))


def unit_terms(plan: Plan, moments: dict[str, tuple[float, float]] | None = None, *, rank: int = 0,
               seq_chunk: int | None = None) -> list[UnitTerm]:
    """Per (op, phase) of ``plan`` on ``rank``: F/peak, B/hbm_bw and kernel launches, from the same
    context the planner prices with (unit efficiencies) and, when given, measured length moments.

    Embedding lookups are one sample per phase (``sparse``), priced by the pricer's per-rank lookup
    time at full HBM bandwidth: the trace cannot split one fused TBE kernel among tables.
    """
    ctx = build_context(plan.workload, plan.topology, plan.mesh, unit_calibration(plan.topology.gpu.name),
                        options=context_options(seq_chunk), force_calibration=True)
    apply_moments(ctx, moments)
    fp8 = frozenset(lp.name for lp in plan.layers if lp.precision == "fp8")
    arr = op_arrays(ctx, plan.kernels, fp8)
    mb = ctx.micro_batches
    out: list[UnitTerm] = []
    for k, i in enumerate(ctx.dense_idx):
        o = ctx.ops[int(i)]
        dt = "fp8" if (o.layer in fp8 and o.op_class == "gemm") else o.dtype
        if plan.kernels.attention == "reference" and o.op_class == "attention" and o.sequence:
            # priced as the padded reference runs (context.op_arrays): fitted under its own key
            dt = REFERENCE_ATTENTION_DTYPE
        mc = UNFUSED_CLASS if arr.unfused[k] else ""  # (a padded head dim's copies are serial, its kernel fused)
        out.append(UnitTerm(o.name, "fwd", o.op_class, dt, float(arr.fwd_flop_s[k]),
                            float(arr.fwd_mem_s[k] + arr.fwd_fixed_mem_s[k]), float(arr.fwd_launches[k]), mb,
                            serial_mem_s=float(arr.fwd_serial_s[k]), mem_class=mc, extra_kernels=float(arr.fwd_extra_kernels[k])))
        out.append(UnitTerm(o.name, "bwd", o.op_class, dt, float(arr.bwd_flop_s[k]),
                            float(arr.bwd_mem_s[k] + arr.bwd_fixed_mem_s[k]), float(arr.bwd_launches[k]), mb,
                            serial_mem_s=float(arr.bwd_serial_s[k]), mem_class=mc, extra_kernels=float(arr.bwd_extra_kernels[k])))
    sparse = tuple(o.name for o in ctx.ops if o.layer == "sparse")
    if ctx.tables.num and sparse:
        a = assignment_of(ctx, plan.tables) if plan.tables else default_assignment(ctx)
        loads = embedding_loads(ctx, a)
        r = rank % ctx.mesh.sparse_shard
        groups = _lookup_groups(ctx) if ctx.mesh.sparse_shard == 1 else ()
        # the launches the pricer charges the rank's lookups per step (sparse_aggregates: each kernel group's per micro-batch)
        fused = plan.kernels.embedding == "fused"
        nk = float(collections_held(ctx, a)[r]) if fused else float(loads["shards"][r])
        launches = dict(zip(("fwd", "bwd"), emb_group_launches(fused)))
        for phase, key in (("fwd", "fwd_s"), ("bwd", "bwd_s")):
            g = groups if phase == "fwd" else ()
            rest = max(0.0, float(loads[key][r]) - sum(x[0] for x in g))
            out.append(UnitTerm("sparse", phase, "embedding", "fp32", 0.0, rest, launches[phase] * nk * mb, 1, sparse,
                                lookup_groups=g))
    # the dense optimizer, once per step, as the pricer prices it (memory-bound elementwise, with the
    # trainer's gradient norm), and FSDP2's copies per micro-batch (the trace's "fsdp.hooks")
    opt = dense_fixed_costs(ctx).optimizer_step_s  # unit efficiencies: bytes / HBM bandwidth exactly
    if opt > 0:
        out.append(UnitTerm("optimizer.step", "optimizer", "elementwise", "fp32", 0.0, float(opt), OPTIMIZER_LAUNCHES, 1))
    cf, cbk = fsdp_copy_bytes(ctx)
    bw = ctx.topology.gpu.hbm_bw_bytes_per_s
    for phase, nbytes, nl in (("fwd", cf, FSDP_COPY_LAUNCHES[0]), ("bwd", cbk, FSDP_COPY_LAUNCHES[1])):
        if nbytes > 0:
            out.append(UnitTerm("fsdp.hooks", phase, "elementwise", "fp32", 0.0, float(nbytes / bw), nl, mb))
    return out


def _lookup_groups(ctx) -> tuple[tuple[float, float], ...]:
    """Per sequence-lookup kernel (tables of one sequence and one dim) on a one-rank sparse group: (its
    forward bytes / HBM bandwidth, its serial ids per step), from a context at unit efficiencies (its
    lookups priced at their bytes alone); the floor at one second per id gives the serial ids."""
    ta = ctx.tables
    if not ta.num or not ta.is_seq.any():
        return ()
    mem = table_option_costs(ctx, "table_wise").fwd_s
    eff = ctx.eff
    ctx.eff = replace(eff, lookup_id_s=1.0)
    try:
        ids = seq_lookup_floor_s(ctx, ctx.local_batch / ctx.micro_batches)
    finally:
        ctx.eff = eff
    out = []
    for key in sorted({(sq, float(d)) for sq, d, s in zip(ta.sequence, ta.dim, ta.is_seq) if s}):
        idx = np.array([i for i in range(ta.num) if ta.is_seq[i] and ta.sequence[i] == key[0] and float(ta.dim[i]) == key[1]])
        out.append((float(mem[idx].sum()), float(ids[idx].sum())))
    return tuple(out)


__all__ = ["CLASSES", "PADDED_SUFFIX", "REFERENCE_ATTENTION_DTYPE", "UnitTerm", "apply_moments", "context_options",
           "unit_calibration", "unit_terms"]
