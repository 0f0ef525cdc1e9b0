"""GEM-shaped workloads drawn within stated ranges: the inputs coplan is judged on, not the presets.

A *family* names a target (one H200, one 8-GPU node, a cluster) and the range of every drawn
quantity: model width, heads and head dim, the depth of each block, the history's length
distribution (mean, spread, cap), the tables (count, rows, dims, pooling), MoE (on/off, experts,
top-k, hidden width), the attention kind and activation, and the batch. A draw is a pure function of
``(family, seed)`` (``numpy.random.default_rng``), so a benchmark that takes its seed at run time can
be reproduced from the seed it prints.

Ranges are chosen so that a draw fits its family's target: the tables' weights and optimizer state
take at most ``table_hbm_fraction`` of one GPU's HBM times the GPUs that hold tables (rows are scaled
down, keeping their spread, when a draw exceeds it); activations are the planner's job (recompute and
micro-batches are left to ``coplan plan``: the batch is drawn with ``micro_batches: auto``).

    from coplan.sample import sample_workload, FAMILIES
    w = sample_workload("h200-1gpu", seed=20261204)

    coplan sample-workload --family h200-1gpu --seed 20261204 -o draw.yaml
    coplan sample-workload --list            # the families and their ranges
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from coplan.cli_args import MAX_DRAW_SEED
from coplan.errors import CoplanError
from coplan.spec.loader import load_topology
from coplan.spec.workload import Workload

Span = tuple[float, float]


@dataclass(frozen=True)
class Family:
    """The ranges of one family. ``(lo, hi)`` pairs are inclusive; ``log`` ones are drawn log-uniform."""

    name: str
    description: str
    topology: str
    """The preset topology the family targets."""
    world_sizes: tuple[int, ...]
    """GPU counts a draw is made for (one is drawn); the batch splits evenly over it."""
    head_dims: tuple[int, ...] = (32, 64, 96, 128, 256)
    num_heads: tuple[int, int] = (2, 16)
    model_dim: tuple[int, int] = (256, 2048)
    """Model width = heads x head dim, kept within this range (heads are redrawn until it is)."""
    interformer_layers: tuple[int, int] = (1, 6)
    kunlun_layers: tuple[int, int] = (1, 4)
    kunlun_tokens: tuple[int, int] = (8, 64)
    summary_tokens: tuple[int, int] = (1, 16)
    ffn_multipliers: tuple[float, ...] = (2.0, 3.0, 4.0)
    history_mean: Span = (128.0, 2048.0)
    """Mean history length (log-uniform)."""
    history_sigma: Span = (0.4, 1.3)
    """Log-normal spread of the history length."""
    history_cap_over_mean: Span = (2.0, 8.0)
    """The cap over the mean; the cap is rounded up to a multiple of 128."""
    history_cap_max: int = 8192
    num_tables: tuple[int, int] = (16, 256)
    min_rows: Span = (1e3, 1e5)
    max_rows: Span = (1e5, 1e7)
    table_dims: tuple[int, ...] = (32, 64, 128, 256)
    pooling_mean: Span = (2.0, 40.0)
    sequence_tables: tuple[int, int] = (1, 16)
    table_hbm_fraction: float = 0.30
    """Tables (weights + optimizer state) take at most this share of the HBM of the GPUs holding them."""
    moe_probability: float = 0.5
    num_experts: tuple[int, ...] = (4, 8, 16)
    top_k: tuple[int, int] = (1, 2)
    expert_hidden_over_dim: tuple[float, ...] = (1.0, 2.0, 4.0)
    softmax_probability: float = 0.3
    """Share of draws whose sequence attention is softmax (the rest: GDPA)."""
    gdpa_activations: tuple[str, ...] = ("silu", "gelu_tanh", "relu")
    local_batch: tuple[int, int] = (32, 256)
    """Samples per GPU per step, a multiple of 8."""
    dense_features: tuple[int, int] = (16, 512)
    tasks: tuple[int, int] = (1, 3)

    def ranges(self) -> dict:
        """The ranges as plain data (for ``--list`` and the docs)."""
        return {k: v for k, v in asdict(self).items() if k not in ("name", "description")}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("h200-1gpu", "GEM-shaped models that train on one H200 (141 GB)", "h200-1gpu", (1,)),
        Family("h200-node", "GEM-shaped models for one 8-GPU H200 node", "h200-superpod-1k", (8,),
               num_tables=(32, 512), max_rows=(1e6, 5e7), local_batch=(64, 512)),
        Family("h200-cluster", "GEM-scale models for 256-4,096 H200s", "h200-superpod-4k", (256, 512, 1024, 2048, 4096),
               head_dims=(64, 128, 256), num_heads=(4, 32), model_dim=(512, 4096), interformer_layers=(2, 12),
               kunlun_layers=(2, 8), num_tables=(200, 1200), min_rows=(1e3, 1e6), max_rows=(1e7, 1e9),
               sequence_tables=(4, 32), num_experts=(8, 16, 32, 64), top_k=(1, 4), local_batch=(64, 512)),
    )
}


def _int(rng: np.random.Generator, span: tuple[int, int]) -> int:
    return int(rng.integers(span[0], span[1] + 1))


def _log(rng: np.random.Generator, span: Span) -> float:
    return float(math.exp(rng.uniform(math.log(span[0]), math.log(span[1]))))


def _heads(rng: np.random.Generator, f: Family) -> tuple[int, int]:
    """(heads, head_dim) with heads x head_dim within ``f.model_dim``; head counts need not be powers of two."""
    ok = [(h, d) for d in f.head_dims for h in range(f.num_heads[0], f.num_heads[1] + 1)
          if f.model_dim[0] <= h * d <= f.model_dim[1]]
    if not ok:
        raise CoplanError(f"family {f.name}: no head count x head dim within model_dim {f.model_dim}")
    d = int(rng.choice(sorted({d for _, d in ok})))
    hs = [h for h, dd in ok if dd == d]
    return int(rng.choice(hs)), d


def _tables(rng: np.random.Generator, f: Family, world: int) -> dict:
    n = _int(rng, f.num_tables)
    lo, hi = _log(rng, f.min_rows), _log(rng, f.max_rows)
    dims = sorted(int(d) for d in rng.choice(f.table_dims, size=int(rng.integers(1, len(f.table_dims) + 1)), replace=False))
    weights = rng.dirichlet(np.ones(len(dims)))
    return {"seed": int(rng.integers(0, 2**31 - 1)), "num_tables": n, "min_rows": int(min(lo, hi)), "max_rows": int(max(lo, hi)),
            "dims": dims, "dim_weights": [round(float(x), 3) + 0.001 for x in weights],
            "pooling_mean": round(_log(rng, f.pooling_mean), 2), "pooling_sigma": round(float(rng.uniform(0.3, 1.2)), 3),
            "pooling_max": 200.0, "num_sequence_tables": min(n, _int(rng, f.sequence_tables)), "sequence": "history", "dtype": "fp16"}


def _fit_tables(w: dict, f: Family, world: int, hbm_bytes: float) -> dict:
    """Scale the generated rows down (same spread) until weights + row-wise Adagrad state fit the budget."""
    budget = f.table_hbm_fraction * hbm_bytes * world
    gen = dict(w["table_generator"])
    for _ in range(40):
        wl = Workload.model_validate({**w, "table_generator": gen})
        used = sum(t.num_rows * (t.dim * 2 + 4) for t in wl.all_tables)
        if used <= budget or gen["max_rows"] <= 1000:
            break
        scale = max(0.1, 0.95 * budget / used)
        gen["max_rows"] = max(1000, int(gen["max_rows"] * scale))
        gen["min_rows"] = max(100, min(gen["max_rows"], int(gen["min_rows"] * scale)))
    return gen


def _check(family: str, seed: int) -> Family:
    """The family, once ``family`` and ``seed`` are checked: a seed is a whole number from 0 to
    :data:`~coplan.cli_args.MAX_DRAW_SEED` (``coplan sample-workload --seed``)."""
    if family not in FAMILIES:
        raise CoplanError(f"--family {family!r}: no such family; choose one of {', '.join(FAMILIES)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise CoplanError(f"--seed {seed!r}: not a whole number; give a whole number from 0 to {MAX_DRAW_SEED:,}")
    if not 0 <= int(seed) <= MAX_DRAW_SEED:
        raise CoplanError(f"--seed {int(seed)} is out of range; give a whole number from 0 to {MAX_DRAW_SEED:,}")
    return FAMILIES[family]


def sample_workload(family: str, seed: int) -> Workload:
    """A GEM-shaped workload of ``family`` drawn from ``seed``; see :data:`FAMILIES` for the ranges."""
    f = _check(family, seed)
    topology = load_topology(f.topology)
    rng = np.random.default_rng([int(seed), 23])
    world = int(rng.choice(f.world_sizes))
    heads, head_dim = _heads(rng, f)
    width = heads * head_dim
    mean = _log(rng, f.history_mean)
    cap = min(f.history_cap_max, int(math.ceil(mean * rng.uniform(*f.history_cap_over_mean) / 128) * 128))
    softmax = bool(rng.random() < f.softmax_probability)
    attention = ({"kind": "softmax", "causal": True, "scale": "inv_sqrt_head_dim"} if softmax else
                 {"kind": "gdpa", "activation": str(rng.choice(f.gdpa_activations)), "causal": True, "scale": "inv_max_len"})
    same_width = [(h, d) for d in f.head_dims for h in range(f.num_heads[0], f.num_heads[1] + 1) if h * d == width]
    k_heads, k_dim = same_width[int(rng.integers(len(same_width)))]
    tokens = _int(rng, f.kunlun_tokens)
    blocks: list[dict] = [
        {"type": "dense_mlp", "num_dense_features": _int(rng, f.dense_features), "hidden_dims": [width, width], "out_tokens": 2},
        {"type": "interformer", "sequence": "history", "num_layers": _int(rng, f.interformer_layers), "model_dim": width,
         "num_heads": heads, "head_dim": head_dim, "attention": attention, "ffn_multiplier": float(rng.choice(f.ffn_multipliers)),
         "num_summary_tokens": _int(rng, f.summary_tokens)},
        {"type": "kunlun", "num_layers": _int(rng, f.kunlun_layers), "num_tokens": tokens, "model_dim": width,
         "num_heads": k_heads, "head_dim": k_dim,
         "ffn_multiplier": float(rng.choice(f.ffn_multipliers))},
    ]
    if rng.random() < f.moe_probability:
        experts = int(rng.choice(f.num_experts))
        blocks.append({"type": "moe", "num_layers": 1, "model_dim": width, "tokens_per_sample": tokens, "num_experts": experts,
                       "top_k": min(experts, _int(rng, f.top_k)),
                       "expert_hidden_dim": int(width * float(rng.choice(f.expert_hidden_over_dim)))})
    tasks = ["ctr", "cvr", "engage"][: _int(rng, f.tasks)]
    blocks.append({"type": "heads", "tasks": tasks, "input_dim": width, "hidden_dims": [max(64, width // 2), max(32, width // 4)]})
    local = 8 * _int(rng, (f.local_batch[0] // 8, f.local_batch[1] // 8))
    w: dict = {
        "name": f"{family}-draw-{seed}",
        "description": f"drawn by coplan sample-workload --family {family} --seed {seed}",
        "sequences": [{"name": "history", "length": {"kind": "lognormal", "mean": round(mean, 1),
                                                       "sigma": round(float(rng.uniform(*f.history_sigma)), 3),
                                                       "min_len": int(rng.integers(1, 17)), "max_len": cap}}],
        "table_generator": _tables(rng, f, world),
        "blocks": blocks,
        "batch": {"global_batch_size": local * world, "micro_batches": "auto"} if world > 1 else
                 {"local_batch_size": local, "micro_batches": "auto"},
        "precision": {"compute_dtype": "bf16", "param_dtype": "fp32", "reduce_dtype": "fp32"},
        "optimizer": {"dense": "adamw", "dense_lr": 5e-4, "sparse": "rowwise_adagrad", "sparse_lr": 0.02},
        "kernels": {"attention": "triton", "embedding": "fused"},
    }
    w["table_generator"] = _fit_tables(w, f, world, topology.gpu.hbm_bytes)
    return Workload.model_validate(w)


def family_world(family: str, seed: int) -> int:
    """The GPU count ``sample_workload(family, seed)`` was drawn for."""
    f = _check(family, seed)
    rng = np.random.default_rng([int(seed), 23])
    return int(rng.choice(f.world_sizes))


__all__ = ["FAMILIES", "Family", "family_world", "sample_workload"]
