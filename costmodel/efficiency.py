"""Efficiencies: the fraction of datasheet peak each kind of op reaches, resolved once per
(topology, calibration) into plain floats the pricers read.

Order of precedence, per figure: a :class:`~coplan.spec.Calibration` fitted on this device, then
what the topology file says it measured (``measured_flops_per_s``, ``measured_hbm_bw_bytes_per_s``,
``collective_efficiency``), then the defaults below. Every default names its source.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from coplan.spec.calibration import Calibration
from coplan.spec.topology import Topology

# ---------------------------------------------------------------------------------------------
# Defaults and their sources
# ---------------------------------------------------------------------------------------------

DEFAULT_GEMM_EFFICIENCY: dict[str, float] = {
    "bf16": 806.0 / 989.0,   # coplan brief: 806 TFLOP/s measured bf16 matmul on one H200 (datasheet 989 dense)
    "fp16": 806.0 / 989.0,   # same tensor-core path as bf16
    "fp8": 1309.0 / 1979.0,  # coplan brief: 1,309 TFLOP/s torch._scaled_mm on the same H200 (datasheet 1,979)
    "tf32": 0.75,            # assumption: tf32 GEMMs run ~ like bf16 ones relative to their (half) peak, a little lower
    "fp32": 0.85,            # assumption: SIMT fp32 GEMM (cuBLAS sgemm) reaches ~85% of the fp32 CUDA-core peak
}
"""Large-GEMM fraction of the dense peak, used when neither a calibration nor the topology's
``measured_flops_per_s`` gives one. Small GEMMs fall to the memory roof or the launch overhead."""

DEFAULT_ATTENTION_EFFICIENCY: dict[str, float] = {
    "bf16": 0.225, "fp16": 0.225, "fp8": 0.40, "tf32": 0.40, "fp32": 0.50,
}
"""Attention forward+backward as a fraction of the dense peak, when no calibration gives one.

bf16/fp16: what coplan's own jagged Triton kernels (the attention coplan's trainer runs) reach, measured by
the kernel benchmark ``benchmarks/attention.py`` on one H200 (``benchmarks/results/attention_h200.json``,
2026-12-04, commit 070319d): device-bound forward+backward under CUDA graphs, in the cost model's FLOPs
(``coplan.costmodel.flops.attention_flops``), softmax and GDPA-SiLU at the kernels issue's two shapes (8 heads
of 128 over ~1k-token histories: 239 and 257 TFLOP/s; 4 heads of 64 over ~250 tokens: 108 and 121); their
geometric mean is 168 TFLOP/s, 0.17 of the H200's 989. In the tiles the kernels compute
(:func:`coplan.costmodel.compute.triton_tile_factor`, which the pricer charges the Triton kernels since
2026-12-07: 1.14x the pairs at shape (a), 1.55x at (b)) it is 223 TFLOP/s, 0.225
(``tests/costmodel/test_default_efficiency.py`` recomputes it from that file). The fraction is the default on every GPU without a calibration (a stated
default: the plan says it is uncalibrated). Until 2026-12-07 the default was 0.5, the low end of
FlashAttention-2/3's dense kernels (Shah et al. 2024 §4.1: 540-740 TFLOP/s bf16 forward on H100), about
three times what the jagged kernels reach at these shapes. A calibration's attention efficiency and
per-head-dim scales replace it.

fp8, tf32, fp32: assumptions (coplan's fused kernels run bf16/fp16; the padded reference's fp32/TF32
matmuls are priced by these)."""

UNFUSED_CLASS = "unfused"
"""The key, in ``Efficiencies.memory`` and ``Efficiencies.launch_s``, of an op's separate memory-bound
kernels (its ``*_serial_bytes``: the padded reference's passes, and the copies that pad a head dim the
Triton kernels do not take, :func:`coplan.costmodel.flops.triton_head_padding`) and of an unfused op's kernels (a
calibration's ``unfused_memory_efficiency`` and ``unfused_kernel_s``; an extra kernel's device floor is in
``coplan.costmodel.compute.op_arrays``). Its memory efficiency prices every byte an unfused op moves: the
padded reference's batched fp32 matmuls write and read whole [H, P, P] score blocks and its separate kernels pass over them, streams of GBs that no other class's
kernels are like, so they get an efficiency of their own, fitted on the reference's samples. Tied to
another class, the reference was mispriced by that class's kernels: at the GEMM class's (0.22 on the
H200, set by the model's small GEMMs) its attention was 41% over its traced time on ``ref-b12``
(calibration round 7, in-sample); at the elementwise class's it moved with the model's LayerNorm and
SiLU kernels (0.60 in round 8, 0.53 in round 9, once the FFN's SiLU was attributed to ``norm_act``: the
reference's attention went from 0% to +10-14% over, in-sample); at the attention class's, shared with the
fused kernels, it was +6-10% over while the fused kernels were 5-9% under (rounds 8-9, in-sample)."""

DEFAULT_MEMORY_EFFICIENCY: dict[str, float] = {
    "gemm": 0.85, "attention": 0.85, "elementwise": 0.85,
    "embedding": 3.2e12 / 4.8e12,
    UNFUSED_CLASS: 0.85,
}
"""Fraction of datasheet HBM bandwidth for bandwidth-bound kernels when the topology gives no
measured copy rate. Embedding: TorchRec's fused TBE reached 3.2 TB/s on an H200 in the coplan brief's
measurement (datasheet 4.8 TB/s). Others: assumption, ~ the 4.24/4.8 = 0.88 device copy the brief
measured, less a little for non-streaming access."""

TBE_OVER_COPY = (3.2e12 / 4.8e12) / (4.24e12 / 4.8e12)
"""TBE bandwidth relative to a plain device copy on the same H200 (3.2 vs 4.24 TB/s, coplan brief):
applied to a topology's measured copy rate when no embedding calibration exists."""

DEFAULT_LAUNCH_OVERHEAD_S: dict[str, float] = {
    "gemm": 3e-6, "attention": 4e-6, "elementwise": 2e-6, "embedding": 5e-6,
    UNFUSED_CLASS: 2e-6,
}
"""GPU time per priced launch beyond its roofline (its kernel's launch latency, tail, prologue): a few
microseconds per kernel on Hopper with the CPU running ahead (assumption; NVIDIA Nsight traces of eager
PyTorch show 2-5 µs per kernel). The embedding figure includes the TBE's index bucketing. The device's idle
time between the trainer's kernels, about four per priced launch, is priced apart, uncalibrated, by
:data:`DEFAULT_DEVICE_GAP_S`."""

HOST_KERNELS_PER_PRICED_LAUNCH = 4.1
"""Kernels the trainer's host really issues per launch the pricer charges (``h``, the calibrated
``host_launch_s``, is per priced launch): measured on H200 traces of the five Triton fit
runs (``traces.host_profile``: forward + backward + post launches per profiled step over the pricer's
priced launches; base 4.20, b32-h512 4.14, d512-L6 4.06, rc-nomoe 3.78, nomoe-b32-L2 4.30; mean 4.10),
no reference run and no step time used. The host time of these runs grows with their real launches at
about the same rate per launch as the padded reference's (its forward's extra 668 launches took
47 ms of host, 71 µs each, against 70 µs per launch over base's forward), so an op priced by its
real kernels costs ``kernels / 4.1`` priced launches on the host."""


DEVICE_IDLE_PER_KERNEL_S = 1.65e-6
"""Device idle time per kernel (or memcpy / memset) while the host runs ahead of the device: measured by
``benchmarks/device_gap.py`` (``benchmarks/results/device_gap.json``) over the trainer benchmark's two
profiled gem-h200 steps on one H200 (256 samples a step, eager and ``--compile layers``, 2026-11-29, commit
6fe23fc; the device busy 99% of the steps' windows): 2.37 and 2.12 ms idle over 1,302 and 1,174 kernels
a step, 1.68 and 1.62 µs each. A count and a sum over two traces, no step time fitted; the idle between
dependent kernels that the launch queue cannot hide."""

DEFAULT_DEVICE_GAP_S = HOST_KERNELS_PER_PRICED_LAUNCH * DEVICE_IDLE_PER_KERNEL_S
"""Device time between kernels per priced launch, uncalibrated: the measured idle per kernel
(:data:`DEVICE_IDLE_PER_KERNEL_S`) times the kernels the trainer issues per launch the pricer charges
(:data:`HOST_KERNELS_PER_PRICED_LAUNCH`), 6.8 µs. The same term, in the same unit, as a calibration's
``device_gap_s`` (the H100's fitted 17.3 µs, where the small fresh draws' host also holds the device
back); a calibration that fits the device's unpriced work (``device_gap_s`` or ``device_step_factor``)
or its op classes replaces it. Before 2026-12-07 an uncalibrated plan priced no gap: only
:data:`DEFAULT_LAUNCH_OVERHEAD_S` per priced launch, a figure per kernel (its tail and prologue)."""

DEFAULT_LOOKUP_ID_LATENCY_S = 0.45e-6
"""Seconds per id of one warp's serial walk through a bag in FBGEMM's no-bag (sequence) lookup forward
(two dependent HBM loads per id: the index, then the row). Fitted (449 ns) with the device fit on the
six round-2 fit runs of ``benchmarks/calibration_h200.py`` (NVIDIA H200, FBGEMM 1.6.0, whole-history
bags of ~1,000-4,096 ids in 64-320 warps; CPU re-analysis 2026-11-29); a calibration's
``lookup_id_latency_s`` replaces it. Sets the latency-bound floor of the sequence lookup
(:func:`coplan.costmodel.decomposed.seq_lookup_floor_s`)."""

DEFAULT_COLLECTIVE_EFFICIENCY = 1.0
"""Topology tiers carry their own per-collective efficiency; a missing entry means 1.0 × this."""

IN_SWITCH_ALLREDUCE_GAIN = 1.25
"""Bus-bandwidth gain of all-reduce with in-switch reduction (NVLink SHARP/NVLS, IB SHARP). In theory
each GPU sends and receives the buffer once instead of 2(n−1)/n times; measured gains are smaller:
NVIDIA GTC25 session S72583 (reproduced in stas00/ml-engineering, network/README.md §SHARP) shows
370 → 480 GB/s on 8×H100 NVLink 4 (+30%) and 680 → 850 GB/s on NVL72 (+25%). We take the lower."""

COLLECTIVE_BASE_LATENCY_S = 8e-6
"""Fixed cost of one NCCL collective (kernel launch, proxy hand-off), the order of NCCL's tuning
model base latencies (NCCL ``src/graph/tuning.cc``) and of the ~8-10 µs small-message all-reduce
times nccl-tests prints on one 8-GPU node."""

P2P_PER_PEER_S = 0.25e-6
"""Extra issue cost per peer of an all-to-all, which NCCL runs as one send/recv per peer (assumption;
makes a 16k-peer all-to-all pay ~4 ms of message overhead, in line with the latency walls reported
for flat all-to-all at that scale)."""

SM_CONTENTION = 0.10
"""Compute slows by this fraction while an SM-using collective runs beside it: NCCL takes 16-32 of
132 SMs and HBM bandwidth. Measured overlap slowdowns of 5-20% on H100 GEMMs (e.g. the FLUX and
Domino papers, 2024) bracket it; assumption until calibrated."""

EXPERT_IMBALANCE_DEFAULT = True
"""Price the busiest expert-parallel rank at the capacity factor's bound (see compute.py)."""


@dataclass(frozen=True, slots=True)
class Efficiencies:
    """Resolved efficiencies for one (topology, calibration)."""

    compute: dict[tuple[str, str], float]
    """(op class, dtype) → fraction of the dtype's dense peak."""

    memory: dict[str, float]
    """op class → fraction of datasheet HBM bandwidth."""

    launch_s: dict[str, float]
    """op class → seconds per kernel launch."""

    collective: dict[tuple[str, str], float]
    """(tier name, collective) → fraction of the tier's per-GPU bandwidth reached."""

    sm_contention: float = SM_CONTENTION
    """Slowdown of compute that overlaps SM-using communication."""

    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure came from (for reports)."""

    host_launch_s: float = 0.0
    """Host seconds per priced kernel launch (a calibration's ``host_launch_s``); 0: the step is device time."""

    host_launch_graphed_s: float = 0.0
    """Host seconds per priced launch of a plan run as CUDA graphs (a calibration's ``host_launch_graphed_s``);
    0: ``host_launch_s``."""

    host_sample_s: float = 0.0
    """Host seconds per local sample per step (a calibration's ``host_sample_s``), added to the host's time."""

    device_step_factor: float = 1.0
    """The device step's factor for device work no priced op accounts for (a calibration's
    ``device_step_factor``; 1: none)."""

    device_gap_s: float = 0.0
    """Device seconds per priced launch between kernels (a calibration's ``device_gap_s``, else
    :data:`DEFAULT_DEVICE_GAP_S` where no calibration fits the device), already in :attr:`launch_s`; 0: none."""

    loader_scale: float = 1.0
    """Measured over priced data-loader time (a calibration's ``loader_scale``; 1: the default coefficients)."""

    lookup_id_s: float = DEFAULT_LOOKUP_ID_LATENCY_S
    """Seconds per id of a warp's serial walk through a no-bag lookup bag (a calibration's
    ``lookup_id_latency_s``; default :data:`DEFAULT_LOOKUP_ID_LATENCY_S`)."""

    attention_scales: dict[tuple[str, str], tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """(attention op, phase) → its fitted (head dim, time scale) points, by head dim (a calibration's
    ``attention_scales``); empty: every scale is 1."""

    def compute_eff(self, op_class: str, dtype: str) -> float:
        return self.compute.get((op_class, dtype)) or self.compute.get((op_class, "bf16"), 0.5)

    def attention_scale(self, op: str, phase: str, head_dim: int) -> float:
        """Measured over priced time of attention op ``op`` (its name's last part) in ``phase`` at ``head_dim``
        (a calibration's ``attention_scales``): the fitted point's, linear in log2(head dim) between two fitted
        head dims, the nearest one's beyond them; 1 where the calibration fitted none for (op, phase)."""
        return scale_at(self.attention_scales.get((op, phase), ()), head_dim)


def scale_at(points: tuple[tuple[int, float], ...] | list[tuple[int, float]], head_dim: int) -> float:
    """The scale at ``head_dim`` from fitted (head dim, scale) ``points`` sorted by head dim: a point's own, linear in
    log2(head dim) (geometric) between two, the nearest one's beyond them; 1 with none."""
    if not points or head_dim <= 0:
        return 1.0
    if head_dim <= points[0][0]:
        return points[0][1]
    if head_dim >= points[-1][0]:
        return points[-1][1]
    x = math.log2(head_dim)
    for (h0, s0), (h1, s1) in zip(points, points[1:]):
        if h0 <= head_dim <= h1:
            t = (x - math.log2(h0)) / (math.log2(h1) - math.log2(h0))
            return math.exp((1 - t) * math.log(s0) + t * math.log(s1))
    return 1.0


def _fits_device(calibration: Calibration | None) -> bool:
    """Whether ``calibration`` fitted the device's time (its op classes, or the unpriced work as a gap or a
    factor): then it stands in for the default device gap, which its fit did not include."""
    return calibration is not None and bool(calibration.op_classes or calibration.device_gap_s
                                            or calibration.device_step_factor)


def resolve_efficiencies(topology: Topology, calibration: Calibration | None = None, *, force: bool = False,
                         default_gap: bool = True) -> Efficiencies:
    """Efficiencies for ``topology`` with ``calibration`` applied over the defaults.

    ``default_gap``: price :data:`DEFAULT_DEVICE_GAP_S` where the calibration fits no device term (a step-level
    term: the calibration's fits of single ops, whose traced times hold no idle, start without it).

    A calibration measured on a different GPU than the topology's is refused unless ``force``; one naming
    a tier the topology does not have is refused always (:meth:`Calibration.check_against`).
    """
    gpu = topology.gpu
    if calibration is not None:
        calibration.check_against(topology, force=force)
    sources: dict[str, str] = {}
    compute: dict[tuple[str, str], float] = {}
    dtypes = sorted(set(gpu.peak_flops_per_s) | set(DEFAULT_GEMM_EFFICIENCY))
    for dt in dtypes:
        peak = gpu.peak_flops_per_s.get(dt)
        meas = gpu.measured_flops_per_s.get(dt)
        if peak and meas:
            compute[("gemm", dt)] = min(1.0, meas / peak)
            sources[f"gemm.{dt}"] = f"topology '{topology.name}': measured {meas / 1e12:.0f} / peak {peak / 1e12:.0f} TFLOP/s"
        else:
            compute[("gemm", dt)] = DEFAULT_GEMM_EFFICIENCY.get(dt, 0.7)
            sources[f"gemm.{dt}"] = "default (efficiency.DEFAULT_GEMM_EFFICIENCY)"
        compute[("attention", dt)] = DEFAULT_ATTENTION_EFFICIENCY.get(dt, 0.4)
        compute[("embedding", dt)] = compute[("gemm", dt)]
        compute[("elementwise", dt)] = compute[("gemm", dt)]
    memory = dict(DEFAULT_MEMORY_EFFICIENCY)
    if gpu.measured_hbm_bw_bytes_per_s:
        copy = min(1.0, gpu.measured_hbm_bw_bytes_per_s / gpu.hbm_bw_bytes_per_s)
        for k in ("gemm", "attention", "elementwise", UNFUSED_CLASS):
            memory[k] = copy
        memory["embedding"] = copy * TBE_OVER_COPY
        sources["memory"] = f"topology '{topology.name}': measured copy {gpu.measured_hbm_bw_bytes_per_s / 1e12:.2f} TB/s"
    launch = dict(DEFAULT_LAUNCH_OVERHEAD_S)
    collective: dict[tuple[str, str], float] = {}
    for t in topology.tiers:
        for c in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"):
            collective[(t.name, c)] = t.efficiency(c) * DEFAULT_COLLECTIVE_EFFICIENCY
    if calibration is not None:
        for cls, oc in calibration.op_classes.items():
            for dt, e in oc.compute_efficiency.items():
                compute[(cls, dt)] = e
                sources[f"{cls}.{dt}"] = f"calibration ({calibration.device})"
            if oc.memory_efficiency is not None:
                memory[cls] = oc.memory_efficiency
            if oc.launch_overhead_s is not None:
                launch[cls] = oc.launch_overhead_s
        if calibration.unfused_kernel_s is not None:
            launch[UNFUSED_CLASS] = calibration.unfused_kernel_s
            sources["launch.unfused"] = f"calibration ({calibration.device})"
        if calibration.unfused_memory_efficiency is not None:
            memory[UNFUSED_CLASS] = calibration.unfused_memory_efficiency
            sources["memory.unfused"] = f"calibration ({calibration.device})"
        for tier, d in calibration.collective_efficiency.items():
            for c, e in d.items():
                collective[(tier, c)] = e
    gap = calibration.device_gap_s if calibration is not None and calibration.device_gap_s else 0.0
    if gap:
        sources["device_gap"] = (f"calibration ({calibration.device}): {gap * 1e6:.2f} us of device time per priced "
                                 "launch between kernels")
    elif default_gap and not _fits_device(calibration):
        gap = DEFAULT_DEVICE_GAP_S
        sources["device_gap"] = (f"default (efficiency.DEFAULT_DEVICE_GAP_S): {gap * 1e6:.2f} us of device time per "
                                 f"priced launch between kernels ({HOST_KERNELS_PER_PRICED_LAUNCH:g} kernels x "
                                 f"{DEVICE_IDLE_PER_KERNEL_S * 1e6:.2f} us measured idle each)")
    if gap:
        # the device's time between kernels, per priced launch: every class's launch cost carries it
        launch = {k: v + gap for k, v in launch.items()}
    host = calibration.host_launch_s if calibration is not None and calibration.host_launch_s else 0.0
    if host:
        sources["host_launch"] = f"calibration ({calibration.device})"
    graphed = calibration.host_launch_graphed_s if calibration is not None and calibration.host_launch_graphed_s else 0.0
    if graphed:
        sources["host_launch_graphed"] = f"calibration ({calibration.device})"
    per_sample = calibration.host_sample_s if calibration is not None and calibration.host_sample_s else 0.0
    if per_sample:
        sources["host_sample"] = f"calibration ({calibration.device})"
    factor = calibration.device_step_factor if calibration is not None and calibration.device_step_factor else 1.0
    if calibration is not None and calibration.device_step_factor:
        sources["device_step_factor"] = f"calibration ({calibration.device})"
    lookup_id = DEFAULT_LOOKUP_ID_LATENCY_S
    if calibration is not None and calibration.lookup_id_latency_s is not None:
        lookup_id = calibration.lookup_id_latency_s
        sources["lookup_id_latency"] = f"calibration ({calibration.device})"
    scales: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, v in (calibration.attention_scales if calibration is not None else {}).items():
        op, phase, hd = key.split(":")
        scales.setdefault((op, phase), []).append((int(hd), float(v)))
    if scales:
        sources["attention_scales"] = f"calibration ({calibration.device}): {len(calibration.attention_scales)} (op, phase, head dim) scale(s)"
    loader_scale = 1.0
    if calibration is not None and calibration.loader_scale:
        loader_scale = calibration.loader_scale
        sources["loader"] = f"calibration ({calibration.device}): x{loader_scale:.3g} the default loader coefficients"
    return Efficiencies(compute=compute, memory=memory, launch_s=launch, collective=collective, sources=sources,
                        host_launch_s=host, host_launch_graphed_s=graphed, host_sample_s=per_sample, device_step_factor=factor, device_gap_s=gap,
                        lookup_id_s=lookup_id, loader_scale=loader_scale,
                        attention_scales={k: tuple(sorted(v)) for k, v in scales.items()})


__all__ = [
    "COLLECTIVE_BASE_LATENCY_S", "DEFAULT_ATTENTION_EFFICIENCY", "DEFAULT_DEVICE_GAP_S", "DEVICE_IDLE_PER_KERNEL_S",
    "HOST_KERNELS_PER_PRICED_LAUNCH", "DEFAULT_LOOKUP_ID_LATENCY_S", "DEFAULT_GEMM_EFFICIENCY", "DEFAULT_LAUNCH_OVERHEAD_S",
    "DEFAULT_MEMORY_EFFICIENCY", "Efficiencies", "IN_SWITCH_ALLREDUCE_GAIN", "P2P_PER_PEER_S", "SM_CONTENTION", "UNFUSED_CLASS",
    "resolve_efficiencies", "scale_at",
]
