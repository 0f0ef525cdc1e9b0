"""The trainer's code fingerprint: a calibration says which trainer its runs ran, and a plan says when the
installed trainer is another."""

import json
import shutil
import subprocess

import pytest

from coplan.calibration import fingerprint as fp
from coplan.calibration.shipped import choose, shipped
from coplan.cli import main
from coplan.spec import load_calibration, load_topology

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


LOOP = "from coplan.kernels import attention\nSTEP = 1\n"


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "trainer" / "model").mkdir(parents=True)
    (r / "kernels").mkdir()
    (r / "trainer" / "loop.py").write_text(LOOP)
    (r / "trainer" / "model" / "layers.py").write_text("LAYERS = 2\n")
    (r / "kernels" / "attention.py").write_text("BLOCK = 64\n")
    (r / "trainer" / "README.md").write_text("not code\n")
    (r / "planner.py").write_text("outside the trainer\n")
    _git(tmp_path, "init", "-q", str(r))
    _git(r, "add", "-A")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return r


def test_digest_is_a_function_of_paths_and_contents_not_order():
    a = [("trainer/a.py", b"x = 1\n"), ("kernels/b.py", b"y = 2\n")]
    assert fp.digest(a) == fp.digest(list(reversed(a)))
    assert len(fp.digest(a)) == 16 and int(fp.digest(a), 16) >= 0
    assert fp.digest(a) != fp.digest([("trainer/a.py", b"x = 2\n"), a[1]])  # content
    assert fp.digest(a) != fp.digest([("trainer/c.py", b"x = 1\n"), a[1]])  # path
    assert fp.digest(a) != fp.digest(a[:1])  # a file more or less


@needs_git
def test_at_commit_hashes_the_trainer_and_kernels_python_sources_at_that_commit(repo):
    first = _git(repo, "rev-parse", "HEAD")
    want = fp.digest([("trainer/loop.py", LOOP.encode()), ("trainer/model/layers.py", b"LAYERS = 2\n"),
                      ("kernels/attention.py", b"BLOCK = 64\n")])
    assert fp.at_commit(first, repo) == want == fp.at_commit(first[:7], repo)
    # files outside trainer/ and kernels/, and files that are not Python, do not count
    (repo / "planner.py").write_text("changed\n")
    (repo / "trainer" / "README.md").write_text("changed\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    assert fp.at_commit("HEAD", repo) == want
    # a kernel's edit does
    (repo / "kernels" / "attention.py").write_text("BLOCK = 128\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "three")
    assert fp.at_commit("HEAD", repo) not in (None, want)
    assert fp.at_commit(first, repo) == want  # (the old commit still reads as it was)
    # no such commit, no repository: unknown
    assert fp.at_commit("0" * 40, repo) is None and fp.at_commit("", repo) is None
    assert fp.at_commit(first, repo.parent) is None


@needs_git
def test_installed_fingerprint_is_the_checkouts_when_its_trainer_is_committed():
    src = fp.source_repo()
    if src is None:
        pytest.skip("coplan does not run from a git checkout")
    if _git(src, "status", "--porcelain", "--", *fp.CODE):
        pytest.skip("the checkout's trainer or kernels have uncommitted edits")
    assert fp.installed() == fp.at_commit("HEAD", src)


@needs_git
def test_of_runs_prefers_what_the_runs_recorded_then_their_commit_then_the_installed_trainer(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert fp.of_runs([{fp.KEY: "a" * 16}, {fp.KEY: "a" * 16}], repo) == ("a" * 16, "recorded by the runs")
    assert fp.of_runs([{fp.KEY: "a" * 16}, {fp.KEY: "b" * 16}], repo)[0] is None  # two trainers: no one fingerprint
    found, source = fp.of_runs([{"coplan_git_commit": head[:7]}, {"coplan_git_commit": head}], repo)
    assert found == fp.at_commit(head, repo) and head[:12] in source
    # two commits whose trainers differ: none
    (repo / "trainer" / "loop.py").write_text(LOOP.replace("1", "2"))
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    found, source = fp.of_runs([{"coplan_git_commit": head}, {"coplan_git_commit": _git(repo, "rev-parse", "HEAD")}], repo)
    assert found is None and "2 different trainers" in source
    # no commit this checkout holds: the installed trainer, said to be assumed
    found, source = fp.of_runs([{"coplan_git_commit": "f" * 40}, {}], repo)
    assert found == fp.installed() and source.startswith("assumed")


def _with(cal, fingerprint):
    return cal.model_copy(update={"versions": {**cal.versions, fp.KEY: fingerprint}})


def test_stale_when_the_runs_ran_other_trainer_code():
    cal = load_calibration(shipped()["NVIDIA H200"])
    assert fp.stale(_with(cal, fp.installed())) is None
    assert fp.stale(cal.model_copy(update={"versions": {k: v for k, v in cal.versions.items() if k != fp.KEY}})) is None
    why = fp.stale(_with(cal, "0123456789abcdef"))
    assert why and why.startswith("stale") and "0123456789abcdef" in why and fp.installed() in why and "coplan calibrate" in why


def test_every_shipped_calibration_records_its_runs_trainer():
    for path in shipped().values():
        cal = load_calibration(path)
        assert len(cal.versions.get(fp.KEY, "")) == 16 and cal.versions.get(fp.SOURCE_KEY)
        assert cal.versions.get(fp.SCHEME_KEY) == fp.SCHEME


def test_plan_and_its_file_say_so_when_the_calibration_is_stale(tmp_path, capsys):
    h200 = load_topology("h200-1gpu")
    base = load_calibration(shipped()["NVIDIA H200"])
    old, cur = tmp_path / "old.json", tmp_path / "current.json"
    for path, print_ in ((old, "0123456789abcdef"), (cur, fp.installed())):
        path.write_text(json.dumps(json.loads(_with(base, print_).model_dump_json())))
    cal, line = choose(str(old), h200)
    assert "[stale:" in cal.notes and "\nwarning: the calibration is stale" in line
    same, line = choose(str(cur), h200)
    assert same.notes == base.notes and "warning" not in line  # the same trainer: not marked
    out = tmp_path / "p.json"
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(out), "--gpus", "1", "--quiet",
                 "--calibration", str(old)]) == 0
    text = capsys.readouterr().out
    assert "warning: the calibration is stale" in text and "0123456789abcdef" in text
    assert "[stale:" in json.loads(out.read_text())["calibration"]["notes"]
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(out), "--gpus", "1", "--quiet", "--json",
                 "--calibration", str(cur)]) == 0
    assert "stale" not in json.loads(capsys.readouterr().out)["calibration_used"]


def test_the_report_says_so_when_the_plans_calibration_was_stale(tmp_path):
    from coplan.reports.build import build_report
    from coplan.reports.inputs import load_inputs

    base = load_calibration(shipped()["NVIDIA H200"])
    old = tmp_path / "old.json"
    old.write_text(json.dumps(json.loads(_with(base, "0123456789abcdef").model_dump_json())))
    out = tmp_path / "p.json"
    assert main(["plan", "-t", "h200-1gpu", "-w", "gem-tiny", "-o", str(out), "--gpus", "1", "--quiet",
                 "--calibration", str(old)]) == 0
    report = build_report(load_inputs(out), scaling=False, what_if=False)
    assert any("calibration (NVIDIA H200) is stale" in p and "0123456789abcdef" in p for p in report.summary)


def _files(**named):
    """``trainer__model__gem`` -> ``trainer/model/gem.py``; ``kernels__init`` -> ``kernels/__init__.py``."""
    def path(name: str) -> str:
        parts = name.split("__")
        return "/".join(parts[:-1] + ["__init__" if parts[-1] == "init" else parts[-1]]) + ".py"
    return [(path(name), text.encode()) for name, text in named.items()]


def test_the_fingerprint_covers_the_trainer_and_the_kernels_it_imports():
    files = _files(trainer__loop="from coplan.kernels import api\nimport coplan.kernels.fp8 as f8\n",
                   trainer__model__gem="def f():\n    from coplan.kernels.film import norm  # imported late\n",
                   kernels__init="from .common import X\n", kernels__api="from .ops import y\n",
                   kernels__ops="", kernels__common="", kernels__fp8="", kernels__film="",
                   kernels__unused="from .common import X\n", kernels__bench_only="import kernels.unused\n")
    kept = {p for p, _ in fp.step_files(files)}
    # the trainer's modules; what they import, through other kernels and the packages on the way
    assert kept == {"trainer/loop.py", "trainer/model/gem.py", "kernels/__init__.py", "kernels/api.py", "kernels/ops.py",
                    "kernels/common.py", "kernels/fp8.py", "kernels/film.py"}
    # a kernel no trainer module reaches does not move the fingerprint; one that it imports does
    base = fp.digest(fp.step_files(files))
    assert fp.digest(fp.step_files(files + _files(kernels__new_fp8="X = 1\n"))) == base
    edited = [(p, b"changed\n" if p == "kernels/ops.py" else c) for p, c in files]
    assert fp.digest(fp.step_files(edited)) != base
    # the legacy scheme: every file
    assert fp.step_files(files, fp.LEGACY_SCHEME) == files
    # a trainer module that does not parse counts as importing every kernel
    broken = [(p, b"def (" if p == "trainer/loop.py" else c) for p, c in files]
    assert {p for p, _ in fp.step_files(broken)} == {p for p, _ in files}


@needs_git
def test_a_kernel_the_trainer_does_not_import_leaves_the_fingerprint(repo):
    before = fp.at_commit("HEAD", repo)
    (repo / "kernels" / "fp8_next.py").write_text("NOT_WIRED = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a kernel not yet wired in")
    assert fp.at_commit("HEAD", repo) == before
    assert fp.at_commit("HEAD", repo, fp.LEGACY_SCHEME) != fp.at_commit("HEAD~1", repo, fp.LEGACY_SCHEME)
    (repo / "trainer" / "loop.py").write_text(LOOP + "from coplan.kernels import fp8_next\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "wired in")
    assert fp.at_commit("HEAD", repo) != before


def test_a_calibration_without_a_scheme_is_judged_as_it_was_taken():
    cal = load_calibration(shipped()["NVIDIA H200"])
    legacy = cal.model_copy(update={"versions": {k: v for k, v in cal.versions.items() if k != fp.SCHEME_KEY}
                                    | {fp.KEY: fp.installed(fp.LEGACY_SCHEME)}})
    assert fp.stale(legacy) is None
    current = cal.model_copy(update={"versions": {**cal.versions, fp.KEY: fp.installed(), fp.SCHEME_KEY: fp.SCHEME}})
    assert fp.stale(current) is None
