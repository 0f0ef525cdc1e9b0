#!/usr/bin/env bash
# Install coplan with everything its tests need on a CPU-only machine (Python 3.10-3.12).
#
# Why not just `pip install -e ".[train,test]"`: torchrec depends on `fbgemm-gpu`, the CUDA build
# (hundreds of MB, useless without a GPU). On CPU the matching wheel is `fbgemm-gpu-cpu`, so torchrec
# is installed with --no-deps next to it, and its pure-Python dependencies are named here.
# Version pairs (FBGEMM's compatibility table): fbgemm 1.6<->torch 2.11, 1.7<->2.12, 1.8<->2.13,
# 1.9<->2.14; torchrec and fbgemm share minor versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
$PIP install -q --upgrade pip
$PIP install -q "torch==2.13.0" "triton==3.7.1" "fbgemm-gpu-cpu==1.8.0"
$PIP install -q --no-deps "torchrec==1.8.0"
# torchao's float8 training (the fp8 recipes torchao-tensorwise / torchao-rowwise); also in the test extra
$PIP install -q "torchao==0.18.0"
$PIP install -q "tensordict>=0.10" "torchmetrics==1.0.3" "pyre-extensions" "iopath" "tqdm>=4.66"
$PIP install -q -e ".[test]"
python - <<'PY'
import torch, torchao, torchrec, triton, coplan
print(f"coplan {coplan.__version__}: torch {torch.__version__}, torchrec {torchrec.__version__}, triton {triton.__version__}, "
      f"torchao {torchao.__version__}")
PY
