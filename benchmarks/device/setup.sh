#!/usr/bin/env bash
# Prepares a lent, offline GPU machine (Python 3.12, torch 2.11+cu130, triton 3.6) to run coplan's
# GPU benchmarks, from the repository root copy that the device tool provides.
#   1. Wheels into /tmp/site: the small ones in .whl (pydantic, torchrec, ...; see
#      shared/offline-gpu/prepare.sh), any extras in .whl2, and fbgemm-gpu when /tmp/fb holds its
#      parts (carried by earlier calls from .fb1 ... .fb10: 48 MiB each, since one call carries at most
#      64 MiB with the ~7 MB working tree; 58 MiB parts stopped fitting once the tree grew past 6 MB).
#   2. coplan: assembled as a package in /tmp/pkg/coplan following pyproject.toml's package-dir
#      (the repository's own coplan/ folder would otherwise shadow the mapped subpackages).
# Afterwards: cd /tmp && PYTHONPATH=/tmp/pkg:/tmp/site python3 <script>.
set -euo pipefail
root=$(pwd)
if [ ! -f /tmp/site/.whl-done ]; then
  # Small wheels (pydantic for the specs, torchrec and its pure-Python dependencies).
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl && touch /tmp/site/.whl-done
fi
if ls /tmp/fb/fbgemm_gpu.part.* >/dev/null 2>&1 && [ ! -d /tmp/site/fbgemm_gpu ]; then
  cat /tmp/fb/fbgemm_gpu.part.* > /tmp/fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/fbgemm_gpu-*.whl
fi
if [ -d "$root/.whl2" ] && [ ! -f /tmp/site/.whl2-done ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl2/*.whl && touch /tmp/site/.whl2-done
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg
python3 - "$root" <<'PY'
import shutil, sys, tomllib
from pathlib import Path
root = Path(sys.argv[1])
cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
for name, folder in sorted(cfg["package-dir"].items(), key=lambda kv: kv[0].count(".")):
    dst = Path("/tmp/pkg", *name.split("."))
    if not dst.exists():
        shutil.copytree(root / folder, dst, ignore=shutil.ignore_patterns("__pycache__"))
PY
rm -rf /tmp/benchmarks && cp -r "$root/benchmarks" /tmp/benchmarks
echo "coplan assembled in /tmp/pkg; commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
