"""``coplan calibrate``: fit the cost model to the traces of runs and/or a collective sweep, and write a
Calibration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coplan.calibration import fingerprint
from coplan.calibration.assemble import calibrate
from coplan.calibration.collective_fit import apply_to_topology, fit_sweep, load_sweep, merge_into_calibration
from coplan.cli_args import check_output, non_negative_int, nonempty, nonempty_path, nonempty_str, removed_on_failure
from coplan.errors import CoplanError
from coplan.spec import dump_spec, load_calibration, load_topology


def run_calibrate(args: argparse.Namespace) -> int:
    if not args.runs and not args.collectives:
        raise CoplanError("coplan calibrate: give run directories (runs/<id>/), --collectives SWEEP.json, or both")
    inputs = (*args.runs, args.collectives, args.base, args.topology, args.apply_to)
    out_cal = check_output(args.output, "-o", inputs)
    out_topo = None
    if args.apply_to:
        if not args.collectives:
            raise CoplanError("--apply-to writes the collective fit into a topology: give --collectives SWEEP.json with it")
        out_topo = check_output(args.topology_out or f"{load_topology(args.apply_to).name}-calibrated.yaml", "--topology-out",
                                (*inputs, out_cal))
        args = argparse.Namespace(**{**vars(args), "topology_out": str(out_topo)})
    with removed_on_failure(out_cal, out_topo):
        return _calibrate(args)


def _calibrate(args: argparse.Namespace) -> int:
    cal = None
    report: dict = {"output": args.output}
    if args.runs:
        base = load_calibration(args.base) if args.base else None
        cal, _res, runs = calibrate(args.runs, rank=args.rank, force=args.force, host=args.host_cost or args.host_speed,
                                    host_speed=args.host_speed, base=base, base_name=str(args.base) if args.base else "the base",
                                    device_term=args.device_term)
        report["runs"] = [{"run": r.run, "attributed_share": r.attributed_share, "unattributed_s": r.unattributed_s,
                           "samples": len(r.samples), **({"notes": list(r.notes)} if r.notes else {})} for r in runs]
        if not args.json:
            _print_runs(cal, runs)
    elif args.base:
        cal = load_calibration(args.base)
    if args.collectives:
        sweep = load_sweep(args.collectives)
        topo = load_topology(args.topology)
        dtypes = args.dtypes.split(",") if args.dtypes else None
        fit = fit_sweep(sweep, topo, args.tier, dtypes=dtypes)
        cal = merge_into_calibration(fit, cal, tier=args.tier)
        report["collectives"] = fit.to_dict()
        if not args.json:
            _print_fit(fit)
        if args.apply_to:
            target = load_topology(args.apply_to)
            applied = apply_to_topology(target, fit, args.tier)
            out = Path(args.topology_out or f"{target.name}-calibrated.yaml")
            applied = applied.model_copy(update={"name": out.stem, "description": (
                f"{target.description} Tier '{fit.tier}' calibrated from {fit.source} ({fit.device}).").strip()})
            dump_spec(applied, out)
            report["topology_out"] = str(out)
            if not args.json:
                print(f"wrote {out} ({target.name} with tier '{fit.tier}' from the sweep)")
    dump_spec(cal, args.output)
    if args.json:
        report["calibration"] = cal.model_dump(mode="json")
        print(json.dumps(report, indent=1))
    else:
        print(f"wrote {args.output}")
    return 0


def _print_runs(cal, runs) -> None:
    fe = cal.fit_error
    print(f"calibrated '{cal.device}' from {len(runs)} run(s), {fe.num_samples} (op, phase) samples")
    for r in runs:
        print(f"  {r.run}: {r.attributed_share:.1%} of traced time attributed to cost-model ops "
              f"({r.unattributed_s * 1e3:.2f} ms unattributed of {r.total_s * 1e3:.2f} ms)")
    for r in runs:
        for n in r.notes:  # what a run lacks, and what the fit does without it (also in the calibration's notes)
            print(f"note: run {r.run}: {n}")
    print(f"{'class':<12} {'compute eff':>12} {'memory eff':>11} {'launch us':>10} {'error':>7}")
    for cls, oc in cal.op_classes.items():
        ce = ", ".join(f"{dt} {v:.3f}" for dt, v in oc.compute_efficiency.items()) or "-"
        me = f"{oc.memory_efficiency:.3f}" if oc.memory_efficiency is not None else "-"
        la = f"{oc.launch_overhead_s * 1e6:.2f}" if oc.launch_overhead_s is not None else "-"
        err = fe.per_op_class.get(cls)
        print(f"{cls:<12} {ce:>12} {me:>11} {la:>10} {('%.1f%%' % (100 * err)) if err is not None else '-':>7}")
    print(f"per-op error: median {fe.median_abs_rel_error:.1%}, max {fe.max_abs_rel_error:.1%}")
    if cal.attention_scales:
        by: dict[str, list[str]] = {}
        for key, v in sorted(cal.attention_scales.items(), key=lambda kv: (kv[0].rsplit(":", 1)[0], int(kv[0].rsplit(":", 1)[1]))):
            op_phase, hd = key.rsplit(":", 1)
            by.setdefault(op_phase, []).append(f"{hd}: x{v:.2f}")
        print("attention scales (measured over the class's priced time, by head dim):")
        for op_phase, items in by.items():
            print(f"  {op_phase:<18} {', '.join(items)}")
    if cal.unfused_memory_efficiency is not None:
        ks = f", {cal.unfused_kernel_s * 1e6:.2f} us per extra kernel" if cal.unfused_kernel_s is not None else ""
        print(f"unfused ops (the padded reference's matmuls and passes): memory eff {cal.unfused_memory_efficiency:.3f}{ks}")
    if cal.lookup_id_latency_s is not None:
        chunks = sorted({r.seq_chunk for r in runs})
        print(f"sequence lookup: {cal.lookup_id_latency_s * 1e9:.0f} ns per serial id of a bag "
              f"(runs' seq_chunk: {', '.join(str(c) for c in chunks)}; 0 = whole histories)")
    if cal.loader_scale is not None:
        print(f"data loader: x{cal.loader_scale:.3g} the cost model's default coefficients (measured read time per step "
              "over the priced, median over the runs)")
    if cal.device_step_factor is not None:
        print(f"device step factor: {cal.device_step_factor:.3f} (device work the ops do not price)")
    if cal.device_gap_s is not None:
        print(f"device gap: {cal.device_gap_s * 1e6:.2f} us per priced launch (device work the ops do not price, between "
              "kernels: added to every class's launch cost)")
    if cal.host_launch_s is not None:
        print(f"host: {cal.host_launch_s * 1e6:.1f} us per priced launch, "
              f"{(cal.host_sample_s or 0.0) * 1e6:.1f} us per local sample (step = max(factor x device, host))")
    if cal.host_launch_graphed_s is not None:
        print(f"host under CUDA graphs: {cal.host_launch_graphed_s * 1e6:.1f} us per priced launch (one-rank plans whose "
              "dense arch the trainer replays as graphs)")
    if cal.host_launch_s is None and cal.host_launch_graphed_s is None and (cal.device_step_factor is not None
                                                                           or cal.device_gap_s is not None):
        print("host: no cost identified (no fitted run was host-bound); steps priced as the device's")
    trainer = cal.versions.get(fingerprint.KEY)
    print(f"trainer: code fingerprint {trainer or 'unknown'} ({cal.versions.get(fingerprint.SOURCE_KEY, 'not recorded')}); "
          "coplan plan warns when the installed trainer's differs")


def _print_fit(fit) -> None:
    print(f"collectives: tier '{fit.tier}' of '{fit.topology}' from {fit.source} ({fit.device}, {fit.world_size} GPUs, "
          f"{fit.num_points} points): latency {fit.latency_s * 1e6:.2f} us")
    print(f"{'collective':<16} {'efficiency':>10} {'peak busbw GB/s':>16} {'own latency us':>15} {'median err':>11} {'max err':>8}")
    for k, f in fit.kinds.items():
        print(f"{k:<16} {f.efficiency:>10.3g} {f.peak_busbw_bytes_per_s / 1e9:>16.1f} {f.own_latency_s * 1e6:>15.2f} "
              f"{f.median_abs_rel_error:>10.1%} {f.max_abs_rel_error:>8.1%}")
    print(f"time error: median {fit.median_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%} "
          f"(topology's own figures: median {fit.default_median_abs_rel_error:.1%}, max {fit.default_max_abs_rel_error:.1%})")
    for n in fit.notes:
        print(f"note: {n}")


def register_calibrate(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("calibrate", help=help_text, description=help_text + ".")
    p.add_argument("runs", nargs="*", type=nonempty_path, help="run directories written by `coplan train` (runs/<id>/)")
    p.add_argument("-o", "--output", default="calibration.json", type=nonempty("path", "calibration.json"),
                   help="where to write the Calibration (default: calibration.json)")
    p.add_argument("--rank", type=non_negative_int, default=0, help="whose trace to fit (default: 0)")
    p.add_argument("--force", action="store_true", help="fit runs from different devices together")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--host-cost", action=argparse.BooleanOptionalAction, default=True,
                   help="(default on; --no-host-cost: device efficiencies only) also fit a host cost per priced kernel "
                        "launch and one per local sample, and a device-step factor "
                        "(device work the ops do not price), to the runs' measured step times (host_launch_s, host_sample_s, "
                        "device_step_factor); a step is then priced at max(factor x device time, launches x host cost "
                        "+ samples x per-sample cost) (see coplan.calibration.host_fit)")
    p.add_argument("--device-term", choices=("best", "factor", "gap"), default="factor",
                   help="with the host cost: how the device work no priced op accounts for is fitted: a share of the "
                        "device step (factor: device_step_factor), a time per priced launch between kernels (gap: "
                        "device_gap_s), or whichever of the two fits the measured steps closer (best). Default: factor")
    p.add_argument("--host-speed", action="store_true",
                   help="with the host cost (implies --host-cost): scale each run's host time by how fast its host ran the "
                        "same calls in its profiled steps, so that runs measured on a slowed (shared) host do not bend the "
                        "fitted host costs")
    g = p.add_argument_group("collectives", "fit a tier's latency and per-collective efficiency to a sweep "
                             "(benchmarks/collectives_h200.py)")
    g.add_argument("--collectives", type=nonempty_path, metavar="SWEEP.json", help="collective sweep JSON to fit")
    g.add_argument("--topology", default="h200-hgx-2gpu", type=nonempty("path", "h200-hgx-2gpu"),
                   help="topology the sweep ran on (preset or path; default: h200-hgx-2gpu)")
    g.add_argument("--tier", default=None, type=nonempty_str, help="tier to calibrate (default: the one the sweep's group crosses)")
    g.add_argument("--dtypes", default=None, type=nonempty_str, help="comma list of dtypes to fit (default: all in the sweep)")
    g.add_argument("--base", default=None, type=nonempty_path, help="calibration to start from: with runs, its device terms are the fit's starting "
                   "point and stay for op classes the runs do not measure (all of them when the runs' traces attribute under "
                   "half their device time, e.g. traces of replayed CUDA graphs: then only the step-level terms are fitted); "
                   "without runs, the calibration the collective fit merges into")
    g.add_argument("--apply-to", default=None, type=nonempty_path, metavar="TOPOLOGY",
                   help="also write this topology (e.g. h200-superpod-4k) with the fitted tier's latency and efficiencies")
    g.add_argument("--topology-out", default=None, type=nonempty_path, help="where --apply-to writes (default: <name>-calibrated.yaml)")
    p.set_defaults(func=run_calibrate)
