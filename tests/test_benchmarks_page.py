"""``BENCHMARKS.md`` is generated from ``benchmarks/results/`` by ``benchmarks/make_page.py``: the registry
points at files and paths that exist, every row says where, when and at which commit it was measured (or
that it is stale), and the committed page is what the results give."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


figures = _load("figures")
make_page = _load("make_page")
HAS_HISTORY = shutil.which("git") is not None and (ROOT / ".git").exists() and subprocess.run(
    ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True).stdout.strip() == "false"


def test_every_result_and_dependency_exists():
    for result in figures.RESULTS:
        assert (RESULTS / result.file).is_file(), result.file
        json.loads((RESULTS / result.file).read_text())
        for extra in result.attachments:
            assert (RESULTS / extra).is_file(), extra
        for dep in result.all_depends:
            path = ROOT / dep
            assert path.is_dir() if dep.endswith("/") else path.is_file(), (
                f"{result.file} depends on {dep}, which is not in the tree: update benchmarks/figures.py")


def test_results_hold_one_current_file_per_benchmark():
    """Nothing in benchmarks/results/ that the page does not read: earlier versions go to the log."""
    known = {r.file for r in figures.RESULTS} | {a for r in figures.RESULTS for a in r.attachments}
    known |= set(figures.INPUTS)
    extra = sorted(p.name for p in RESULTS.iterdir() if p.name not in known)
    assert not extra, ("not on the page (register them in benchmarks/figures.py, or move them to "
                       f"docs/benchmarks-log/results/): {extra}")
    for pending in figures.PENDING:
        assert not (RESULTS / pending.file).exists(), f"{pending.file} exists: give it figures in benchmarks/figures.py"


def test_every_figure_reads_a_value():
    """Only a figure that says why it may be absent (e.g. "no TorchRec plan") may read nothing."""
    for f in figures.FIGURES:
        value = f.read(json.loads((RESULTS / f.result.file).read_text()))
        assert isinstance(value, float) or (value is None and f.missing != "not in the result"), f.name


@pytest.mark.skipif(not HAS_HISTORY, reason="needs the repository's git history")
def test_every_row_says_where_when_and_which_commit():
    page = make_page.render()
    table_rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| Figure")]
    assert len(table_rows) == len(figures.FIGURES) + len(figures.PENDING)
    for line in table_rows:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        figure, value, goal, device, date, commit, command = cells
        assert figure and value and goal and command.startswith("`"), line
        if value == "not measured yet":
            continue
        assert device and date and commit, line
        assert commit.startswith("`") or commit.startswith("commit unknown — **stale**"), line
        assert commit.endswith(", current") or "**stale**" in commit, line
        result_file = command.rsplit("](", 1)[1].rstrip(")")
        assert (ROOT / result_file).is_file(), result_file


def test_a_result_without_a_commit_is_stale(tmp_path):
    """Every figure of a result that records no commit is stale, said so in its commit cell: the committed results
    (any of them may lack one) and a copy of one that does record its commit, with the commit taken out."""
    def commit(results: Path, r: dict) -> str | None:
        result = r["figure"].result
        return make_page.recorded_commit(json.loads((results / result.file).read_text()), result.commit_key)

    def unknown(r: dict) -> bool:
        return r["stale"] and r["cells"][5].startswith("commit unknown — **stale**")

    assert all(unknown(r) for r in make_page.rows(ROOT, RESULTS) if commit(RESULTS, r) is None)
    stripped = next(r for r in figures.RESULTS if make_page.recorded_commit(
        json.loads((RESULTS / r.file).read_text()), r.commit_key) is not None)
    for r in figures.RESULTS:
        dst = tmp_path / r.file
        dst.parent.mkdir(parents=True, exist_ok=True)
        d = json.loads((RESULTS / r.file).read_text())
        if r is stripped:
            d.pop(r.commit_key, None)
            if isinstance(d.get("host"), dict):
                d["host"].pop(r.commit_key, None)
        dst.write_text(json.dumps(d))
    rows = [r for r in make_page.rows(ROOT, tmp_path) if r["figure"].result is stripped]
    assert rows and all(commit(tmp_path, r) is None and unknown(r) for r in rows)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_moved_file_is_not_a_change_and_an_edited_one_is(tmp_path):
    repo = tmp_path / "repo"
    (repo / "old").mkdir(parents=True)
    (repo / "old" / "mod.py").write_text("def f():\n    return 1\n" * 20)
    (repo / "other.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "measured here")
    measured = _git(repo, "rev-parse", "HEAD")
    (repo / "new").mkdir()
    _git(repo, "mv", "old/mod.py", "new/mod.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "moved")
    make_page._tree_changes.cache_clear()
    assert make_page.changed_dependencies(repo, measured, ("new/",)) == {}
    assert make_page.changed_dependencies(repo, measured, ("new/mod.py",)) == {}
    (repo / "new" / "mod.py").write_text("def f():\n    return 2\n" + "def f():\n    return 1\n" * 19)
    make_page._tree_changes.cache_clear()
    assert make_page.changed_dependencies(repo, measured, ("new/",)) == {"new/": ["new/mod.py"]}
    assert make_page.changed_dependencies(repo, measured, ("other.py",)) == {}
    make_page._tree_changes.cache_clear()


@pytest.mark.skipif(not HAS_HISTORY, reason="needs the repository's git history")
def test_the_page_is_current():
    assert make_page.main(["--check"]) == 0, "BENCHMARKS.md is out of date: run python benchmarks/make_page.py"
