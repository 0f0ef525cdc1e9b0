"""Small helpers the device benchmarks share; imports nothing but the standard library at load time,
so a benchmark's workers (and a machine without coplan installed) can use it. A script imports it
after putting its own folder on ``sys.path`` (tests load the scripts by path, not as a package).

Every plan a benchmark runs is made the user's way, by the planner (``coplan plan``), with ``--pin``
and ``--pin-table`` where a case needs a given layout: :func:`planned`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path


def coplan_cmd(*args: str) -> list[str]:
    """The ``coplan`` CLI as this interpreter runs it (``python -m coplan.cli ARGS``)."""
    return [sys.executable, "-m", "coplan.cli", *args]


def git_commit() -> str:
    """``COPLAN_GIT_COMMIT`` when set (a device copy's git metadata can be stale), else ``git rev-parse HEAD``."""
    if os.environ.get("COPLAN_GIT_COMMIT"):
        return os.environ["COPLAN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def write_result(out: Path, benchmark: str, device: str, summary: dict, rows: list, **fields) -> dict:
    """A benchmark's result file: what it measured, where, at which commit, when, by which command, then
    ``fields``, the summary and the rows; written to ``out`` (JSON) and the summary printed."""
    import datetime as dt

    result = {"benchmark": benchmark, "device": device, "git_commit": git_commit(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              **fields, "summary": summary, "rows": rows}
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    return result


CHOICES = ("mesh", "layers", "tables", "balancing", "micro_batches", "kernels", "precision")
"""The plan fields that are its choices: two plans making the same ones price the same run."""


def as_ran(workload: Path, row: dict | None, tmp: Path) -> Path:
    """The draw's workload as its run executed it: a run that did not record the fused FiLM LayerNorm (runs from
    before the kernel, compiled runs) is planned with ``kernels.film: eager``, so that its price carries the
    PyTorch FiLM's traffic, and one that did not record masked head dims in the attention kernels (runs from
    before 2026-12-06) with ``kernels.head_pad: copies``, as ``coplan calibrate`` prices them
    (``calibration.runs.as_ran``)."""
    opts = (row or {}).get("options") or {}
    update = {k: v for k, v, ran in (("film", "eager", opts.get("film") == "fused"),
                                     ("head_pad", "copies", opts.get("head_pad") == "masked")) if not ran}
    if not update:
        return workload
    import yaml

    spec = yaml.safe_load(workload.read_text())
    spec.setdefault("kernels", {}).update(update)
    out = tmp / f"as-ran-{workload.name}"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def same_choices(a: dict, b: dict) -> bool:
    """The plans make the same choices (``kernels.film`` and ``kernels.head_pad``, which the run decides, aside)."""
    strip = lambda p, k: {x: y for x, y in (p.get(k) or {}).items() if x not in ("film", "head_pad")} if k == "kernels" else p.get(k)  # noqa: E731
    return all(strip(a, k) == strip(b, k) for k in CHOICES)


def wait_or_kill(proc: subprocess.Popen, timeout: float, grace_s: float = 15.0) -> int | str:
    """Wait for ``proc`` (started with ``start_new_session=True``); past ``timeout`` stop its whole
    process group (SIGTERM, then SIGKILL after ``grace_s``) and return ``"timeout"``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return "timeout"


def table_pins(workload, sharding: str = "table_wise") -> dict[str, str]:
    """``--pin-table NAME=SHARDING`` for every table of ``workload`` (e.g. each table whole on one GPU)."""
    return {t.name: sharding for t in workload.all_tables}


def plan_command(workload, world: int, pins: dict | None = None, tables: dict | None = None) -> str:
    """The ``coplan plan`` command line of a plan (a pin every table shares is written once)."""
    parts = ["coplan plan", f"-w {workload.name}", f"--gpus {world}"] + [f"--pin {k}={v}" for k, v in (pins or {}).items()]
    tables = tables or {}
    kinds = set(tables.values())
    if tables and len(kinds) == 1 and len(tables) == len(workload.all_tables):
        parts.append(f"--pin-table <each of the {len(tables)} tables>={kinds.pop()}")
    else:
        parts += [f"--pin-table {k}={v}" for k, v in tables.items()]
    return " ".join(parts)


def planned(key: str, workload, topology, world: int, *, pins: dict | None = None, tables: dict | None = None,
            plans_dir: Path | None = None, log=print):
    """The plan ``coplan plan --gpus WORLD --pin ... --pin-table ...`` makes for ``workload`` on ``topology``
    (the planner in process: :func:`coplan.planner.search.make_plan`, default search settings).

    With ``plans_dir``, ``plan-<key>.json`` there is used when it was planned for the same workload,
    topology, world size and pins (the lent GPU machines lack OR-Tools: a benchmark's ``--plan-only
    --plans DIR`` makes its plans beforehand on any machine), else the plan is made and written there."""
    from coplan.planner.search import PlannerConfig
    from coplan.spec import dump_spec, load_plan, spec_sha256

    cfg = PlannerConfig(world_size=world, pins=dict(pins or {}), table_pins=dict(tables or {}))
    path = Path(plans_dir) / f"plan-{key}.json" if plans_dir is not None else None
    if path is not None and path.is_file():
        from coplan.errors import CoplanError

        try:
            plan = load_plan(path)
        except CoplanError as e:  # e.g. made before a spec changed: its hashes no longer match
            plan = None
            log(f"plan {key}: {path} does not load ({str(e).splitlines()[-1].strip()}); planning again")
        same = plan is not None and (
            plan.workload_sha256 == spec_sha256(workload) and plan.topology_sha256 == spec_sha256(topology)
            and plan.world_size == world and plan.solver is not None and tuple(plan.solver.pins) == cfg.pin_labels)
        if same:
            log(f"plan {key}: loaded {path}")
            return plan
        if plan is not None:
            log(f"plan {key}: {path} was planned for other inputs or pins; planning again")
    try:
        import ortools  # noqa: F401
    except ImportError:
        raise RuntimeError(f"plan {key}: the planner needs OR-Tools, which is not installed here; make the plans on a "
                           "machine with it (this benchmark's --plan-only --plans DIR) and pass --plans DIR") from None
    from coplan.planner.search import make_plan

    plan = make_plan(workload, topology, None, cfg)[0]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump_spec(plan, path)
        log(f"plan {key}: planned and written to {path}")
    return plan


def plan_facts(plan) -> dict:
    """What a plan chose, in a few fields (for a benchmark's JSON)."""
    from collections import Counter

    m = plan.mesh
    return {
        "mesh": {"dense_shard": m.dense_shard, "dense_replicate": m.dense_replicate, "expert_parallel": m.expert_parallel,
                 "sparse_shard": m.sparse_shard, "sparse_replicate": m.sparse_replicate},
        "tables_by_sharding": dict(Counter(t.sharding_type for t in plan.tables)),
        "recompute": [lp.name for lp in plan.layers if lp.recompute],
        "fp8_layers": [lp.name for lp in plan.layers if lp.precision == "fp8"],
        "micro_batches": plan.micro_batches, "balancing": plan.balancing.policy, "attention": plan.kernels.attention,
        "solver": plan.solver.status if plan.solver else None,
        "predicted_step_ms": plan.predicted.step_time_s * 1e3 if plan.predicted else None,
    }


def plans_of(measured: Path, default: Path) -> Path:
    """The plan set a fresh-draws result ran: the ``--plans`` of its recorded command, a folder of
    ``benchmarks/results`` (``default`` when the result names none that exists here)."""
    results = Path(__file__).resolve().parent / "results"
    try:
        cmd = json.loads(measured.read_text()).get("command", "")
    except (OSError, ValueError):
        return default
    m = re.search(r"--plans[ =](\S+)", cmd)
    return results / Path(m.group(1)).name if m and (results / Path(m.group(1)).name).is_dir() else default
