"""The input pipeline: host batches pinned on the data thread; the next batch's host-to-device copies and
TorchRec input distribution one batch ahead, on a side stream.

Why: TorchRec's input distribution builds small index tensors with ``torch.tensor(..., device=cuda)``
(``## all2all_data:recat_permute_gen ##``), a copy from pageable host memory that synchronises the
stream it is issued on. Issued on the compute stream at the start of a step, it waits for everything
the previous step left queued, and the GPU then idles while the host refills the queue (0.7-7 ms per
step on one H200, BENCHMARKS.md trainer v3). On a side stream it waits only for that stream's own
copies. TorchRec's ``TrainPipelineSparseDist`` does this by rewriting the model's forward (an FX trace
of where each KJT comes from); our model hands its KJTs to the sparse arch directly, so the trainer
calls :meth:`SparseArch.input_dist` itself and passes the result in the batch.

Order of a step with the pipeline on: forward of batch i (its distributed inputs are ready), then
:meth:`SparseDistPipeline.prepare` of batch i+1 (copies and input dist on the side stream, overlapping
batch i's queued forward and backward), then backward and optimizer of batch i. Every rank issues the
same collectives in the same order, so multi-rank input all-to-alls stay matched. On CPU there is no
stream: the same calls run in the same order, so the CPU tests exercise the code path.

The unit is the micro-batch: with gradient accumulation, the batch prepared ahead is the step's next
micro-batch (or the next step's first). A workload without tables has no sparse arch (``sparse`` None):
only the copies run ahead.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from coplan.trainer.batch import Batch, HostTensors, PinnedStaging, host_tensors, to_device
from coplan.trainer.data import HostBatch
from coplan.trainer.features import FeatureLayout

if TYPE_CHECKING:
    from coplan.trainer.model.sparse import SparseArch


class SparseDistPipeline:
    """``host`` (on the data thread), ``prepare`` (ahead of the batch's step), ``ready`` (right before its forward)."""

    def __init__(self, sparse: "SparseArch | None", layout: FeatureLayout, device: torch.device, *, enabled: bool = True) -> None:
        """``enabled`` False: the batch pinned, copied and distributed on the training thread at the start
        of its step, on the compute stream (input dist inside forward), as before this pipeline."""
        self.sparse = sparse
        self.layout = layout
        self.device = device
        self.enabled = enabled
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None
        self.staging = (PinnedStaging() if self.stream is not None and os.environ.get("COPLAN_PINNED_STAGING", "0") == "1"
                        else None)
        """Where the data thread packs each batch (one pinned buffer, one copy), when the pipeline runs on CUDA and
        ``COPLAN_PINNED_STAGING=1``. Off by default until a GPU run has measured it (written 2026-12-06 without a
        device: its logic is tested on CPU, its pinned path by ``tests/trainer/test_staging.py`` on a GPU); off, a
        pinned copy per tensor, as before it."""

    def host(self, hb: HostBatch) -> HostTensors | None:
        """The batch's CPU tensors, pinned for CUDA: numpy and memcpy work that the data thread takes off
        the training thread (None when the pipeline is off: :meth:`prepare` then does it)."""
        return host_tensors(hb, self.layout, self.device.type == "cuda", self.staging) if self.enabled else None

    def thread_setup(self) -> None:
        """Run on the data thread first: pinned buffers are allocated for the current CUDA device."""
        if self.enabled and self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def prepare(self, hb: HostBatch, ht: HostTensors | None = None) -> Batch:
        if not self.enabled or ht is None:
            ht = host_tensors(hb, self.layout, self.device.type == "cuda")
        if not self.enabled:
            return to_device(ht, self.device)
        # No wait on the compute stream here (that would bring back the drain this avoids): memory the
        # side stream allocates comes from its own pool, and blocks used on the compute stream are
        # recorded there (:meth:`ready`), so the allocator hands none out while that stream reads it.
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            batch = to_device(ht, self.device)
            if self.sparse is not None:
                batch.sparse_dist = self.sparse.input_dist(batch.pooled, batch.sequences)
        return batch

    def ready(self, batch: Batch) -> Batch:
        """Make the compute stream wait for the batch's side-stream work, and keep its memory alive for it."""
        if self.stream is not None and batch.sparse_dist is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.stream)
            batch.record_stream(cur)
        return batch


__all__ = ["SparseDistPipeline"]
