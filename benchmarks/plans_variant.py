"""A development variant of a plan set: every plan's workload with one ``kernels`` field changed (and its hash
updated), the same choices otherwise, for an A/B of the trainer on the same draws (``stage.sh draws`` with
``H100_PLANS``/``H200_PLANS`` naming the copy). Not a user path: the variant's runs are compared with the set's
own, never reported as held-out figures.

    python benchmarks/plans_variant.py --plans benchmarks/results/fresh_plans_h100f --set film=eager \
        --out benchmarks/results/fresh_plans_h100f_eager
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=Path, required=True)
    ap.add_argument("--set", required=True, help="KEY=VALUE of the workload's kernels (e.g. film=eager)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from coplan.spec import Plan
    from coplan.spec.hashing import spec_sha256

    key, _, value = a.set.partition("=")
    if a.out.exists():
        shutil.rmtree(a.out)
    shutil.copytree(a.plans, a.out)
    for f in sorted(a.out.glob("*.plan.json")):
        p = json.loads(f.read_text())
        p["workload"].setdefault("kernels", {})[key] = value
        p["workload_sha256"] = ""
        p["workload_sha256"] = spec_sha256(Plan.model_validate(p).workload)
        f.write_text(json.dumps(p, indent=1))
        Plan.model_validate(json.loads(f.read_text()))  # (loads as the trainer loads it)
        print(f"{f.name}: kernels.{key} = {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
