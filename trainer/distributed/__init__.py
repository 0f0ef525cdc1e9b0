"""One module per parallelism (torchtitan's layout): mesh, embedding sharding, expert parallelism,
activation checkpointing, FSDP. :mod:`coplan.trainer.parallelize` applies them in a fixed order."""
