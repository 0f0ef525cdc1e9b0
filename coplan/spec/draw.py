"""Seeded random workloads and (topology, world size) pairs, for property tests and generalisation
benchmarks: the class of inputs coplan must handle, not the presets it was tuned on.

Every draw is a pure function of its seed (numpy ``default_rng(seed)``), so a failing case is
reproduced from the seed alone; benchmarks take the seed at run time and report it.

Kinds:

- ``hybrid``: GEM-shaped (dense features, an optional jagged or fixed history with sequence tables and
  InterFormer layers, Kunlun interaction, an optional MoE layer, multi-task heads) over pooled and
  sequence tables;
- ``sparse``: DLRM-shaped, sparse-heavy (many pooled tables, a dense MLP, dot interaction, one head);
- ``dense``: a decoder-only transformer over a fixed or jagged token sequence, no tables.

Sizes: ``cpu`` draws models that train on a CPU in seconds (rows in the hundreds to thousands, widths
8-64, fp32, the reference attention); ``cluster`` draws production-scale ones for the planner (table
sets of 50-1,200 generated tables, widths 256-4,096, bf16), whose batch splits evenly over the world
size they are drawn for.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from coplan.spec.topology import Topology
from coplan.spec.workload import Workload

Kind = Literal["hybrid", "sparse", "dense"]
Size = Literal["cpu", "cluster"]
KINDS: tuple[str, ...] = ("hybrid", "sparse", "dense")


def _length(rng: np.random.Generator, max_cap: int, jagged: bool) -> dict:
    if not jagged:
        return {"kind": "fixed", "length": int(rng.integers(max(2, max_cap // 8), max_cap + 1))}
    mean = float(rng.uniform(max_cap / 16, max_cap / 3))
    return {"kind": "lognormal", "mean": round(mean, 2), "sigma": round(float(rng.uniform(0.3, 1.2)), 3),
            "min_len": int(rng.integers(0, 2)), "max_len": int(max_cap)}


def _heads(rng: np.random.Generator, width: int, cpu: bool) -> dict:
    tasks = ["ctr", "cvr", "engage"][: int(rng.integers(1, 4))]
    hidden = [int(rng.choice([16, 32]))] if cpu else [int(rng.choice([256, 512])), 128]
    return {"type": "heads", "tasks": tasks, "input_dim": width, "hidden_dims": hidden}


def _hybrid(rng: np.random.Generator, cpu: bool, name: str) -> dict:
    width = int(rng.choice([16, 32])) if cpu else int(rng.choice([256, 512, 1024, 2048]))
    head_dim = int(rng.choice([8, 16])) if cpu else int(rng.choice([64, 128]))
    heads = max(1, width // head_dim // int(rng.choice([1, 2])))
    jagged = bool(rng.random() < 0.75)
    cap = int(rng.choice([16, 32, 64])) if cpu else int(rng.choice([512, 1024, 2048, 4096]))
    has_seq = bool(rng.random() < 0.8)
    w: dict = {"name": name, "description": f"random hybrid ({'cpu' if cpu else 'cluster'})"}
    tables: list[dict] = []
    if cpu:
        n_pooled = int(rng.integers(1, 7))
        for i in range(n_pooled):
            tables.append({"name": f"p{i}", "num_rows": int(rng.integers(16, 3000)), "dim": int(rng.choice([8, 16, 32, 64])),
                           "pooling_factor": round(float(rng.uniform(1, 5)), 2), "zipf_alpha": round(float(rng.uniform(0, 1.3)), 3),
                           "dtype": "fp32"})
        if has_seq:
            for i in range(int(rng.integers(1, 3))):
                tables.append({"name": f"s{i}", "num_rows": int(rng.integers(16, 2000)), "dim": int(rng.choice([8, 16, 32])),
                               "feature_kind": "sequence", "sequence": "history", "zipf_alpha": round(float(rng.uniform(0, 1.3)), 3),
                               "dtype": "fp32"})
        w["tables"] = tables
    else:
        n = int(rng.integers(50, 1201))
        gen = {"seed": int(rng.integers(0, 2**31 - 1)), "num_tables": n, "min_rows": int(10 ** rng.uniform(2, 4)),
               "max_rows": int(10 ** rng.uniform(6, 9)), "dims": [64, 128, 256], "dim_weights": [0.3, 0.5, 0.2],
               "pooling_mean": round(float(rng.uniform(2, 30)), 2), "pooling_sigma": round(float(rng.uniform(0.3, 1.5)), 3),
               "dtype": str(rng.choice(["fp16", "fp32", "int8"]))}
        if has_seq:
            gen |= {"num_sequence_tables": int(rng.integers(1, min(16, n) + 1)), "sequence": "history"}
        w["table_generator"] = gen
    blocks: list[dict] = [{"type": "dense_mlp", "num_dense_features": int(rng.integers(4, 64)),
                           "hidden_dims": [int(rng.choice([16, 32]))] if cpu else [512, 256], "out_tokens": int(rng.integers(1, 3))}]
    summaries = 0
    if has_seq:
        w["sequences"] = [{"name": "history", "length": _length(rng, cap, jagged)}]
        summaries = int(rng.integers(1, 4))
        blocks.append({"type": "interformer", "sequence": "history", "num_layers": int(rng.integers(1, 3 if cpu else 9)),
                       "model_dim": width, "num_heads": heads, "head_dim": head_dim,
                       "attention": {"kind": "gdpa", "activation": str(rng.choice(["silu", "gelu_tanh", "relu"])),
                                     "causal": bool(rng.random() < 0.7), "scale": "inv_max_len"},
                       "ffn_multiplier": float(rng.choice([2.0, 4.0])), "num_summary_tokens": summaries})
    pooled_tokens = int(rng.integers(2, 6)) if cpu else int(rng.integers(8, 64))
    blocks.append({"type": "kunlun", "num_layers": int(rng.integers(1, 3 if cpu else 7)), "num_tokens": pooled_tokens,
                   "model_dim": width, "num_heads": heads, "head_dim": head_dim, "ffn_multiplier": float(rng.choice([2.0, 4.0]))})
    if rng.random() < 0.5:
        experts = int(rng.choice([2, 4, 8])) if cpu else int(rng.choice([8, 16, 32, 64]))
        blocks.append({"type": "moe", "num_layers": 1, "model_dim": width, "tokens_per_sample": int(rng.integers(1, pooled_tokens + 1)),
                       "num_experts": experts, "top_k": int(rng.integers(1, min(experts, 4) + 1)),
                       "expert_hidden_dim": 2 * width})
    blocks.append(_heads(rng, width, cpu))
    w["blocks"] = blocks
    return w


def _sparse(rng: np.random.Generator, cpu: bool, name: str) -> dict:
    dim = int(rng.choice([8, 16, 32])) if cpu else int(rng.choice([64, 128]))
    w: dict = {"name": name, "description": f"random DLRM-shaped, sparse-heavy ({'cpu' if cpu else 'cluster'})"}
    if cpu:
        n = int(rng.integers(4, 17))
        w["tables"] = [{"name": f"t{i}", "num_rows": int(rng.integers(8, 4000)), "dim": dim,
                        "pooling_factor": round(float(rng.uniform(1, 8)), 2), "zipf_alpha": round(float(rng.uniform(0, 1.3)), 3),
                        "dtype": "fp32"} for i in range(n)]
    else:
        n = int(rng.integers(50, 1001))
        w["table_generator"] = {"seed": int(rng.integers(0, 2**31 - 1)), "num_tables": n, "min_rows": 100,
                                "max_rows": int(10 ** rng.uniform(6, 8.5)), "dims": [dim], "dim_weights": [1.0],
                                "pooling_mean": round(float(rng.uniform(2, 30)), 2), "pooling_sigma": round(float(rng.uniform(0.3, 1.5)), 3),
                                "dtype": str(rng.choice(["fp16", "fp32"]))}
    top = [int(rng.choice([16, 32])), 8] if cpu else [1024, 512, 256]
    w["blocks"] = [
        {"type": "dense_mlp", "num_dense_features": int(rng.integers(4, 32)), "hidden_dims": [int(rng.choice([16, 32])), dim] if cpu else [512, 256, dim],
         "out_tokens": 1},
        {"type": "dot_interaction", "num_tokens": n + 1, "dim": dim, "top_hidden_dims": top},
        {"type": "heads", "tasks": ["ctr"], "input_dim": top[-1], "hidden_dims": [1]},
    ]
    return w


def _dense(rng: np.random.Generator, cpu: bool, name: str) -> dict:
    head_dim = int(rng.choice([8, 16])) if cpu else int(rng.choice([64, 128]))
    heads = int(rng.choice([2, 4])) if cpu else int(rng.choice([8, 16, 32]))
    kv = int(rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0 and d <= heads]))
    width = heads * head_dim
    cap = int(rng.choice([16, 32, 64])) if cpu else int(rng.choice([2048, 4096, 8192]))
    jagged = bool(rng.random() < 0.3)
    return {
        "name": name, "description": f"random decoder-only transformer ({'cpu' if cpu else 'cluster'})",
        "sequences": [{"name": "tokens", "length": _length(rng, cap, jagged)}],
        "blocks": [{"type": "transformer", "sequence": "tokens", "num_layers": int(rng.integers(1, 4 if cpu else 41)),
                    "model_dim": width, "num_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
                    "ffn_hidden_dim": int(width * float(rng.choice([2.0, 2.75, 3.5]))) // 8 * 8,
                    "ffn_kind": str(rng.choice(["swiglu", "gelu"])), "vocab_size": int(rng.choice([64, 256])) if cpu else int(rng.choice([32000, 128256])),
                    "attention": {"kind": "softmax", "causal": True, "scale": "inv_sqrt_head_dim"}}],
    }


def random_workload(seed: int, kind: Kind | None = None, size: Size = "cpu", *, world_size: int = 1,
                    optimizer: dict | None = None) -> Workload:
    """A seeded random workload of ``kind`` (drawn when None). Its batch splits evenly over ``world_size``
    GPUs (a global batch of ``world_size ×`` the local batch, or a local batch). ``optimizer`` overrides
    the drawn optimizer fields (e.g. ``{"dense": "sgd", "sparse": "sgd"}`` for equivalence tests)."""
    rng = np.random.default_rng(seed)
    k = str(rng.choice(KINDS)) if kind is None else kind
    if k not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {k!r}")
    cpu = size == "cpu"
    name = f"random-{k}-{seed}"
    w = {"hybrid": _hybrid, "sparse": _sparse, "dense": _dense}[k](rng, cpu, name)
    if cpu:
        local = int(rng.choice([2, 4, 8, 16]))
        micro = int(rng.choice([1, 1, 2]))
    else:
        local = {"hybrid": int(rng.choice([32, 64, 128, 256])), "sparse": int(rng.choice([64, 128, 256, 512])),
                 "dense": int(rng.choice([1, 2, 4]))}[k]
        micro = "auto" if rng.random() < 0.3 else 1
    if micro != "auto" and local % micro:
        micro = 1
    if rng.random() < 0.5:
        w["batch"] = {"global_batch_size": local * world_size, "micro_batches": micro}
    else:
        w["batch"] = {"local_batch_size": local, "micro_batches": micro}
    if cpu:
        w["precision"] = {"compute_dtype": "fp32", "param_dtype": "fp32", "reduce_dtype": "fp32"}
        w["kernels"] = {"attention": "reference", "embedding": "fused"}
        opt = {"dense": str(rng.choice(["adamw", "sgd", "adagrad"])), "dense_lr": 0.003,
               "sparse": str(rng.choice(["rowwise_adagrad", "sgd"])), "sparse_lr": 0.05}
    else:
        w["precision"] = {"compute_dtype": "bf16", "param_dtype": "fp32", "reduce_dtype": "fp32"}
        w["kernels"] = {"attention": "triton" if k != "dense" else "flex", "embedding": "fused"}
        opt = {"dense": str(rng.choice(["adamw", "adagrad"])), "sparse": "rowwise_adagrad"}
    opt |= optimizer or {}
    w["optimizer"] = opt
    return Workload.model_validate(w)


# Presets a pair may be drawn on, with the GPU counts each offers (first N GPUs of the topology).
_TOPOLOGY_PRESETS = ("h200-1gpu", "h200-hgx-2gpu", "h200-superpod-1k", "h200-superpod-4k", "meta-roce-24k", "gb200-nvl72-16k")


def random_world(rng: np.random.Generator, topology: Topology, max_gpus: int = 16_384) -> int:
    """A GPU count of ``topology`` the planner accepts: up to one node, or whole nodes; log-uniform."""
    node = topology.gpus_per_node
    top = min(topology.num_gpus, max_gpus)
    if top <= node:
        return int(rng.choice([d for d in range(1, top + 1) if top % d == 0 or d <= node]))
    x = int(round(2 ** rng.uniform(0, np.log2(top))))
    if x > node:
        x = max(node, x // node * node)
    return int(min(top, max(1, x)))


def random_pair(seed: int, kind: Kind | None = None, *, max_gpus: int = 16_384) -> tuple[Workload, Topology, int]:
    """A seeded (workload, topology, world size) at cluster scale: a preset topology, a GPU count of it
    (1 to ``max_gpus``) and a workload of ``kind`` whose batch splits over that count."""
    from coplan.spec.loader import load_topology

    rng = np.random.default_rng([seed, 7])
    name = str(rng.choice(_TOPOLOGY_PRESETS))
    topology = load_topology(name)
    world = random_world(rng, topology, max_gpus)
    return random_workload(seed, kind, "cluster", world_size=world), topology, world


__all__ = ["KINDS", "random_pair", "random_workload", "random_world"]
