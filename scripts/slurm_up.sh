#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine, every file of it under DIR (no /etc changes):
# a private munged (own socket), slurmctld and slurmd, with the daemons' pids in DIR/*.pid.
#
#   bash scripts/slurm_up.sh /tmp/slurm          # prints the line below once the node is idle
#   export SLURM_CONF=/tmp/slurm/slurm.conf      # then sbatch / sinfo / squeue / scontrol as usual
#   bash scripts/slurm_down.sh /tmp/slurm        # stops exactly the daemons started here
#
# Needs root (SlurmUser=root) and Debian's `slurmctld slurmd slurm-client munge` packages.
# SLURMCTLD_PORT / SLURMD_PORT (default 6817 / 6818) move the daemons off the standard ports;
# MUNGE_KEY (default /etc/munge/munge.key, made by the munge package) is the key munged uses.
set -euo pipefail

DIR=${1:?usage: slurm_up.sh DIR}
CTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
KEY=${MUNGE_KEY:-/etc/munge/munge.key}

[[ $(id -u) -eq 0 ]] || { echo "slurm_up.sh: needs root (the daemons run as SlurmUser=root)" >&2; exit 1; }
for bin in munged slurmctld slurmd sinfo; do
    if ! command -v "$bin" >/dev/null; then
        echo "slurm_up.sh: $bin not found (apt-get install slurmctld slurmd slurm-client munge)" >&2
        exit 1
    fi
done
[[ -r $KEY ]] || { echo "slurm_up.sh: munge key $KEY not readable" >&2; exit 1; }

mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/log
DIR=$(cd "$DIR" && pwd)
HOST=$(hostname -s)
CONF=$DIR/slurm.conf

cat >"$CONF" <<CONF
ClusterName=jetflow
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the backfill pass every second (default 30 s): a requeued job, held until its old credential expires,
# starts when that hold ends instead of at the next 30-s pass
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MinJobAge=3600
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF

munged --force --socket="$DIR/munge.socket" --key-file="$KEY" --pid-file="$DIR/munged.pid" \
    --seed-file="$DIR/munged.seed" --log-file="$DIR/log/munged.log"
slurmctld -f "$CONF"
slurmd -f "$CONF" -N "$HOST"

export SLURM_CONF=$CONF
for _ in $(seq 60); do
    if [[ $(sinfo -h -o %t 2>/dev/null) == idle ]]; then
        echo "export SLURM_CONF=$CONF"
        exit 0
    fi
    sleep 0.5
done
echo "slurm_up.sh: node $HOST not idle after 30 s; logs in $DIR/log" >&2
sinfo >&2 || true
exit 1
