#!/usr/bin/env bash
# Where a graphed step's host time goes: run `coplan train PLAN` for STEPS steps and sample its worker's
# Python stacks with py-spy (carried in .whl2; installed into /tmp/site by setup.sh) for SECONDS once it is
# past its start-up, writing py-spy's raw (collapsed) stacks to OUT_FILE. A diagnostic, not a figure.
#   bash benchmarks/device/host_spy.sh PLAN OUT_FILE [STEPS] [WAIT_S] [SECONDS]
set -uo pipefail
plan=$1; out=$2; steps=${3:-400}; wait_s=${4:-45}; secs=${5:-12}
python3 -m coplan.cli train "$plan" --steps "$steps" --runs-root /tmp/spyruns --run-id spy --no-progress --trace none > "$out.log" 2>&1 &
sleep "$wait_s"
pid=$(pgrep -f "coplan.trainer.train" | tail -n 1)
if [ -n "$pid" ]; then /tmp/site/bin/py-spy record -p "$pid" -d "$secs" -r 200 -f raw --threads -o "$out" > /dev/null 2>&1; fi
pkill -f "coplan.trainer" ; sleep 3; rm -rf /tmp/spyruns
tail -n 3 "$out.log"
