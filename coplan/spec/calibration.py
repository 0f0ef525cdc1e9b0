"""Calibration: efficiencies fitted to measured traces, with the device they came from and the fit error."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_serializer

from coplan.errors import MismatchError
from coplan.spec.base import drop_added_defaults, plausible, Float, Int, check_schema_version, SCHEMA_VERSION, Collective, Dtype, Spec
from coplan.spec.topology import Topology

_ATTENTION_SCALE_KEY = re.compile(r"[a-z_][a-z0-9_]*:(fwd|bwd):[1-9][0-9]*")

Fraction = Annotated[Float, Field(gt=0, le=1), plausible(
    1e-6, 1.0, "", "a fraction of the datasheet peak (1e-6 to 1)", "efficiency")]
"""An efficiency: at least 1e-6, the floor ``coplan calibrate``'s fits keep to (an op at a millionth of its
roofline; CPU traces priced against a GPU's peak come near it). Below it the priced times overflow the planner."""
ComputeOpClass = Literal["gemm", "attention", "embedding", "elementwise"]


STALE_MARK = "[stale:"
"""How a calibration's notes open the mark :func:`coplan.calibration.shipped.judged` writes (``[stale: ...]``),
read back by :func:`stale_mark`."""


def stale_mark(notes: str | None) -> str | None:
    """The ``stale: ...`` reason :func:`coplan.calibration.shipped.judged` wrote into a calibration's notes (brackets
    off), or None."""
    if not notes or STALE_MARK not in notes:
        return None
    return notes[notes.index(STALE_MARK) + 1:].split("]", 1)[0]


class OpClassCalibration(Spec):
    """Fitted figures of one op class."""

    compute_efficiency: dict[Dtype, Fraction] = Field(default_factory=dict)
    """Achieved fraction of the datasheet peak FLOP/s, per dtype (missing dtypes keep the default)."""

    memory_efficiency: Fraction | None = None
    """Achieved fraction of the datasheet HBM bandwidth for bandwidth-bound ops of this class."""

    launch_overhead_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Fixed time per kernel launch of this class, in seconds."""


class FitError(Spec):
    """How well the fitted model reproduces the measurements it was fitted on (and held-out ones)."""

    median_abs_rel_error: Annotated[Float, Field(ge=0)]
    """Median |predicted − measured| / measured over the samples."""

    max_abs_rel_error: Annotated[Float, Field(ge=0)]
    """Largest |predicted − measured| / measured over the samples."""

    per_op_class: dict[str, Annotated[Float, Field(ge=0)]] = Field(default_factory=dict)
    """Relative error of the summed time of each op class."""

    num_samples: Annotated[Int, Field(ge=0)] = 0
    """Measured quantities the fit used."""


class Calibration(Spec):
    """Efficiencies that replace the cost model's defaults."""

    schema_version: Int = SCHEMA_VERSION
    """Version of the calibration schema."""

    device: str = Field(min_length=1)
    """GPU name the traces came from; must match the topology's ``gpu.name`` unless forced."""

    created_utc: str = ""
    """ISO-8601 time the fit was made."""

    versions: dict[str, str] = Field(default_factory=dict)
    """Software versions of the measured runs (torch, triton, cuda, coplan...)."""

    source_runs: tuple[str, ...] = ()
    """Run directories the fit read."""

    op_classes: dict[ComputeOpClass, OpClassCalibration] = Field(default_factory=dict)
    """Fitted figures per compute op class."""

    attention_scales: dict[str, Annotated[Float, Field(ge=0.05, le=20)]] = Field(default_factory=dict)
    """Measured over priced time of the attention ops, beyond their class's fitted efficiencies, keyed
    ``"<op>:<phase>:<head dim>"`` (``<op>``: the op name's last part, e.g. ``gdpa``, ``summary_attn``, ``attn``;
    ``<phase>``: ``fwd`` or ``bwd``), e.g. ``{"gdpa:bwd:256": 1.6}``. One efficiency per class cannot hold
    every attention kernel: a jagged Triton kernel's forward and its backward (two kernels that recompute the
    scores), the summary tokens' few queries over a whole history, and a Kunlun layer's attention over a few
    dozen tokens each reach another share of the peak, and that share moves with the head dim (tile shapes,
    registers). ``coplan calibrate`` fits each key as the shrunk geometric mean of the runs' residuals for that
    (op, phase, head dim) after the class fit (:func:`coplan.calibration.device_fit.fit_attention_scales`); the
    pricer multiplies the op's roofline time by it, interpolating between fitted head dims in log2 and taking
    the nearest beyond them (:meth:`coplan.costmodel.efficiency.Efficiencies.attention_scale`). Empty: 1
    (calibrations written before it existed load unchanged)."""

    collective_efficiency: dict[str, dict[Collective, Fraction]] = Field(default_factory=dict)
    """Fitted bus-bandwidth efficiency per tier name and collective."""

    host_launch_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Host time per kernel launch the cost model prices, in seconds, for host-bound steps: the host's
    time is the step's priced launches times this, concurrent with the device's, and the step is priced
    at the longer of the two (``coplan calibrate --host-cost``). None: device time alone."""

    host_launch_graphed_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Host time per priced launch for a one-rank plan whose dense arch the trainer replays as CUDA graphs,
    in seconds, fitted on graphed runs alone (``coplan calibrate``). Such a step issues a few dozen priced
    launches (the graphs' replays, the embedding lookups, the optimizer), and the host's time per step is
    mostly the training loop's and TorchRec's Python around them, several times an eager launch's cost
    per priced launch. None: ``host_launch_s`` applies to graphed plans too (calibrations written before
    it existed load unchanged)."""

    host_sample_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Host time per sample of the rank's local batch per step, in seconds, added to the host's time
    (priced launches × ``host_launch_s``) before the step takes the longer of host and device: the
    trainer's per-sample host work (the data thread's batch read, balancing, KJT building and pinning,
    competing with the launching threads for the GIL; see ``coplan.calibration``). None: none
    (calibrations written before it existed load unchanged)."""

    device_step_factor: Annotated[Float, Field(ge=0.5, le=3)] | None = None
    """Measured device-bound step over the device time the cost model's ops add up to (fitted with the
    host costs to measured step times, ``coplan calibrate --host-cost``): the device work no priced op
    accounts for (the optimizer's and the allocator's small kernels, copies, the gaps between dependent
    kernels) as a share of the priced work. The step is priced at max(factor × device step, host time).
    None: 1 (calibrations written before it existed load unchanged)."""

    device_gap_s: Annotated[Float, Field(ge=0, le=1e-3)] | None = None
    """Device seconds per priced kernel launch that no op's kernel time holds: the gaps between dependent
    kernels (a replayed CUDA graph's included) and the small kernels the ops do not price, per launch the
    pricer charges. Added to every op class's launch cost, so each op's device time carries its share and
    the step grows with its launch count, not with its length (fitted with the host costs, as the
    alternative to :attr:`device_step_factor`: ``coplan calibrate`` keeps the form that fits the measured
    steps better). None: 0 (calibrations written before it existed load unchanged)."""

    host_op_median_us: dict[str, Annotated[Float, Field(gt=0)]] = Field(default_factory=dict)
    """The host speed the host costs were fitted at: per host call that every fitted run made many times
    (``coplan.calibration.host_profile.HOST_SPEED_OPS``), the geometric mean over the fitted runs of its median
    host duration in their profiled steps, in µs. A later run's trace read against it says how much
    slower or faster its host ran (``coplan.calibration.host_profile.host_speed_index``); the host costs hold for
    a host this fast. Empty: not recorded (calibrations written before it existed load unchanged)."""

    lookup_id_latency_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Seconds per id of one warp's serial walk through a bag in FBGEMM's no-bag (sequence) lookup
    forward, the latency-bound floor of that kernel (``coplan.costmodel.decomposed.seq_lookup_floor_s``).
    None: the default (``coplan.costmodel.efficiency.DEFAULT_LOOKUP_ID_LATENCY_S``); 0: no floor."""

    unfused_memory_efficiency: Fraction | None = None
    """Fraction of datasheet HBM bandwidth an unfused op's kernels stream at (the padded reference
    attention's fp32 matmuls and score passes over whole [H, P, P] blocks: ``coplan.costmodel.efficiency.
    UNFUSED_CLASS``), fitted on those ops' traced time. None: the default (the topology's measured
    copy rate, else ``coplan.costmodel.efficiency.DEFAULT_MEMORY_EFFICIENCY['unfused']``)."""

    unfused_kernel_s: Annotated[Float, Field(ge=0, le=1)] | None = None
    """Device seconds per kernel of an unfused op beyond the one its fused form would launch (the padded
    reference issues ~84 small ATen kernels per forward call, 28 per backward; a call whose work is small,
    the summary attention's, is mostly these), fitted on those ops' traced time. None: the default
    (``coplan.costmodel.efficiency.DEFAULT_LAUNCH_OVERHEAD_S['unfused']``)."""

    loader_scale: Annotated[Float, Field(gt=0, le=100)] | None = None
    """Measured data-loader time over the cost model's (``coplan.costmodel.loader``, its default coefficients):
    the median over the fitted runs of a reader process's seconds per step (``summary.json``'s loader figures)
    over the priced ones. It holds the host's CPU speed and the contention of a busy host. None: 1. Written
    only when fitted (calibrations from before it keep their hashes)."""

    fit_error: FitError | None = None
    """Fit quality."""

    notes: str = ""
    """What was fitted and what was left at defaults."""

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler):
        return drop_added_defaults(handler(self), {"loader_scale": None, "attention_scales": {}})

    @field_validator("attention_scales")
    @classmethod
    def _attention_scale_keys(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if not _ATTENTION_SCALE_KEY.fullmatch(k)]
        if bad:
            raise ValueError(f"keys {bad[:3]} are not '<op>:<phase>:<head dim>' (e.g. 'gdpa:bwd:128'; phase fwd or bwd, "
                             "head dim a positive integer); fix or remove them")
        return v

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        return check_schema_version(v)

    def matches_device(self, gpu_name: str) -> bool:
        """Whether the calibration's device names the same GPU as ``gpu_name`` (one contains the other)."""
        mine, theirs = self.device.strip().lower(), gpu_name.strip().lower()
        return mine in theirs or theirs in mine

    def unknown_tiers(self, topology: Topology) -> list[str]:
        """Tiers ``collective_efficiency`` names that ``topology`` does not have, sorted."""
        return sorted(set(self.collective_efficiency) - {t.name for t in topology.tiers})

    def check_against(self, topology: Topology, *, force: bool = False) -> None:
        """Refuse a calibration that does not belong to ``topology``, before any of it is used.

        The device must match the topology's GPU unless ``force``. Every tier the calibration fits a
        collective efficiency for must be a tier of the topology, forced or not: a tier it does not have
        would be ignored without a word, and the planner would price that tier at the defaults. A topology
        of one GPU prices no collective, so a calibration fitted on a larger one of the same GPU applies
        to it (its compute and host terms) whatever tiers it names.
        """
        gpu = topology.gpu.name
        if not force and not self.matches_device(gpu):
            raise MismatchError(
                f"calibration was fitted on '{self.device}' but topology '{topology.name}' has '{gpu}'; "
                "re-calibrate on this GPU, or force it (`coplan plan --force`, `force=True` in Python)"
            )
        tiers = [t.name for t in topology.tiers]
        unknown = self.unknown_tiers(topology) if topology.num_gpus > 1 else []
        if unknown:
            raise MismatchError(
                f"calibration collective_efficiency names tier{'s' if len(unknown) > 1 else ''} {unknown} that topology "
                f"'{topology.name}' does not have (its tiers: {tiers}); rename them to the topology's tiers, drop them "
                "from the calibration, or use the topology the calibration was measured on"
            )
