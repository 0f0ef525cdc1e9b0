"""The text at the top of a report: the plan in one paragraph, the predicted MFU chain, the biggest loss
and what would recover it, plus one line each for a run and a calibration when given.

"What would recover it" is priced, not guessed, where the plan has a knob for it: recompute off,
another balancing policy, the Triton attention kernels, fp8 GEMMs. The plan is re-priced by the cost
model with that one choice changed, and the summary quotes the new step time, goodput MFU and whether
it still fits in HBM. Losses without such a knob (exposed communication, checkpointing, failures) get
the lever that addresses them, worded as a suggestion, with the size of the loss as the upper bound
of what it can return.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from coplan.costmodel.flops import layer_names
from coplan.reports.inputs import price_plan
from coplan.reports.layout import fmt_bytes, fmt_pct, fmt_s
from coplan.reports.ledger import Ledger, Loss
from coplan.spec import LayerPlan, Plan, Prediction


@dataclass(frozen=True, slots=True)
class WhatIf:
    """The plan re-priced with one choice changed."""

    change: str
    step_time_s: float
    goodput_mfu: float
    peak_memory_bytes: float
    hbm_bytes: float

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.hbm_bytes


def _reprice(plan: Plan, change: str, **update) -> WhatIf | None:
    try:
        c = price_plan(plan.model_copy(update=update)).cost
    except Exception:  # noqa: BLE001 - a what-if that cannot be priced is simply not quoted
        return None
    return WhatIf(change, c.step_time_s, c.goodput_mfu, c.memory.total, c.usable_hbm_bytes)


def what_if(plan: Plan, loss: Loss) -> WhatIf | None:
    """Re-price the plan with the one choice that addresses ``loss``, when the plan has such a choice."""
    k = loss.key
    if k == "recompute":
        layers = tuple(lp.model_copy(update={"recompute": False}) for lp in plan.layers)
        return _reprice(plan, "recompute off in every layer", layers=layers)
    if k == "imbalance":
        for pol in ("karmarkar_karp", "greedy"):
            if pol != plan.balancing.policy:
                return _reprice(plan, f"'{pol}' balancing", balancing=plan.balancing.model_copy(update={"policy": pol}))
        return None
    if k == "kernel.attention" and plan.kernels.attention != "triton":
        return _reprice(plan, "the Triton attention kernels", kernels=plan.kernels.model_copy(update={"attention": "triton"}))
    if k == "kernel.gemm" and plan.workload.precision.fp8 != "off":
        rec = {lp.name: lp.recompute for lp in plan.layers}
        layers = tuple(LayerPlan(name=n, recompute=rec.get(n, False), precision="fp8") for n in layer_names(plan.workload))
        return _reprice(plan, "fp8 GEMMs in every layer that allows them", layers=layers)
    return None


def lever(loss: Loss, plan: Plan, pred: Prediction) -> str:
    """The usual way to win back this kind of loss (a suggestion, not a prediction)."""
    k = loss.key
    if k.startswith("kernel."):
        c = k.split(".", 1)[1]
        return {
            "gemm": "larger GEMMs per rank (a bigger local batch), fp8 where the workload allows it, or a calibration on this GPU if the default efficiency is pessimistic",
            "attention": "a faster jagged-attention kernel or fewer padded tiles; the share of attention grows with the square of the history length",
            "embedding": "spreading the hottest tables (row-wise or table-row-wise) so that the slowest shard's lookups shrink toward the mean",
            "elementwise": "fusing norms, activations and residual adds (torch.compile) and fewer kernel launches",
        }.get(c, "faster kernels")
    if k == "imbalance":
        return ("a balancer that equalises per-rank cost (Karmarkar-Karp), more samples per rank, or larger balance groups "
                "(less spread between the groups' shares, more rows for each rank's data loader to read)")
    if k == "recompute":
        return "recomputing fewer layers, which needs the activation memory it saves"
    if k == "optimizer":
        return "a fused (foreach) optimizer step"
    if k == "unpriced_device":
        return ("fewer small kernels outside the model's ops (fused optimizer and casts, CUDA graphs), measured on "
                "this GPU by the calibration's runs")
    if k.startswith("comm."):
        base = k[len("comm."):].rsplit(".", 1)[0]  # comm.<collective name>.<tiers>; tier names hold no dots
        if base == "sparse.replica_sync":
            return ("syncing the sparse replicas less often (the cost model amortises one all-reduce of every shard's weights and "
                    "optimizer state over its sync interval) or fewer replicas: a larger sparse shard group")
        if base == "sparse.dp_all_reduce":
            return "sharding the data-parallel tables (table- or row-wise) so their gradients stop being all-reduced over the world"
        if base.startswith("sparse.") and "all_to_all" in base:
            return ("fewer bytes in the embedding all-to-all: a smaller sparse shard group kept inside the faster tiers "
                    "(more sparse replicas), lower-precision embedding communication, or overlapping it with the previous batch's compute")
        if base.startswith("expert_"):
            return "sharding the experts' weights over fewer ranks (a larger expert-parallel degree) so their gathers and gradient reductions shrink"
        if base.startswith("fsdp"):
            return "keeping the FSDP shard group inside NVLink or prefetching further ahead so the gathers hide under compute"
        if base == "replicate_all_reduce":
            return "fewer HSDP replicas (a larger shard group) or more micro-batches per step to amortise the gradient all-reduce"
        if base.startswith("ep_"):
            return "a smaller expert-parallel group inside NVLink or overlapping dispatch with shared-expert compute"
        return "more overlap of this collective with compute"
    if k == "checkpoint":
        return f"asynchronous checkpointing (the write blocks {fmt_s(pred.checkpoint_write_s)} every {fmt_s(pred.checkpoint_interval_s)}) or faster storage"
    if k == "jitter":
        return ("fewer stragglers: steadier per-rank step times (pinned host threads, no co-tenants, balanced jagged "
                "batches), or fewer synchronous ranks per step; it grows with the log of the rank count")
    if k == "host":
        return ("less host work per step: CUDA graphs of the dense arch (one GPU, Triton attention, no FP8 layer), larger "
                "micro-batches (fewer launches per sample), or fewer, larger embedding tables (TorchRec's host work grows with "
                "the feature count)")
    if k == "loader":
        return ("a faster data path: more reader processes (more host cores per GPU: the topology's cpu_cores_per_node), "
                "fewer values per sample (shorter histories, fewer pooled ids), or a larger step per sample")
    if k == "failures":
        return "faster restarts (in-memory checkpoints, hot spares): expected lost work and restarts grow with the GPU count"
    return "a closer look at the cost model's breakdown"


def describe_plan(plan: Plan) -> str:
    """The plan in one paragraph."""
    m = plan.mesh
    t = plan.topology
    axes = {a.name: a for a in m.axes}
    tiers = lambda n: f" over {'+'.join(axes[n].tiers)}" if n in axes and axes[n].size > 1 else ""  # noqa: E731
    parts = [f"'{plan.workload.name}' on {plan.world_size:,} × {t.gpu.name} of '{t.name}'"]
    dense = f"dense HSDP: FSDP shards of {m.dense_shard:,}{tiers('dp_shard')} × {m.dense_replicate:,} replica(s){tiers('dp_replicate')}"
    if m.expert_parallel > 1:
        dense += f", {m.expert_parallel}-way expert parallel"
    parts.append(dense)
    if plan.tables:
        kinds = Counter(ts.sharding_type for ts in plan.tables)
        mix = ", ".join(f"{n:,} {k.replace('_', '-')}" for k, n in kinds.most_common())
        parts.append(f"{len(plan.tables):,} embedding tables sharded over groups of {m.sparse_shard:,} rank{'s' if m.sparse_shard > 1 else ''}{tiers('sparse_shard')} "
                     f"× {m.sparse_replicate:,} replica(s) ({mix})")
    n_rec = sum(1 for lp in plan.layers if lp.recompute)
    n_fp8 = sum(1 for lp in plan.layers if lp.precision == "fp8")
    n_layers = len(layer_names(plan.workload))
    parts.append(f"{n_rec} of {n_layers} layers recomputed" + (f", {n_fp8} in fp8" if n_fp8 else ""))
    grp = f" within groups of {plan.balancing.group_ranks:,} ranks" if plan.balancing.group_ranks else ""
    parts.append(f"'{plan.balancing.policy}' jagged balancing{grp}, {plan.kernels.attention} attention, {plan.kernels.embedding} embeddings")
    s = plan.solver
    if s is not None:
        if s.status == "GIVEN":
            solver = "every choice given (priced, not searched)"
        else:
            solver = f"chosen by {'the heuristic (no solver ran)' if s.status == 'HEURISTIC' else f'CP-SAT ({s.status}, gap {fmt_pct(s.gap, 2)})'}"
        parts.append(solver)
    parts.append(describe_calibration(plan))
    return "Plan: " + "; ".join(parts) + "."


def describe_calibration(plan: Plan) -> str:
    """Which calibration priced the plan: its device, date, the commit its runs ran at and its fit error."""
    c = plan.calibration
    if c is None:
        return "priced uncalibrated (default efficiencies; the host's time is not priced)"
    bits = [f"fitted {c.created_utc[:10]}" if c.created_utc else "fit date unknown"]
    if c.versions.get("coplan_git_commit"):
        bits.append(f"runs at commit {c.versions['coplan_git_commit'][:7]}")
    if c.source_runs:
        bits.append(f"{len(c.source_runs)} run(s)")
    if c.fit_error is not None:
        bits.append(f"per-op fit error median {fmt_pct(c.fit_error.median_abs_rel_error)}")
    if c.host_launch_s:
        bits.append(f"host {c.host_launch_s * 1e6:.0f} µs per priced launch")
    if c.host_launch_graphed_s:
        bits.append(f"{c.host_launch_graphed_s * 1e6:.0f} µs under CUDA graphs")
    return f"priced with a calibration for {c.device} ({', '.join(bits)})"


def describe_prediction(pred: Prediction) -> str:
    usable = pred.hbm_capacity_bytes - pred.hbm_reserve_bytes
    mem = (f"peak memory {fmt_bytes(pred.peak_memory_bytes)} of {fmt_bytes(usable)} usable HBM "
           f"({fmt_bytes(pred.hbm_capacity_bytes)} less a {fmt_bytes(pred.hbm_reserve_bytes)} reserve)"
           + ("" if pred.peak_memory_bytes <= usable or not pred.hbm_capacity_bytes else " — it does NOT fit"))
    return (f"Predicted: step {fmt_s(pred.step_time_s)}; local MFU {fmt_pct(pred.local_mfu)} × scaling ratio {fmt_pct(pred.scaling_ratio, 1)} "
            f"= E2E MFU {fmt_pct(pred.e2e_mfu)}; goodput {fmt_pct(pred.goodput, 2)} after checkpoints and failures "
            f"→ goodput MFU {fmt_pct(pred.goodput_mfu)}; {mem}.")


def describe_losses(plan: Plan, pred: Prediction, ledger: Ledger, *, price_what_if: bool = True) -> str:
    items = sorted((x for x in ledger.losses if x.key != "other"), key=lambda x: -x.seconds)
    if not items:
        return ""
    big = items[0]
    pts = ledger.points(big.seconds)
    text = (f"Biggest loss: {big.label}, {pts:.2f} MFU points ({fmt_s(big.seconds)} of every {fmt_s(ledger.wall_step_s)} step). "
            f"What would recover it: {lever(big, plan, pred)}.")
    wi = what_if(plan, big) if price_what_if else None
    if wi is not None:
        text += (f" Re-priced with {wi.change}: step {fmt_s(wi.step_time_s)}, goodput MFU {fmt_pct(wi.goodput_mfu)} "
                 f"(now {fmt_pct(pred.goodput_mfu)}), peak memory {fmt_bytes(wi.peak_memory_bytes)}"
                 + (" — fits in HBM." if wi.fits else f" — over the {fmt_bytes(wi.hbm_bytes)} HBM, so not an option as is."))
    nxt = ", ".join(f"{x.label} ({ledger.points(x.seconds):.2f})" for x in items[1:4])
    if nxt:
        text += f" Next: {nxt}."
    other = next((x for x in ledger.losses if x.key == "other"), None)
    if other is not None and abs(ledger.points(other.seconds)) >= 0.5:
        text += f" {ledger.points(other.seconds):.2f} points are not attributed to any item by the cost model."
    return text


__all__ = ["WhatIf", "describe_losses", "describe_plan", "describe_prediction", "lever", "what_if"]
