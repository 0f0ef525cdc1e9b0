"""coplan: co-design the parallel plan of a giant recommendation-model training job.

The planning half (``coplan.spec``, ``coplan.costmodel``, ``coplan.planner``, ``coplan.reports``)
needs no torch; the running half (``coplan.trainer``, ``coplan.kernels``) is the ``[train]`` extra.
"""

__version__ = "0.1.0"
