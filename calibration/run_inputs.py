"""The checks ``coplan calibrate`` makes of a run directory's files before fitting them: a corrupt file is refused
with a typed error naming the file, the line or field, what is wrong and the fix, never skipped in silence (a
skipped line or a dropped figure changes the fit). What a run may lack (an unfinished run's summary, an older
trainer's step list or length statistics) is read as before, with a note saying what the fit then does without.

Each check returns what :func:`coplan.calibration.runs.run_samples` reads, unchanged for a valid run, and the
notes; a corrupt file is a :class:`coplan.spec.RunDirError` (a summary that is not a RunResult: the spec loader's
``SpecError``), exit code 2 like every input error. The traces' checks are :func:`coplan.calibration.kineto.check_events`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from coplan.spec import Plan, RunDir, RunDirError, RunResult
from coplan.errors import SpecError
from coplan.spec.loader import not_a_file

RERUN = "re-run the run with `coplan train`, or leave it out of the calibration"
"""The fix for a run file that is corrupt: what it measured cannot be recovered from the other files."""


def _shown(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return _number(v) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read(p: Path) -> str:
    """A run file's UTF-8 text, or a RunDirError naming it."""
    why = not_a_file(p)
    if why:
        raise RunDirError(f"{p}: {why}, not a run file; {RERUN}")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDirError(f"{p}: not UTF-8 text (byte {e.start:,}): the file is corrupt; {RERUN}") from None
    except OSError as e:
        raise RunDirError(f"{p}: cannot be read: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------------- metrics.jsonl

def _check_moment_map(p: Path, i: int, key: str, v: Any, triples: bool) -> None:
    where = f"{p}:{i}"
    what = "[n, sum of lengths, sum of squared lengths]" if triples else "a list of the longest lengths, one per micro-batch"
    if not isinstance(v, dict):
        raise RunDirError(f"{where}: '{key}' is {_shown(v)}, not an object of sequence -> {what}; the line is corrupt; {RERUN}")
    for seq, xs in v.items():
        ok = isinstance(xs, list) and all(_finite(x) and x >= 0 for x in xs) and (len(xs) == 3 if triples else True)
        if not ok:
            raise RunDirError(f"{where}: '{key}' of sequence '{seq}' is {_shown(xs)}, not {what} (finite, non-negative "
                              f"numbers); the line is corrupt; {RERUN}")


def checked_metrics(rd: RunDir) -> tuple[list[dict[str, Any]], str | None]:
    """The run's metrics lines (as :meth:`RunDir.metrics` reads them), each checked for what calibration reads:
    ``step`` (a non-negative integer, each once), ``step_time_s`` (a finite number of seconds above 0),
    ``seq_stats`` and ``seq_max`` (per sequence, finite non-negative numbers; the same sequences on every line).
    A missing or empty file is read as no lines, with a note: the run's ops are then priced at the workload's
    nominal lengths."""
    p = rd.metrics_path
    if not p.exists() and not p.is_symlink():
        return [], ("metrics.jsonl missing: its ops are priced at the workload's nominal sequence lengths, not the "
                    "profiled steps' measured ones, and so is its measured step")
    text = _read(p)
    lines = text.splitlines()
    last = max((i for i, ln in enumerate(lines, 1) if ln.strip()), default=0)
    rows: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    keys: dict[str, tuple[int, set[str]]] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            cut = (" (the last line, cut short: was the run stopped while writing it?)"
                   if i == last and not text.endswith("\n") else "")
            raise RunDirError(f"{p}:{i}: the line is not JSON ({getattr(e, 'msg', e)}){cut}; the run's metrics are "
                              f"corrupt; {RERUN}") from None
        if not isinstance(row, dict):
            raise RunDirError(f"{p}:{i}: the line is {_shown(row)}, not a JSON object of one step's metrics; {RERUN}")
        if "step" not in row:
            raise RunDirError(f"{p}:{i}: the line has no 'step'; every line `coplan train` writes has one; {RERUN}")
        step = row["step"]
        if not _int(step) or step < 0:
            raise RunDirError(f"{p}:{i}: 'step' is {_shown(step)}, not a step number (an integer >= 0); {RERUN}")
        if step in seen:
            raise RunDirError(f"{p}:{i}: step {step} is logged twice (lines {seen[step]} and {i}); each step has one "
                              f"line; {RERUN}")
        seen[step] = i
        t = row.get("step_time_s")
        if not _finite(t) or t <= 0:
            raise RunDirError(f"{p}:{i}: 'step_time_s' of step {step} is {_shown(t) if 'step_time_s' in row else 'missing'}, "
                              f"not a measured time (a finite number of seconds above 0); {RERUN}")
        for key, triples in (("seq_stats", True), ("seq_max", False)):
            v = row.get(key)
            if v is None and key not in row:
                v = {}
            _check_moment_map(p, i, key, v, triples)
            first = keys.setdefault(key, (i, set(v)))
            if set(v) != first[1]:
                raise RunDirError(f"{p}:{i}: '{key}' has the sequences {sorted(v)}, line {first[0]} has {sorted(first[1])}; "
                                  f"every step logs the same ones; {RERUN}")
        rows.append(row)
    if not rows:
        return [], ("metrics.jsonl empty: its ops are priced at the workload's nominal sequence lengths, not the "
                    "profiled steps' measured ones, and so is its measured step")
    return rows, None


def lengths_note(plan: Plan, metrics: list[dict[str, Any]]) -> str | None:
    """The note for a run whose metrics lines log no length statistics though its workload has sequences (a
    trainer before them): its ops are priced at the nominal lengths."""
    if metrics and plan.workload.sequences and not any(m.get("seq_stats") for m in metrics):
        return ("metrics.jsonl logs no seq_stats (a trainer before them): its ops are priced at the workload's nominal "
                "sequence lengths, not the profiled steps' measured ones")
    return None


# ------------------------------------------------------------------------------------------------- traces/steps.json

def checked_profiled_steps(rd: RunDir, metrics: list[dict[str, Any]]) -> tuple[list[int] | None, str | None]:
    """The steps the run's traces hold (``traces/steps.json``: a JSON list of distinct step numbers, each with a
    metrics line when the run has any). None when the file is missing, with a note where it matters (the run has
    metrics lines): the profiled steps' lengths are then taken over every logged step."""
    p = rd.profiled_steps_path
    if not p.exists() and not p.is_symlink():
        if not metrics:
            return None, None
        return None, ("traces/steps.json missing: the profiled steps' lengths are taken as those of every logged step, "
                      "and its measured steps include the profiled ones")
    fix = ("it is the JSON list of the step numbers the traces hold (e.g. [5, 6, 7]), as `coplan train` writes it; "
           + RERUN)
    text = _read(p)
    try:
        steps = json.loads(text)
    except (ValueError, RecursionError) as e:
        what = "empty" if not text.strip() else f"not JSON ({getattr(e, 'msg', e)}; truncated?)"
        raise RunDirError(f"{p}: {what}; {fix}") from None
    if not isinstance(steps, list):
        raise RunDirError(f"{p}: is {_shown(steps)}, not a list; {fix}")
    if not steps:
        raise RunDirError(f"{p}: lists no step, yet the run has a trace; {fix}")
    for j, s in enumerate(steps):
        if not _int(s) or s < 0:
            raise RunDirError(f"{p}: entry {j} is {_shown(s)}, not a step number (an integer >= 0); {fix}")
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if dup:
        raise RunDirError(f"{p}: lists step {dup[0]} more than once; {fix}")
    if metrics:
        logged = {m["step"] for m in metrics}
        missing = [s for s in steps if s not in logged]
        if missing:
            raise RunDirError(f"{p}: lists step {missing[0]}, which {rd.metrics_path} has no line for: the two files do "
                              f"not describe the same run; {RERUN}")
    return list(steps), None


# ---------------------------------------------------------------------------------------------------- summary.json

def checked_result(rd: RunDir, plan: Plan) -> tuple[RunResult | None, list[str]]:
    """The run's summary (:meth:`RunDir.result`: a corrupt one is refused by the spec loader, naming the field),
    checked against its plan and for the figures calibration reads; None without one (an unfinished run), with a
    note."""
    p = rd.summary_path
    if not p.exists() and not p.is_symlink():
        return None, [f"summary.json missing (an unfinished run?): its device time is fitted at the plan's device "
                      f"({plan.topology.gpu.name}) and launch switches, but it adds no measured step time, host time or "
                      "loader figure to the fit"]
    try:
        result = load_result(rd)
    except SpecError as e:  # (the loader names the field; the fix is calibration's)
        e.message += f"\n  the summary is corrupt: {RERUN}"
        e.args = (e.message,)
        raise
    fix = f"the summary is corrupt; {RERUN}"
    if result.world_size != plan.world_size:
        raise RunDirError(f"{p}: world_size is {result.world_size}, but {rd.plan_path} is a plan for {plan.world_size} "
                          f"GPU(s): the summary is of another run; {RERUN}")
    for name in ("step_time", "host_step"):
        st = getattr(result, name)
        if st is not None and st.p50_s <= 0:
            raise RunDirError(f"{p}: {name}.p50_s is {st.p50_s}: a measured step takes time; {fix}")
    notes = []
    if result.step_time is None:
        notes.append("summary.json records no step_time (no step measured): it adds no measured step time to the fit")
    if result.loader is not None and result.loader.read_s_per_batch <= 0:
        notes.append("summary.json's loader has no read_s_per_batch (a trainer before it): its loader is not fitted")
    return result, notes


def load_result(rd: RunDir) -> RunResult:
    """The run's summary, which must be there (:func:`checked_result` has checked it is)."""
    r = rd.result()
    if r is None:
        raise RunDirError(f"{rd.summary_path}: {not_a_file(rd.summary_path) or 'not a file'}; {RERUN}")
    return r


__all__ = ["RERUN", "checked_metrics", "checked_profiled_steps", "checked_result", "lengths_note",
           "load_result"]
