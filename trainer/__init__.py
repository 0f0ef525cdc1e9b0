"""Trainer: execute a plan on real GPUs (FSDP2, TorchRec, custom kernels), measure MFU, write traces and checkpoints.

Modules: ``features`` (the inputs a workload implies), ``data`` (Parquet generator and reader, the
balanced per-rank split), ``batch`` (KeyedJaggedTensors), ``model/`` (the GEM model, built as
``coplan.costmodel.flops`` counts it), ``distributed/`` (one module per parallelism) applied by
``parallelize``, ``optim``, ``metrics`` (timing, MFU), ``profiling`` (Kineto window), ``checkpoint``
(DCP), ``train`` (the loop, one process per rank), ``cli`` (``coplan train``, torch-free) and
``plans`` (hand-built plans for tests and development).
"""
