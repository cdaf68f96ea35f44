#!/usr/bin/env bash
# A new user following README "Your own task" on a fresh clone; each phase timed.
set -euo pipefail
rm -rf /tmp/fresh-own
t0=$(date +%s.%N)
git clone -q --branch issue40-task /work/wt-task /tmp/fresh-own
cd /tmp/fresh-own
t1=$(date +%s.%N)
bash scripts/install.sh
t2=$(date +%s.%N)
. .venv/bin/activate
jetflow train --config examples/own_task/config.yaml
t3=$(date +%s.%N)
ls runs/own-task runs/own-task/report
echo "clone $(echo "$t1 - $t0" | bc) s; install $(echo "$t2 - $t1" | bc) s; train $(echo "$t3 - $t2" | bc) s; total $(echo "$t3 - $t0" | bc) s"
du -sh .venv
