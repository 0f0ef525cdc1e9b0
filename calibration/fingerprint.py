"""Which trainer a calibration's runs ran: a fingerprint of the code that runs the step.

A calibration's host and device terms are fitted on one trainer's steps, and they move when the trainer
changes. On the lent H100 (2026-12-07, ``benchmarks/results/fresh_draws_h100h_calibrated.json``), the
shipped H100 calibration priced three draws +17%, +41% and +35%. Its runs were at ``7b2c8ed``. The draws
ran a trainer three changes later: the masters cast by multi-tensor copies, Kunlun's GDPA on the jagged
kernel, and the optimizer's step replayed as a CUDA graph. The same calibration had priced four earlier
held-out sets at medians of 4.5-7.0%. Nothing said that the calibration and the trainer no longer matched.

The fingerprint is a digest of the Python sources that run the step: every module of ``coplan.trainer``
(the repository's ``trainer/``) and the modules of ``coplan.kernels`` (``kernels/``) that the trainer imports,
directly or through other kernels (read from their ``import`` statements, wherever they stand in the file; the
packages an import runs the ``__init__`` of included). A kernel module that nothing of the trainer imports
(a benchmark's, one not yet wired in) does not count, so adding one does not mark every calibration stale. It
ignores comments and formatting no more than git does, so any edit to a counted file changes it: that errs
towards saying "stale" when an edit did not move the step. A calibration records it in
``versions["trainer_fingerprint"]`` and the way it was taken in ``versions["trainer_fingerprint_scheme"]``
(:data:`SCHEME`); a calibration without a scheme (written before 2026-12-07) was taken over every Python file of
both folders (:data:`LEGACY_SCHEME`), and is compared with the installed trainer taken the same way. ``coplan calibrate`` takes
it from the first source that holds it (:func:`of_runs`):

- the runs' own ``versions`` (a trainer that records it);
- the code at the commit the runs recorded, read from the git checkout coplan runs from;
- else the trainer installed where ``coplan calibrate`` runs. That is right when the runs ran this
  install, and is said so in ``versions["trainer_fingerprint_source"]``.

``coplan plan`` and ``coplan report`` compare it with the installed trainer's (:func:`stale`). A
calibration without one (written before it existed) is not judged.
"""

from __future__ import annotations

import ast
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
SCHEME_KEY = "trainer_fingerprint_scheme"
SCHEME = "imports"
"""Every module of the trainer and the kernel modules it imports (module docstring)."""
LEGACY_SCHEME = "all"
"""Every Python file of ``trainer/`` and ``kernels/`` (calibrations that record no scheme)."""


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


def _module(path: str) -> str:
    """``kernels/fp8.py`` -> ``coplan.kernels.fp8``; a package's ``__init__.py`` -> the package."""
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["coplan", *parts])


def _imports(path: str, source: bytes) -> set[str] | None:
    """The modules ``path``'s import statements name (absolute; with each ``from X import y`` both ``X`` and
    ``X.y``, since ``y`` may be a submodule), or None where the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    package = _module(path).split(".") if path.endswith("__init__.py") else _module(path).split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def step_files(files: Iterable[tuple[str, bytes]], scheme: str = SCHEME) -> list[tuple[str, bytes]]:
    """Of (repository path, content) pairs of ``trainer/`` and ``kernels/``, those the fingerprint covers
    under ``scheme``: every one (:data:`LEGACY_SCHEME`), or the trainer's modules and the kernel modules they
    import, transitively, with the packages those imports pass through (:data:`SCHEME`). A file that does
    not parse counts as importing every kernel module."""
    files = list(files)
    if scheme == LEGACY_SCHEME:
        return files
    content = dict(files)
    path_of = {_module(p): p for p in content}
    kept = {p for p in content if p.startswith("trainer/")}
    todo = sorted(kept)
    while todo:
        found = _imports(todo[-1], content[todo.pop()])
        names = set(path_of) if found is None else found
        for name in names:
            parts = name.split(".")
            # ``import coplan.kernels.fp8`` runs coplan/kernels/__init__.py first: every package on the way
            for k in range(2, len(parts) + 1):
                p = path_of.get(".".join(parts[:k]))
                if p is not None and p not in kept:
                    kept.add(p)
                    todo.append(p)
    return [(p, c) for p, c in files if p in kept]


@functools.cache
def installed(scheme: str = SCHEME) -> str:
    """The fingerprint of the trainer and kernels installed here (under ``scheme``)."""
    return digest(step_files((f for folder in CODE for f in _walk(resources.files(f"coplan.{folder}"), folder)), scheme))


def source_repo() -> Path | None:
    """The git work tree coplan runs from (an editable install or a checkout), or None."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / ".git").exists() else None


def at_commit(commit: str, repo: Path | None = None, scheme: str = SCHEME) -> str | None:
    """The fingerprint of the trainer and kernels at ``commit`` (full or short) of the git repository ``repo``
    (default: :func:`source_repo`, under ``scheme``), or None where there is no such repository or commit."""
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
    return digest(step_files(out, scheme))


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
    have = installed(cal.versions.get(SCHEME_KEY, LEGACY_SCHEME))
    if want == have:
        return None
    return (f"stale: its runs ran other trainer code (fingerprint {want}) than the trainer installed here ({have}); "
            "its fitted host and device terms may not hold. Re-fit: `coplan train` a few plans, then `coplan calibrate` their runs")


__all__ = ["CODE", "KEY", "SOURCE_KEY", "at_commit", "digest", "installed", "of_runs", "source_repo", "stale"]
