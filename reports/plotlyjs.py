"""Which plotly.js a report embeds: the basic bundle (scatter, bar, pie) when it can draw every trace,
else the full bundle of the installed ``plotly`` package.

Evaluating plotly.js is most of a report's load time: the full 4.8 MB bundle costs 1.7-1.9 s of
renderer main-thread time on the 2-vCPU development machine before any figure is drawn, the 1.2 MB
basic bundle about a quarter of that (``benchmarks/report_load.py``). coplan's figures use only
``scatter`` and ``bar`` traces, so the basic bundle draws them all. It is vendored from the npm
registry (``vendor/README.md``) and used only when its version equals the plotly.js version the
installed ``plotly`` package was built for, so the figures' JSON always meets the schema it was
written against; any mismatch or any other trace type falls back to the full bundle, which is never
wrong, only slower.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import plotly.offline

VENDOR_DIR = Path(__file__).resolve().parent / "vendor"
BASIC_FILE = VENDOR_DIR / "plotly-basic.min.js"
BASIC_VERSION = "4.1.1"
"""plotly.js version of the vendored basic bundle (npm ``plotly.js-basic-dist-min``)."""
BASIC_SHA256 = "99784e3abfb07b142a15e521a439e6d9addceadb3f79553fd24c72774f0649ba"
"""sha256 of the vendored file as unpacked from the npm package (checked by the tests)."""
BASIC_TRACE_TYPES = frozenset({"scatter", "bar", "pie"})
"""Trace types the basic bundle registers (plotly.js ``lib/index-basic.js``)."""


@dataclass(frozen=True, slots=True)
class Bundle:
    """The plotly.js chosen for one report."""

    name: str
    """``basic`` or ``full``."""

    version: str
    """plotly.js version of the embedded bundle."""

    reason: str
    """Why this one (shown in the page's provenance meta tag and in the benchmark)."""

    js: str
    """The script text."""


def full_version() -> str:
    """plotly.js version the installed ``plotly`` package ships (and writes figure JSON for)."""
    return str(plotly.offline.get_plotlyjs_version())


@lru_cache(maxsize=1)
def _basic_js() -> str | None:
    try:
        return BASIC_FILE.read_text(encoding="utf-8")
    except OSError:
        return None


def _header_version(js: str) -> str | None:
    m = re.search(r"plotly\.js \([^)]*\) v(\d+\.\d+\.\d+)", js[:400]) or re.search(r"plotly\.js v(\d+\.\d+\.\d+)", js[:400])
    return m.group(1) if m else None


def choose_bundle(trace_types: Iterable[str], *, prefer: str = "auto") -> Bundle:
    """The bundle for a report whose traces have ``trace_types``.

    ``prefer="full"`` always embeds the full bundle (for comparing the two); ``"auto"`` embeds the basic
    one when it is present, of the installed plotly.js version, and registers every trace type used.
    """
    if prefer not in ("auto", "full"):
        raise ValueError(f"prefer must be 'auto' or 'full', not {prefer!r}")
    types = set(trace_types)
    want = full_version()
    reason = ""
    if prefer == "full":
        reason = "full bundle requested"
    elif not types <= BASIC_TRACE_TYPES:
        reason = f"trace types {sorted(types - BASIC_TRACE_TYPES)} are not in the basic bundle"
    else:
        js = _basic_js()
        if js is None:
            reason = f"{BASIC_FILE} is missing"
        elif _header_version(js) != want:
            reason = f"the vendored basic bundle is plotly.js {_header_version(js)}, the installed plotly writes for {want}"
        else:
            return Bundle("basic", want, f"every trace is one of {sorted(BASIC_TRACE_TYPES)}", js)
    return Bundle("full", want, reason, plotly.offline.get_plotlyjs())


def file_sha256(path: Path = BASIC_FILE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


__all__ = ["BASIC_FILE", "BASIC_SHA256", "BASIC_TRACE_TYPES", "BASIC_VERSION", "Bundle", "choose_bundle", "file_sha256", "full_version"]
