"""The trainer with three host-overhead choices off, for test_pipeline.py (a torchrun script taking the
trainer's arguments): the dense optimizer stepped through DTensor, the input dist inside forward (no
batch prepared ahead), one FSDP2 unit per layer on one rank too."""

from __future__ import annotations

import sys

from coplan.trainer import loop, train


def _with(fn, **forced):
    def call(*a, **k):
        return fn(*a, **{**k, **forced})

    return call


if __name__ == "__main__":
    loop.Optimizers = _with(loop.Optimizers, local_step=False)
    loop.SparseDistPipeline = _with(loop.SparseDistPipeline, enabled=False)
    loop.parallelize = _with(loop.parallelize, fsdp_per_layer=True)
    sys.exit(train.main(sys.argv[1:]))
