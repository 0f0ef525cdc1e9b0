"""Cost model: compute, communication and memory of a workload under a plan, over a multi-tier topology.

Imports only ``coplan.spec``. ``flops.py`` (the one FLOP formula) and ``jagged.py`` (length
distributions, per-sequence cost, balancers) are also imported by the trainer; import those two
modules directly (``from coplan.costmodel.flops import model_flops``) — this package's ``__init__``
pulls in the rest of the cost model.

How the planner uses it (build once per mesh candidate, price many times)::

    from coplan.costmodel import build_context, price, table_option_costs, layer_costs, dense_fixed_costs

    ctx = build_context(workload, topology, mesh, calibration)     # (a) everything plan-independent
    tw = table_option_costs(ctx, "table_wise")                     # (b) all tables, one option, arrays
    rw4 = table_option_cost(ctx, "t0007", "row_wise", 4)           #     one table, one option
    layers = layer_costs(ctx, policy="greedy")                     # (c) per layer fwd/bwd/recompute/activations
    fixed = dense_fixed_costs(ctx)                                 # (d) FSDP/HSDP/EP collectives, dense state bytes
    cost = price(ctx, tables, layer_plans, balancing, kernels)     # (e) the full pricer -> StepCost
    prediction = cost.to_prediction()                              #     -> coplan.spec.Prediction

The planner reaches these through :class:`CostModel` (``COST_MODEL``, :mod:`.planner_view`), which it
is handed, and reads only typed values back. The modules, by job: :mod:`.context` (the pricing
context and its options), :mod:`.compute` (dense ops, padding, jagged imbalance), :mod:`.fp8`,
:mod:`.memory`, :mod:`.decomposed` (the per-option and per-layer costs), :mod:`.step_schedule` and
:mod:`.pricer` (the step), :mod:`.results` (the frozen results).

``tables`` is a sequence of :class:`~coplan.spec.TableShard` or, faster in a search loop, a
:class:`TableAssignment` of flat arrays. ``collective_time``/``collective_model`` price one
collective on a placed group; ``model_flops`` is re-exported from :mod:`.flops`.
"""

from coplan.costmodel.comm import CollectiveModel, GroupPlacement, bus_factor, collective_model, collective_time, p2p_time, place_group
from coplan.costmodel.compute import imbalance
from coplan.costmodel.context import Context, Options, build_context
from coplan.costmodel.decomposed import (
    LayerCost,
    TableOptionCost,
    dense_fixed_costs,
    layer_costs,
    table_option_cost,
    table_option_costs,
)
from coplan.costmodel.efficiency import Efficiencies, resolve_efficiencies
from coplan.costmodel.embedding import TableAssignment, TableOptionCosts
from coplan.costmodel.flops import FlopCount, Op, attention_flops, model_flops, workload_ops
from coplan.costmodel.goodput import goodput
from coplan.costmodel.planner_view import COST_MODEL, CostModel, DenseBase, RecomputeOption, ShardOptionCosts
from coplan.costmodel.pricer import price
from coplan.costmodel.results import CommCost, DenseFixedCosts, EmbeddingRanks, Goodput, Memory, OpCost, Perf, SparseAggregates, StepCost, StepCut

__all__ = [
    "COST_MODEL", "CollectiveModel", "CommCost", "Context", "CostModel", "DenseBase", "DenseFixedCosts", "Efficiencies", "EmbeddingRanks", "FlopCount", "Goodput", "GroupPlacement",
    "LayerCost", "Memory", "Op", "OpCost", "Options", "Perf", "RecomputeOption", "ShardOptionCosts", "SparseAggregates", "StepCost", "StepCut", "TableAssignment",
    "TableOptionCost", "TableOptionCosts", "attention_flops", "build_context", "bus_factor", "collective_model",
    "collective_time", "dense_fixed_costs", "goodput", "imbalance", "layer_costs",
    "model_flops", "p2p_time", "place_group", "price", "resolve_efficiencies", "table_option_cost", "table_option_costs",
    "workload_ops",
]
