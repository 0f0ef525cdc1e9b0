"""RunResult: what a training run measured (``runs/<id>/summary.json``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from coplan.spec.base import SCHEMA_VERSION, Spec

NonNeg = Annotated[float, Field(ge=0)]


class StepTimeStats(Spec):
    """Distribution of measured step times after warm-up, in seconds."""

    mean_s: NonNeg
    """Mean step time."""

    p50_s: NonNeg
    """Median step time."""

    p90_s: NonNeg
    """90th percentile step time."""

    p99_s: NonNeg
    """99th percentile step time."""

    min_s: NonNeg
    """Fastest step."""

    max_s: NonNeg
    """Slowest step."""


class RunOptions(Spec):
    """The trainer's launch switches that change what a run measured, for whoever prices its steps again."""

    seq_chunk: int = Field(default=0, ge=0)
    """Ids per bag of the sequence lookups (0: one bag per sample's whole history)."""

    compile: str = "off"
    """``torch.compile`` mode of the dense layers (``off``, ``layers``, ``layers-cpp``)."""

    attention_backend: str = ""
    """Attention kernel backend that ran (the plan's, or the launch's override)."""


class RunResult(Spec):
    """Summary of one training run."""

    schema_version: int = SCHEMA_VERSION
    """Version of the run schema."""

    run_id: str = Field(min_length=1)
    """Run directory name."""

    plan_sha256: str = ""
    """Hash of the plan the run executed."""

    workload: str = ""
    """Workload name."""

    world_size: int = Field(gt=0)
    """Processes in the run."""

    device: str = ""
    """Device name (GPU model or 'cpu')."""

    versions: dict[str, str] = Field(default_factory=dict)
    """torch, triton, torchrec, fbgemm, cuda, coplan versions."""

    started_utc: str = ""
    """ISO-8601 start time."""

    ended_utc: str = ""
    """ISO-8601 end time."""

    steps: int = Field(ge=0)
    """Steps run, warm-up included."""

    warmup_steps: int = Field(ge=0)
    """Leading steps excluded from the statistics."""

    step_time: StepTimeStats | None = None
    """Measured step-time distribution (None when no step was measured)."""

    model_flops_per_step: NonNeg = 0.0
    """Model FLOPs of one global step, counted on real lengths (costmodel.flops)."""

    measured_mfu: NonNeg = 0.0
    """Model FLOPs / (mean step time × GPUs × dense bf16 peak)."""

    tokens_per_s: NonNeg = 0.0
    """Real (unpadded) tokens processed per second, over all ranks."""

    samples_per_s: NonNeg = 0.0
    """Samples per second, over all ranks."""

    peak_memory_bytes: tuple[NonNeg, ...] = ()
    """Peak allocated device memory per rank."""

    first_loss: float | None = None
    """Loss of the first step."""

    final_loss: float | None = None
    """Loss of the last step."""

    attention_backend: str = ""
    """Attention kernel backend used."""

    options: RunOptions | None = None
    """The launch switches the run ran with (None: a summary written before they were recorded)."""

    notes: str = ""
    """Anything a reader of the figures should know."""
