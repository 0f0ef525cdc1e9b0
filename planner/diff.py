"""``coplan diff a.json b.json``: what differs between two plans, and what each difference costs.

The differences are grouped by the choice they belong to: the mesh (degrees, micro-batches; the
tables' placement goes with it, since shard ranks are ranks of the sparse group), the tables'
sharding (same mesh), recompute, per-layer precision, the balancing policy and the kernel backends.
Each group is costed on its own: plan A with that one group taken from plan B, re-priced with the
cost model's full pricer, against plan A; the last line is B against A. The groups' costs need not add
up to the total (overlap and maxima interact), and the output says so. Both plans must be of the same
workload and topology (same hashes); the world size may differ only through the mesh.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass

from coplan.cli_args import nonempty_path
from coplan.costmodel import build_context, price
from coplan.errors import MismatchError
from coplan.spec import Plan, load_plan
from coplan.units import human_bytes


@dataclass(frozen=True, slots=True)
class Difference:
    """One group of differences and what it costs on its own."""

    group: str
    """'mesh', 'tables', 'recompute', 'precision', 'balancing' or 'kernels'."""
    lines: tuple[str, ...]
    """What differs, in words (A -> B)."""
    step_delta_s: float | None
    """Plan A with this group from B, minus plan A (None: it cannot be priced alone)."""
    memory_delta_bytes: float | None
    """Likewise for the fullest rank's memory."""
    fits: bool | None = None
    """Whether plan A with this group from B fits the usable HBM."""


def _price(plan: Plan):
    ctx = build_context(plan.workload, plan.topology, plan.mesh, plan.calibration, force_calibration=True)
    return price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=False)


def _layer_lines(a: Plan, b: Plan, attr: str, word: str) -> list[str]:
    la = {l.name: getattr(l, attr) for l in a.layers}
    lb = {l.name: getattr(l, attr) for l in b.layers}
    out = []
    for n in sorted(set(la) | set(lb)):
        if la.get(n) != lb.get(n):
            out.append(f"{n}: {word} {la.get(n)} -> {lb.get(n)}")
    return out


def differences(a: Plan, b: Plan) -> tuple[list[Difference], float, float]:
    """The grouped differences of ``b`` against ``a``, and B's step and memory minus A's."""
    if a.workload_sha256 != b.workload_sha256 or a.topology_sha256 != b.topology_sha256:
        raise MismatchError(f"the plans are of different inputs (workload '{a.workload.name}' vs '{b.workload.name}', topology "
                            f"'{a.topology.name}' vs '{b.topology.name}', or the same names with different contents): "
                            "coplan diff compares plans of one workload on one topology")
    ca, cb = _price(a), _price(b)
    out: list[Difference] = []

    def cost(group: str, lines: list[str], **update) -> None:
        if not lines:
            return
        try:
            c = _price(a.model_copy(update=update))
            out.append(Difference(group, tuple(lines), c.step_time_s - ca.step_time_s, c.memory.total - ca.memory.total, c.fits))
        except Exception:  # noqa: BLE001 - a group that cannot be priced alone is still listed, unpriced
            out.append(Difference(group, tuple(lines), None, None))

    ma, mb = a.mesh, b.mesh
    mesh_lines = []
    for k in ("dense_shard", "dense_replicate", "expert_parallel", "sparse_shard", "sparse_replicate"):
        if getattr(ma, k) != getattr(mb, k):
            mesh_lines.append(f"{k}: {getattr(ma, k)} -> {getattr(mb, k)}")
    if a.micro_batches != b.micro_batches:
        mesh_lines.append(f"micro_batches: {a.micro_batches} -> {b.micro_batches}")
    ta = {t.table: t for t in a.tables}
    tb = {t.table: t for t in b.tables}
    changed = [n for n in ta if n in tb and (ta[n].sharding_type, ta[n].ranks) != (tb[n].sharding_type, tb[n].ranks)]
    kinds = Counter((ta[n].sharding_type, tb[n].sharding_type) for n in changed)
    table_lines = [f"{n:,} tables {x} -> {y}" for (x, y), n in sorted(kinds.items(), key=lambda kv: -kv[1]) if x != y]
    moved = sum(1 for n in changed if ta[n].sharding_type == tb[n].sharding_type)
    if moved:
        table_lines.append(f"{moved:,} tables on other ranks (same sharding type)")
    if mesh_lines:
        # shard ranks are ranks of the sparse group: the mesh brings B's placement with it
        cost("mesh", mesh_lines + ([f"(with B's table placement: {len(changed):,} tables differ)"] if changed else []),
             mesh=mb, tables=b.tables, world_size=b.world_size)
    else:
        cost("tables", table_lines, tables=b.tables)
    rc = _layer_lines(a, b, "recompute", "recompute")
    cost("recompute", rc, layers=tuple(l.model_copy(update={"recompute": {x.name: x.recompute for x in b.layers}.get(l.name, l.recompute)})
                                       for l in a.layers))
    pr = _layer_lines(a, b, "precision", "precision")
    cost("precision", pr, layers=tuple(l.model_copy(update={"precision": {x.name: x.precision for x in b.layers}.get(l.name, l.precision)})
                                       for l in a.layers))
    if a.balancing.policy != b.balancing.policy:
        cost("balancing", [f"policy: {a.balancing.policy} -> {b.balancing.policy}"], balancing=b.balancing)
    kl = [f"{k}: {getattr(a.kernels, k)} -> {getattr(b.kernels, k)}" for k in ("attention", "embedding")
          if getattr(a.kernels, k) != getattr(b.kernels, k)]
    cost("kernels", kl, kernels=b.kernels)
    return out, cb.step_time_s - ca.step_time_s, cb.memory.total - ca.memory.total


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:+,.3f} ms"


def _mem(x: float | None) -> str:
    return "n/a" if x is None else ("+" if x >= 0 else "-") + human_bytes(abs(x))


def run_diff(args: argparse.Namespace) -> int:
    a, b = load_plan(args.a), load_plan(args.b)
    diffs, dstep, dmem = differences(a, b)
    if args.json:
        print(json.dumps({
            "a": args.a, "b": args.b,
            "a_step_time_s": a.predicted.step_time_s if a.predicted else None,
            "b_step_time_s": b.predicted.step_time_s if b.predicted else None,
            "step_delta_s": dstep, "memory_delta_bytes": dmem,
            "differences": [{"group": d.group, "lines": list(d.lines), "step_delta_s": d.step_delta_s,
                             "memory_delta_bytes": d.memory_delta_bytes, "fits": d.fits} for d in diffs],
        }, indent=1))
        return 0
    w = lambda *x: print(*x, file=sys.stdout)  # noqa: E731
    w(f"A: {args.a}  ({a.workload.name} on {a.world_size:,} GPUs of {a.topology.name})")
    w(f"B: {args.b}")
    if not diffs:
        w("the plans make the same choices")
    for d in diffs:
        fit = "" if d.fits is None or d.fits else "  (does NOT fit)"
        w(f"{d.group}: A with B's {d.group}: step {_ms(d.step_delta_s)}, memory {_mem(d.memory_delta_bytes)}{fit}")
        for line in d.lines[:12]:
            w(f"    {line}")
        if len(d.lines) > 12:
            w(f"    ... and {len(d.lines) - 12} more")
    w(f"B against A: step {_ms(dstep)}, memory {_mem(dmem)}"
      + ("  (each group costed alone on A; groups interact, so they need not add up to this)" if len(diffs) > 1 else ""))
    return 0


def register_diff(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("diff", help=help_text, description=help_text + ". " + (__doc__ or "").split("\n\n")[1])
    p.add_argument("a", type=nonempty_path, help="plan.json (the reference)")
    p.add_argument("b", type=nonempty_path, help="plan.json to compare with it")
    p.add_argument("--json", action="store_true", help="print the differences as JSON")
    p.set_defaults(func=run_diff)


__all__ = ["Difference", "differences", "register_diff", "run_diff"]
