"""Read a Kineto (``torch.profiler``) trace file into its JSON events.

coplan reads the files itself rather than through HolisticTraceAnalysis: see
``docs/architecture-notes-calibration.md`` for why.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Any

from coplan.errors import CoplanError


class TraceError(CoplanError):
    """A trace file is missing, unreadable or not a Kineto trace."""


_REWRITE = "copy it again from the run, or re-run the run with profiling on (`coplan train` writes traces/rank<k>.json)"
"""The fix for a trace that cannot be read: the profiled steps it measured are in no other file."""


def load_trace(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
        if not raw:
            raise TraceError(f"{p}: empty (0 bytes): the profiler wrote nothing; {_REWRITE}")
        if p.suffix == ".gz":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise TraceError(f"{p}: not a readable gzip file ({e}): truncated or corrupt; {_REWRITE}") from None
    except (OSError, ValueError, RecursionError) as e:
        raise TraceError(f"{p}: not a readable JSON trace ({e}): truncated or corrupt; {_REWRITE}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{p}: not a Kineto trace (no 'traceEvents' list); write it with torch.profiler's export_chrome_trace")
    return data


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _shown(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def check_events(trace: dict[str, Any], path: str | Path) -> None:
    """Refuse a trace whose events calibration would misread: an event that is not an object, or a complete
    (``"ph": "X"``) event whose ``ts`` / ``dur`` is not a finite number (``dur`` below 0 too), whose ``tid`` is not
    a number or name, or whose ``args`` is not an object, with ``Sequence number`` and ``correlation`` integers;
    and a trace with no complete event at all (the profiler recorded nothing)."""
    fix = f"the trace is corrupt; {_REWRITE}"
    seen = False
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            raise TraceError(f"{path}: traceEvents[{i}] is {_shown(e)}, not an event object; {fix}")
        if e.get("ph") != "X":
            continue
        seen = True
        for key in ("ts", "dur"):
            v = e.get(key)
            if not _number(v) or (key == "dur" and v < 0):
                what = _shown(v) if key in e else "missing"
                raise TraceError(f"{path}: traceEvents[{i}] ('{str(e.get('name', ''))[:60]}') has '{key}' {what}, not a "
                                 f"finite {'duration >= 0' if key == 'dur' else 'time'} in us; {fix}")
        tid = e.get("tid")
        if tid is not None and not (isinstance(tid, (int, str)) and not isinstance(tid, bool)):
            raise TraceError(f"{path}: traceEvents[{i}] has 'tid' {_shown(tid)}, not a thread number or name; {fix}")
        args = e.get("args")
        if args is None:
            continue
        if not isinstance(args, dict):
            raise TraceError(f"{path}: traceEvents[{i}] has 'args' {_shown(args)}, not an object; {fix}")
        for key in ("Sequence number", "correlation"):
            v = args.get(key)
            if key in args and not (isinstance(v, int) and not isinstance(v, bool)):
                raise TraceError(f"{path}: traceEvents[{i}] has args['{key}'] {_shown(v)}, not an integer; {fix}")
    if not seen:
        raise TraceError(f"{path}: holds no complete ('ph': 'X') event: the profiler recorded no step; {_REWRITE}")


__all__ = ["TraceError", "check_events", "load_trace"]
