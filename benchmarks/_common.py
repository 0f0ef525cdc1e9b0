"""Small helpers the device benchmarks share; imports nothing but the standard library, so a
benchmark's workers (and a machine without coplan installed) can use it. A script imports it after
putting its own folder on ``sys.path`` (tests load the scripts by path, not as a package)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def git_commit() -> str:
    """``COPLAN_GIT_COMMIT`` when set (a device copy's git metadata can be stale), else ``git rev-parse HEAD``."""
    if os.environ.get("COPLAN_GIT_COMMIT"):
        return os.environ["COPLAN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


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
