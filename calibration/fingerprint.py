"""Which trainer a calibration's runs ran: a fingerprint of the code that runs the step.

A calibration's host and device terms are fitted on one trainer's steps, and they move when the trainer
changes. On the lent H100 (2026-12-07, ``benchmarks/results/fresh_draws_h100h_calibrated.json``), the
shipped H100 calibration priced three draws +17%, +41% and +35%. Its runs were at ``7b2c8ed``. The draws
ran a trainer three changes later: the masters cast by multi-tensor copies, Kunlun's GDPA on the jagged
kernel, and the optimizer's step replayed as a CUDA graph. The same calibration had priced four earlier
held-out sets at medians of 4.5-7.0%. Nothing said that the calibration and the trainer no longer matched.

The fingerprint is a digest of the Python sources of the packages that run the step: ``coplan.trainer`` and
``coplan.kernels`` (the repository's ``trainer/`` and ``kernels/``). It ignores comments and formatting no
more than git does, so any edit there changes it: that errs towards saying "stale" when an edit did not
move the step. A calibration records it in ``versions["trainer_fingerprint"]``. ``coplan calibrate`` takes
it from the first source that holds it (:func:`of_runs`):

- the runs' own ``versions`` (a trainer that records it);
- the code at the commit the runs recorded, read from the git checkout coplan runs from;
- else the trainer installed where ``coplan calibrate`` runs. That is right when the runs ran this
  install, and is said so in ``versions["trainer_fingerprint_source"]``.

``coplan plan`` and ``coplan report`` compare it with the installed trainer's (:func:`stale`). A
calibration without one (written before it existed) is not judged.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from collections.abc import Iterable, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from coplan.spec import Calibration

CODE = ("trainer", "kernels")
"""The repository's folders whose Python code runs the step (packages ``coplan.<folder>``)."""

KEY = "trainer_fingerprint"
SOURCE_KEY = "trainer_fingerprint_source"


def digest(files: Iterable[tuple[str, bytes]]) -> str:
    """16 hex digits of SHA-256 over (repository path, content digest) pairs, in path order."""
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def _walk(node: Traversable, prefix: str) -> Iterable[tuple[str, bytes]]:
    for entry in node.iterdir():
        if entry.is_dir():
            if entry.name != "__pycache__":
                yield from _walk(entry, f"{prefix}/{entry.name}")
        elif entry.name.endswith(".py"):
            yield f"{prefix}/{entry.name}", entry.read_bytes()


@functools.cache
def installed() -> str:
    """The fingerprint of the trainer and kernels installed here."""
    return digest(f for folder in CODE for f in _walk(resources.files(f"coplan.{folder}"), folder))


def source_repo() -> Path | None:
    """The git work tree coplan runs from (an editable install or a checkout), or None."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / ".git").exists() else None


def at_commit(commit: str, repo: Path | None = None) -> str | None:
    """The fingerprint of the trainer and kernels at ``commit`` (full or short) of the git repository ``repo``
    (default: :func:`source_repo`), or None where there is no such repository or commit."""
    repo = repo or source_repo()
    if not commit or repo is None:
        return None
    try:
        tree = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", commit + "^{commit}", "--", *CODE],
                              capture_output=True, text=True, timeout=60)
        if tree.returncode != 0:
            return None
        blobs = []
        for line in tree.stdout.splitlines():
            meta, _, path = line.partition("\t")
            parts = meta.split()
            if path.endswith(".py") and len(parts) == 3 and parts[1] == "blob":
                blobs.append((path, parts[2]))
        if not blobs:
            return None
        cat = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch"], input="".join(s + "\n" for _, s in blobs).encode(),
                             capture_output=True, timeout=60)
        if cat.returncode != 0:
            return None
    except (OSError, subprocess.SubprocessError):
        return None
    out, buf, pos = [], cat.stdout, 0
    for path, _ in blobs:
        end = buf.index(b"\n", pos)
        size = int(buf[pos:end].split()[2])
        out.append((path, buf[end + 1:end + 1 + size]))
        pos = end + 1 + size + 1
    return digest(out)


def of_runs(versions: Sequence[dict[str, str]], repo: Path | None = None) -> tuple[str | None, str]:
    """The fingerprint of the trainer that made runs with these recorded ``versions``, and where it came from
    (module docstring). (None, why) when the runs ran different trainers."""
    own = {v.get(KEY) for v in versions}
    if None not in own:
        if len(own) == 1:
            return own.pop(), "recorded by the runs"
        return None, f"the runs recorded {len(own)} different trainers"
    commits = {v.get("coplan_git_commit", "") for v in versions}
    if "" not in commits:
        found = {c: at_commit(c, repo) for c in sorted(commits)}
        if None not in found.values():
            prints = set(found.values())
            if len(prints) == 1:
                return prints.pop(), f"the trainer at the runs' commit {', '.join(c[:12] for c in found)}"
            return None, f"the runs ran {len(prints)} different trainers (commits {', '.join(c[:12] for c in found)})"
    return installed(), "assumed: the trainer installed where coplan calibrate ran (the runs recorded no commit this checkout holds)"


def stale(cal: Calibration) -> str | None:
    """A sentence saying the calibration's runs ran another trainer than the one installed here, or None
    (the same trainer, or a calibration that records none)."""
    want = cal.versions.get(KEY)
    if not want:
        return None
    have = installed()
    if want == have:
        return None
    return (f"stale: its runs ran other trainer code (fingerprint {want}) than the trainer installed here ({have}); "
            "its fitted host and device terms may not hold. Re-fit: `coplan train` a few plans, then `coplan calibrate` their runs")


__all__ = ["CODE", "KEY", "SOURCE_KEY", "at_commit", "digest", "installed", "of_runs", "source_repo", "stale"]
