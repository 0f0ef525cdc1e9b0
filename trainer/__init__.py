"""Trainer: execute a plan on real GPUs (FSDP2, TorchRec, custom kernels), measure MFU, write traces and checkpoints."""
