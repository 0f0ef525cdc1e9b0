"""Jagged attention kernels (softmax and GDPA): Triton kernels, PyTorch references, dispatch.

Imports nothing of the rest of coplan.
"""
