#!/usr/bin/env bash
# Stop the daemons that scripts/slurm_up.sh DIR started (by the pids in DIR/*.pid, nothing else):
# SIGTERM, then SIGKILL after 10 s. Exits 1 if one of them is still alive.
set -euo pipefail

DIR=${1:?usage: slurm_down.sh DIR}
status=0
for name in slurmd slurmctld munged; do
    pidfile=$DIR/$name.pid
    [[ -s $pidfile ]] || continue
    pid=$(<"$pidfile")
    kill "$pid" 2>/dev/null || { rm -f "$pidfile"; continue; }
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -9 "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    if kill -0 "$pid" 2>/dev/null; then
        echo "slurm_down.sh: $name (pid $pid) still running" >&2
        status=1
    else
        rm -f "$pidfile"
    fi
done
exit "$status"
