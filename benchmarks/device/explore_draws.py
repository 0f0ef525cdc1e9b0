"""Scratch (not committed): default vs --compile layers on three fresh draws, with the step anatomy."""
import json, os, subprocess, sys, time, gzip, shutil
from pathlib import Path
root = Path(sys.argv[1]); out = Path(os.environ.get("OUT", "/tmp/out"))
sys.path.insert(0, str(root / "benchmarks"))
from _step_anatomy import step_anatomy, verdict
plans = root / "benchmarks/results/fresh_plans"
rows = []
t_end = time.time() + float(sys.argv[2])
import itertools
for seed, variants in [("20261204150423", [[], ["again"], ["gil"]]), ("20261204150427", [[]]), ("20261204150424", [[]])]:
    for v in variants:
        if time.time() > t_end - 60:
            break
        rid = f"{seed}-{'-'.join(v) or 'default'}"
        t0 = time.time()
        env = dict(os.environ)
        if v == ["gil"]:
            env["PYTHONPATH"] = "/tmp/sc:" + env["PYTHONPATH"]
        p = subprocess.run([sys.executable, "-m", "coplan.cli", "train", str(plans / f"draw-{seed}.plan.json"), "--steps", "16",
                            "--runs-root", "/tmp/runs", "--run-id", rid, "--no-progress"], env=env,
                           capture_output=True, text=True, timeout=max(30, t_end - time.time()))
        row = {"rid": rid, "exit": p.returncode, "wall_s": time.time() - t0}
        sp = Path("/tmp/runs") / rid / "summary.json"
        if sp.is_file():
            s = json.loads(sp.read_text())
            row |= {"p50": s["step_time"]["p50_s"], "mfu": s["measured_mfu"], "startup": s.get("startup"), "loader": s.get("loader")}
            a = step_anatomy(Path("/tmp/runs") / rid)
            row |= {"anatomy": a, "where": verdict(a)}
            tr = Path("/tmp/runs") / rid / "traces" / "rank0.json"
            if tr.is_file() and seed == "20261204150423":
                with open(tr, "rb") as f, gzip.open(out / f"{rid}.json.gz", "wb") as g:
                    shutil.copyfileobj(f, g)
        else:
            row["tail"] = p.stdout[-1500:] + p.stderr[-2500:]
        print(json.dumps({k: row.get(k) for k in ("rid", "exit", "wall_s", "p50", "mfu", "where", "startup", "loader")}), flush=True)
        rows.append(row)
(out / "explore.json").write_text(json.dumps(rows, indent=1))
