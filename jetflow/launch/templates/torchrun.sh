#!/usr/bin/env bash
# Run `jetflow train` under torchrun, on one node or as one node of many.
#
#   T=jetflow/launch/templates   # in a source checkout; where jetflow is installed:
#   T=$(python -c 'import jetflow.launch; print(jetflow.launch.TEMPLATES)')
#   $T/torchrun.sh --config configs/tiny.yaml train.steps=2             # 1 node, NPROC_PER_NODE=1
#   NPROC_PER_NODE=2 $T/torchrun.sh --config configs/tiny.yaml          # 2 processes on this node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 NPROC_PER_NODE=8 $T/torchrun.sh --config ...   # on host0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=host0 NPROC_PER_NODE=8 $T/torchrun.sh --config ...   # on host1
#
# Environment: NNODES (default $SLURM_NNODES, else 1), NODE_RANK (default $SLURM_NODEID, else 0),
# NPROC_PER_NODE (1), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), JETFLOW_PYTHON (the Python with
# jetflow installed: the SLURM templates set it; default the checkout's .venv, else `python`). Under
# srun the SLURM defaults make one task per node enough. All arguments go to `jetflow train`.
#
# Stop requests: torchrun passes SIGTERM, SIGINT and SIGUSR1 on to its workers, which checkpoint at
# the next step boundary and exit, and waits JETFLOW_STOP_TIMEOUT_S (default 600) seconds for them
# before it kills them (torchrun's own default, 30 s, is shorter than one RL step of a real model).
# jetflow.launch.torchrun is torchrun with a one-line error where a rank fails (a rank killed by SIGKILL
# is named with its signal) instead of torchrun's traceback.
set -euo pipefail

NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

# JETFLOW_PYTHON, else the source checkout's virtual environment (relative to this script), else `python`
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PYTHON=${JETFLOW_PYTHON:-python}
if [[ -z ${JETFLOW_PYTHON:-} && -x $ROOT/.venv/bin/python ]]; then
    PYTHON=$ROOT/.venv/bin/python
fi

exec "$PYTHON" -m jetflow.launch.torchrun \
    --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    --signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown_timeout="${JETFLOW_STOP_TIMEOUT_S:-600}" \
    -m jetflow.cli train "$@"
