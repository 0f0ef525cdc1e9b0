"""Cost model: compute, communication and memory of a workload under a plan, over a multi-tier topology.

Imports only ``coplan.spec``. ``flops.py`` (the one FLOP formula) and ``jagged.py`` (length
distributions, per-sequence cost, balancers) are also imported by the trainer.
"""
