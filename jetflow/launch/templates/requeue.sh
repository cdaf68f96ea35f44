# shellcheck shell=bash
# Sourced by the jetflow SLURM templates (jetflow/launch/templates/*.sbatch), not run on its own.
#
#   run_requeueable RUN_DIR COMMAND...
#
# runs COMMAND (a `jetflow train ...` launch) so that a job reaching its time limit loses nothing:
# - the templates ask SLURM for `--signal=B:USR1@T`: T seconds before the time limit the batch shell
#   gets SIGUSR1 and passes it on to COMMAND (srun passes it to its tasks, torchrun to its workers);
#   the run checkpoints at its next step boundary, writes RUN_DIR/STOPPED and ends;
# - when the run wrote STOPPED while this job ran, the job is requeued (`scontrol requeue`, needs
#   `--requeue`): it starts again with the same script, and then
# - COMMAND gets `run.resume=true` when the run directory has STOPPED (also after a manual
#   resubmission of the same script) or the job is a requeue (SLURM_RESTART_COUNT > 0, as after a
#   preemption with PreemptMode=REQUEUE); a resume with no checkpoint yet starts from the beginning.
# A run that fails or is cancelled (scancel: SIGTERM to every step, no requeue) keeps its exit code.

run_requeueable() {
    local run_dir=$1 pid rc before
    shift
    if [[ -f $run_dir/STOPPED ]] || ((${SLURM_RESTART_COUNT:-0} > 0)); then
        echo "jetflow: continuing the run in $run_dir (run.resume=true; restart ${SLURM_RESTART_COUNT:-0})"
        set -- "$@" run.resume=true
    fi
    before=$(stat -c %.9Y "$run_dir/STOPPED" 2>/dev/null || echo none)  # the run removes it as it starts
    "$@" &
    pid=$!
    # shellcheck disable=SC2064  # $pid is meant to be expanded now
    trap "echo 'jetflow: SIGUSR1 (time limit near): the run checkpoints at its next step boundary, then stops'; kill -USR1 $pid 2>/dev/null || true" USR1
    while true; do  # `wait` returns early when a trapped signal arrives; the run goes on until it ends
        rc=0
        wait "$pid" || rc=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    trap - USR1
    if [[ -f $run_dir/STOPPED && $(stat -c %.9Y "$run_dir/STOPPED") != "$before" ]]; then  # written by this run
        echo "jetflow: the run stopped with a checkpoint ($(cat "$run_dir/STOPPED")); requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$rc"
}
