"""Read a Kineto (``torch.profiler``) trace file into its JSON events.

coplan reads the files itself rather than through HolisticTraceAnalysis: see
``docs/architecture-notes-calibration.md`` for why.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from coplan.errors import CoplanError


class TraceError(CoplanError):
    """A trace file is missing, unreadable or not a Kineto trace."""


def load_trace(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file") from None
    except (OSError, ValueError) as e:
        raise TraceError(f"{p}: not a readable JSON trace ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{p}: not a Kineto trace (no 'traceEvents' list); write it with torch.profiler's export_chrome_trace")
    return data


__all__ = ["TraceError", "load_trace"]
