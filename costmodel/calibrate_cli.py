"""``coplan calibrate``: fit the cost model to the traces of runs and write a Calibration."""

from __future__ import annotations

import argparse
import json

from coplan.spec import dump_spec


def run_calibrate(args: argparse.Namespace) -> int:
    from coplan.costmodel.calibrate import calibrate

    cal, res, runs = calibrate(args.runs, rank=args.rank, force=args.force)
    dump_spec(cal, args.output)
    fe = cal.fit_error
    if args.json:
        print(json.dumps({"output": args.output, "calibration": cal.model_dump(mode="json"),
                          "runs": [{"run": r.run, "attributed_share": r.attributed_share, "unattributed_s": r.unattributed_s,
                                    "samples": len(r.samples)} for r in runs]}, indent=1))
        return 0
    print(f"calibrated '{cal.device}' from {len(runs)} run(s), {fe.num_samples} (op, phase) samples")
    for r in runs:
        print(f"  {r.run}: {r.attributed_share:.1%} of traced time attributed to cost-model ops "
              f"({r.unattributed_s * 1e3:.2f} ms unattributed of {r.total_s * 1e3:.2f} ms)")
    print(f"{'class':<12} {'compute eff':>12} {'memory eff':>11} {'launch us':>10} {'error':>7}")
    for cls, oc in cal.op_classes.items():
        ce = ", ".join(f"{dt} {v:.3f}" for dt, v in oc.compute_efficiency.items()) or "-"
        me = f"{oc.memory_efficiency:.3f}" if oc.memory_efficiency is not None else "-"
        la = f"{oc.launch_overhead_s * 1e6:.2f}" if oc.launch_overhead_s is not None else "-"
        err = fe.per_op_class.get(cls)
        print(f"{cls:<12} {ce:>12} {me:>11} {la:>10} {('%.1f%%' % (100 * err)) if err is not None else '-':>7}")
    print(f"per-op error: median {fe.median_abs_rel_error:.1%}, max {fe.max_abs_rel_error:.1%}")
    print(f"wrote {args.output}")
    return 0


def register_calibrate(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("calibrate", help=help_text, description=help_text + ".")
    p.add_argument("runs", nargs="+", help="run directories written by `coplan train` (runs/<id>/)")
    p.add_argument("-o", "--output", default="calibration.json", help="where to write the Calibration (default: calibration.json)")
    p.add_argument("--rank", type=int, default=0, help="whose trace to fit (default: 0)")
    p.add_argument("--force", action="store_true", help="fit runs from different devices together")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_calibrate)
