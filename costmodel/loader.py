"""The data loader's time per step on one rank: the trainer's own reader (``coplan.trainer.data``), priced
from the values it decodes and gathers.

What the trainer's reader does per step, in each of its reader processes (steps go round-robin to them):

- **read**: decode the columns of the rows its balance group shares (Parquet row groups → numpy), and
  balance them over the group's ranks and micro-batches: ``step_s + G·b·V·value_s`` for a group of ``G``
  ranks of ``b`` samples each, ``V`` values per sample (every id of every pooled feature and history, a
  length per feature and sequence, labels, dense features);
- **gather**: each micro-batch's rows into its arrays: ``M·micro_s + b·V·gather_s``.

``P`` processes read in parallel, so the loader produces a step every ``(read + gather) / P`` seconds;
the step can go no faster (:func:`loader_step_s`). The coefficients are fitted by
``benchmarks/loader_fit.py`` on the trainer's reader (one process, sampler draws, several group sizes and
micro-batch counts); a calibration of runs (``coplan calibrate``, from each run's measured read time per
batch) replaces them.

The trainer balances within a node (``coplan.trainer.data.BatchReader``'s balance groups): each rank decodes
its node's share of the global batch, whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from coplan.costmodel.jagged import length_moments
from coplan.spec import Workload
from coplan.spec.workload import DenseMLPBlock, TaskHeads, TransformerBlock


@dataclass(frozen=True, slots=True)
class LoaderCoefficients:
    """Seconds per unit of the reader's work (see the module docstring)."""

    step_s: float
    """Per step read: opening the step's row groups, balancing."""
    value_s: float
    """Per value decoded from Parquet (the group's rows)."""
    micro_s: float
    """Per micro-batch gathered."""
    gather_s: float
    """Per value gathered into the rank's micro-batches."""
    source: str


DEFAULT_LOADER = LoaderCoefficients(
    step_s=0.001469, value_s=1.084e-08, micro_s=0.0001695, gather_s=2.436e-09,
    source="benchmarks/loader_fit.py, 2026-12-04, commit 7d2159b: one reader process on a 2-core x86 CPU, "
           "8 h200-1gpu draws (seed 20261204235040); fit median 13%, held out "
           "on 10 other draws median 11% / max 15%",
)
"""Fitted by ``python benchmarks/loader_fit.py`` (see ``benchmarks/results/loader_fit.json`` for the draws, the
fit error and the held-out check); the test ``tests/costmodel/test_loader.py`` keeps these equal to it."""

DEFAULT_READER_PROCESSES = 8
"""Reader processes per rank when the topology does not say how many CPU cores a node has: the trainer's
maximum (``coplan.trainer.data.MAX_READER_PROCESSES``; a test keeps them equal), which it starts on any
host with ten or more cores per GPU."""


def values_per_sample(workload: Workload) -> float:
    """Expected values the reader decodes per sample: every id (pooled features at their pooling factor,
    history tables at the expected length), a length per pooled feature and per sequence, token ids,
    labels and dense features."""
    means = {s.name: length_moments(s.length).mean for s in workload.sequences}
    v = 0.0
    for t in workload.all_tables:
        if t.feature_kind == "sequence":
            v += means.get(t.sequence, 0.0) * t.num_features
        else:
            v += (t.pooling_factor + 1.0) * t.num_features
    v += len(workload.sequences)
    v += sum(means.get(b.sequence, 0.0) + 1.0 for b in workload.blocks if isinstance(b, TransformerBlock) and b.vocab_size)
    v += sum(len(b.tasks) for b in workload.blocks if isinstance(b, TaskHeads))
    v += sum(b.num_dense_features for b in workload.blocks if isinstance(b, DenseMLPBlock))
    return float(v)


def balance_group(world: int, gpus_per_node: int, group_ranks: int | None = None) -> int:
    """Ranks that balance together: a plan's ``balancing.group_ranks``, else a node's ranks, at most the world (the
    trainer's rule, ``coplan.trainer.data.BatchReader``)."""
    return max(1, min(world, group_ranks or gpus_per_node))


def reader_processes(cores_per_node: int | None, ranks_per_node: int) -> int:
    """The trainer's reader processes per rank (``coplan.trainer.data.default_reader_processes``) on a node of
    ``cores_per_node`` cores (None: :data:`DEFAULT_READER_PROCESSES`)."""
    if cores_per_node is None:
        return DEFAULT_READER_PROCESSES
    return max(1, min(DEFAULT_READER_PROCESSES, cores_per_node // max(1, ranks_per_node) - 2))


@dataclass(frozen=True, slots=True)
class LoaderTime:
    """One rank's loader per step."""

    step_s: float
    """Seconds per step the loader needs at its processes' parallelism: the step's floor."""
    process_s: float
    """Seconds one process spends on one step (read + gather)."""
    processes: int
    group_ranks: int
    """Ranks whose rows each rank decodes (its balance group)."""
    values_per_sample: float


def loader_step_s(workload: Workload, local_batch: int, micro_batches: int, group_ranks: int, processes: int,
                  coeff: LoaderCoefficients = DEFAULT_LOADER) -> LoaderTime:
    """The loader's time per step for one rank (module docstring)."""
    v = values_per_sample(workload)
    b = max(0, int(local_batch))
    read = coeff.step_s + max(1, group_ranks) * b * v * coeff.value_s
    gather = max(1, micro_batches) * coeff.micro_s + b * v * coeff.gather_s
    p = max(1, processes)
    per = read + gather
    return LoaderTime(per / p, per, p, max(1, group_ranks), v)


__all__ = ["DEFAULT_LOADER", "DEFAULT_READER_PROCESSES", "LoaderCoefficients", "LoaderTime", "balance_group", "loader_step_s",
           "reader_processes", "values_per_sample"]
