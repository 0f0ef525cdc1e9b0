"""Hypothesis strategies for valid topology and workload documents (plain dicts, as read from YAML)."""

from __future__ import annotations

from hypothesis import strategies as st

from coplan.spec.topology import MAX_GPUS

COLLS = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]
names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)
# within the plausibility bounds of coplan.spec.topology (a value outside them is refused, by design)
flops = st.floats(min_value=1e9, max_value=1e19)
hbm = st.floats(min_value=1e8, max_value=1e14)
hbm_bw = st.floats(min_value=1e9, max_value=1e15)
link_bw = st.floats(min_value=1e6, max_value=1e20)
storage_bw = st.floats(min_value=1e6, max_value=1e18)
hours = st.floats(min_value=0.1, max_value=1e12)
frac = st.floats(min_value=0.01, max_value=1.0, allow_nan=False)


@st.composite
def topology_docs(draw) -> dict:
    n_tiers = draw(st.integers(1, 4))
    tier_names = draw(st.lists(names, min_size=n_tiers, max_size=n_tiers, unique=True))
    sizes, total = [], 1
    for _ in range(n_tiers):  # valid documents stay within MAX_GPUS (a larger cluster is a typed error)
        size = draw(st.sampled_from([s for s in (1, 2, 4, 8, 16, 72) if total * s <= MAX_GPUS]))
        sizes.append(size)
        total *= size
    tiers = []
    below = 1
    for name, size in zip(tier_names, sizes):
        group = below * size
        divisors = [d for d in (1, 2, 4, 8) if group % d == 0]
        tier = {
            "name": name,
            "size": size,
            "bw_bytes_per_s": draw(link_bw),
            "latency_s": draw(st.floats(min_value=0, max_value=1e-3)),
            "oversubscription": draw(st.floats(min_value=1, max_value=16)),
            "gpus_per_nic": draw(st.sampled_from(divisors)),
            "collective_efficiency": draw(st.dictionaries(st.sampled_from(COLLS), frac, max_size=5)),
            "in_switch_reduction": draw(st.booleans()),
            "sm_free_comm": draw(st.booleans()),
        }
        if draw(st.booleans()):
            tier["mtbf_hours"] = draw(hours)
        tiers.append(tier)
        below = group
    first = sizes[0]
    gpn = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 72, 144) if first % d == 0 or d % first == 0]))
    peaks = {"bf16": draw(flops)}
    peaks.update(draw(st.dictionaries(st.sampled_from(["fp32", "tf32", "fp16", "fp8"]), flops, max_size=4)))
    return {
        "name": draw(names),
        "description": draw(st.text(max_size=20)).strip(),
        "gpu": {
            "name": draw(names),
            "peak_flops_per_s": peaks,
            "hbm_bytes": draw(hbm),
            "hbm_bw_bytes_per_s": draw(hbm_bw),
            "num_sms": draw(st.integers(1, 256)),
        },
        "gpus_per_node": gpn,
        "tiers": tiers,
        "reliability": {
            "gpu_mtbf_hours": draw(hours),
            "restart_s": draw(st.floats(min_value=0, max_value=1e5)),
            "checkpoint_bw_bytes_per_s_per_node": draw(storage_bw),
        },
    }


def _length(draw) -> dict:
    kind = draw(st.sampled_from(["fixed", "lognormal", "uniform", "empirical"]))
    if kind == "fixed":
        return {"kind": "fixed", "length": draw(st.integers(1, 8192))}
    if kind == "lognormal":
        lo = draw(st.integers(0, 16))
        hi = draw(st.integers(max(lo, 1), 8192))
        return {
            "kind": "lognormal",
            "mean": draw(st.floats(min_value=max(lo, 1), max_value=min(hi, 5000))),  # within floor and cap
            "sigma": draw(st.floats(min_value=0.05, max_value=2)),
            "min_len": lo,
            "max_len": hi,
        }
    if kind == "uniform":
        lo = draw(st.integers(0, 100))
        return {"kind": "uniform", "min_len": lo, "max_len": draw(st.integers(max(lo, 1), 8192))}
    return {"kind": "empirical", "lengths": draw(st.lists(st.integers(0, 4096), min_size=1, max_size=8))}


@st.composite
def workload_docs(draw) -> dict:
    seq_names = draw(st.lists(names, min_size=0, max_size=2, unique=True))
    sequences = [{"name": n, "length": _length(draw)} for n in seq_names]
    tables = []
    for i in range(draw(st.integers(0, 4))):
        t = {
            "name": f"tab{i}",
            "num_rows": draw(st.integers(1, 10**9)),
            "dim": draw(st.sampled_from([4, 8, 16, 64, 128])),
            "pooling_factor": draw(st.floats(min_value=0.1, max_value=100)),
            "zipf_alpha": draw(st.floats(min_value=0, max_value=2)),
            "dtype": draw(st.sampled_from(["fp32", "fp16", "bf16", "int8"])),
        }
        if seq_names and draw(st.booleans()):
            t["feature_kind"] = "sequence"
            t["sequence"] = draw(st.sampled_from(seq_names))
        tables.append(t)
    d = draw(st.sampled_from([8, 16, 64]))
    # trainable (what a file must be, as ``coplan train`` builds it): the dense MLP's last width is the token
    # width the heads and MoE read, and the history an interformer runs over has a sequence table
    blocks: list[dict] = [
        {"type": "dense_mlp", "num_dense_features": draw(st.integers(1, 64)), "hidden_dims": [draw(st.integers(1, 512)), d]}
    ]
    if seq_names:
        seq = draw(st.sampled_from(seq_names))
        if not any(t.get("sequence") == seq for t in tables):
            tables.append({"name": f"tab{len(tables)}", "num_rows": 100, "dim": 8, "feature_kind": "sequence", "sequence": seq})
        blocks.append(
            {
                "type": "interformer",
                "sequence": seq,
                "num_layers": draw(st.integers(1, 4)),
                "model_dim": d,
                "num_heads": 2,
                "head_dim": d // 2,
                "attention": {
                    "kind": draw(st.sampled_from(["gdpa", "softmax"])),
                    "activation": draw(st.sampled_from(["silu", "gelu_tanh", "relu", "relu2", "identity"])),
                    "causal": draw(st.booleans()),
                },
            }
        )
    if draw(st.booleans()):
        e = draw(st.integers(1, 16))
        blocks.append(
            {"type": "moe", "model_dim": d, "tokens_per_sample": 1, "num_experts": e, "top_k": draw(st.integers(1, e)), "expert_hidden_dim": 32}
        )
    blocks.append({"type": "heads", "input_dim": d, "hidden_dims": [16]})
    batch = {"global_batch_size": draw(st.integers(1, 10**6))} if draw(st.booleans()) else {"local_batch_size": draw(st.integers(1, 4096))}
    doc = {"name": draw(names), "sequences": sequences, "tables": tables, "blocks": blocks, "batch": batch}
    if draw(st.booleans()):
        doc["table_generator"] = {"seed": draw(st.integers(0, 2**31)), "num_tables": draw(st.integers(1, 20))}
    return doc
