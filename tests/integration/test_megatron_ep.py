"""Expert parallelism on the CPU: a tiny Qwen3-MoE on Megatron-Core's MoE layer, experts split over 2 ranks
(gloo, EP=2), trains like 1 process.

Launches tests/integration/megatron_ep_worker.py under torchrun (concurrently, each with a timeout):
  1       one process (EP=1, PP=1): the reference
  ep2     2 ranks, EP=2: each rank holds 2 of the 4 experts and half of the batch (EP ranks are
          data-parallel ranks; one rank's last micro-batch has no response tokens and still runs, for
          the other rank's token dispatch)
  pp2     2 ranks, PP=2, EP=1: the MoE layers split over pipeline stages (-m long)
  ep2pp2  4 ranks, EP=2 x PP=2 (-m long)
Cases fp32 and fp8 (FP8 expert GEMMs, emulated). Checked on every rank: the log-probs of its rows equal
one process's (fp32: within 1e-6), 5 Trainer.train_step (PPO ratio, micro-batches of 1, gradient
clipping by the global norm: every expert counted once) give losses within 1e-6 and final HF weights
(every expert gathered to every rank) within 1e-6; FP8 bytes of all experts equal one process's.
"""

import importlib.util
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from torchrun_jobs import launch_worker, torchrun, wait_all
from numeric_bounds import loss_gap

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "megatron_ep_worker.py"
STEPS = 5
CASES = ("fp32", "fp8", "nan")
RUNS = {"1": (1, 1, 1), "ep2": (2, 2, 1), "pp2": (2, 1, 2), "ep2pp2": (4, 2, 2)}  # nproc, ep, pp
LONG_RUNS = ("pp2", "ep2pp2")  # -m long: 6 more processes; EP x PP, and PP alone, on the MoE
RUN_PARAMS = [pytest.param(run, marks=[pytest.mark.long] if run in LONG_RUNS else []) for run in RUNS if run != "1"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core not installed (pip install megatron-core==0.16.1)")


def launch(nproc: int, ep: int, pp: int, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return launch_worker(nproc, WORKER, "--out", out, "--steps", STEPS, "--cases", ",".join(CASES), "--ep", ep,
                         "--pp", pp)


def _launch_and_load(tmp: Path, names) -> dict:
    """{run: {case: [rank 0's result, rank 1's ...]}} of the runs `names`, launched together."""
    wait_all({name: launch(*RUNS[name], tmp / name) for name in names})
    return {name: {case: [torch.load(tmp / name / f"{case}.rank{r}.pt", weights_only=False)
                          for r in range(RUNS[name][0])] for case in CASES} for name in names}


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    return _launch_and_load(tmp_path_factory.mktemp("megatron_ep"), [r for r in RUNS if r not in LONG_RUNS])


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory, default_runs):
    return {**default_runs, **_launch_and_load(tmp_path_factory.mktemp("megatron_ep_long"), LONG_RUNS)}


@pytest.fixture
def runs(request, run):
    """The results `run` needs: the long fixture only when a long run is selected."""
    return request.getfixturevalue("long_runs" if run in LONG_RUNS else "default_runs")


@pytest.mark.parametrize("run", RUN_PARAMS)
@pytest.mark.parametrize("case", ["fp32", "fp8"])
def test_expert_parallel_training_matches_one_process(runs, run, case):
    one = runs["1"][case][0]
    w1 = one["weights"]
    nproc, ep, pp = RUNS[run]
    for rank, other in enumerate(runs[run][case]):
        start, stop = other["rows"]
        assert (other["ep"], other["pp"], other["dp"]) == (ep, pp, nproc // pp)
        assert other["local_experts"] == 4 // ep and other["num_params"] == one["num_params"]
        lp = (other["logprobs0"] - one["logprobs0"][start:stop]).abs().max().item()
        lp_end = (other["logprobs_end"] - one["logprobs_end"][start:stop]).abs().max().item()
        diffs = [loss_gap(a, b) for a, b in zip(other["losses"], one["losses"])]
        wdiff = max((other["weights"][k] - w1[k]).abs().max().item() for k in w1)
        gdiff = max(abs(a - b) for a, b in zip(other["grad_norms"], one["grad_norms"]))
        print(f"{run} {case} rank {rank}: |loss diff| {diffs}, max |weight diff| {wdiff:.2e}, "
              f"|logprob diff| {lp:.2e} (after training {lp_end:.2e}), |grad norm diff| {gdiff:.2e}")
        assert one["losses"][-1] < one["losses"][0]  # it learns
        assert min(one["grad_norms"]) > 0.5  # grad_clip=0.5 clipped every step: by the global norm
        assert set(other["weights"]) == set(w1)  # every expert on every rank
        assert max(diffs) <= 1e-6 and wdiff <= 1e-6 and gdiff <= 1e-5
        assert lp <= 1e-6 and lp_end <= 1e-6
        if case == "fp8" or ep == 1:  # the forward runs the same GEMMs on the same rows as one process
            assert lp == 0.0
        if case == "fp8":  # the experts' FP8 bytes, gathered from every EP rank and stage
            assert other["fp8_checksum"] == one["fp8_checksum"]
        if ep == 1:  # pipeline stages alone: the same sums in the same order as one process
            assert other["losses"] == one["losses"] and wdiff == 0.0


@pytest.mark.parametrize("run", [pytest.param("1"), *RUN_PARAMS])
def test_a_nan_on_one_rank_is_a_skipped_step_on_every_rank(runs, run):
    """FP8, a NaN put into one token's embedding on one rank only (the last data-parallel rank of the first
    stage) in RL step 1: every rank skips that step together, none left waiting in the experts' token
    dispatch (before: the other EP rank hung there), and training goes on as if the step had not been
    there; the same NaN in compute_logprobs raises NonFiniteError on every rank."""
    for rank, (fp8, nan) in enumerate(zip(runs[run]["fp8"], runs[run]["nan"])):
        assert nan["skipped"] == [0.0, 1.0, 0.0, 0.0, 0.0], (rank, nan["skipped"])
        assert math.isnan(nan["losses"][1])
        assert nan["losses"][0] == fp8["losses"][0] and nan["losses"][2] == fp8["losses"][1], (rank, nan["losses"])
        assert nan["logprobs_nonfinite"], rank


def test_jetflow_train_expert_parallel_equals_data_parallel_and_resumes(tmp_path):
    """`jetflow train` on configs/tiny-moe.yaml (unified FP8, router aux loss) with train.backend=megatron:
    under torchrun, 2 ranks with train.expert_parallel_size=2 give every step's loss, grad
    norm and the final weights of 2 data-parallel ranks that each hold all experts, bit for bit. Then the
    EP run, cut back to its step-2 checkpoint as if killed after it, resumes (every EP rank gets its own
    experts' AdamW moments back) to the uninterrupted run's final weights, bit for bit."""
    import shutil

    from safetensors.torch import load_file

    from jetflow.metrics_log import read_metrics
    from jetflow.run.files import COMPLETE

    common = ["--config", "configs/tiny-moe.yaml", "train.backend=megatron", "train.steps=3",
              "train.sft_warmup_steps=4", "train.prompts_per_step=4", "rollout.group_size=4", "algo.ppo_epochs=2",
              "train.checkpoint_every=1", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
              f"run.out_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONWARNINGS": "ignore"}

    def start(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([*torchrun(), "-m", "jetflow.cli", "train", "--no-report", *common, f"run.name={name}", *extra],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    wait_all({"dp2": start("dp2"), "ep2": start("ep2", "train.expert_parallel_size=2")}, timeout=600)
    dp2, ep2 = (read_metrics(tmp_path / name) for name in ("dp2", "ep2"))
    assert [r["step"] for r in ep2] == [r["step"] for r in dp2] == [0, 1, 2]
    rl = [r for r in ep2 if "loss/router_aux" in r]
    assert rl and all(r["loss/router_aux"] > 0 for r in rl)  # the router load-balancing loss is on
    for a, b in zip(dp2, ep2):
        assert a.get("train/loss") == b.get("train/loss") and a.get("train/grad_norm") == b.get("train/grad_norm"), (a, b)
    w_dp, w_ep = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("dp2", "ep2"))
    assert w_dp.keys() == w_ep.keys() and all(torch.equal(w_dp[k], w_ep[k]) for k in w_dp)

    run = tmp_path / "ep2"
    saved = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert len(saved["tp_states"]) == 2  # one optimizer state per EP rank (different experts)
    final = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    shutil.rmtree(run / "checkpoints" / "step_000003")  # as if killed after step 2's checkpoint
    (run / "checkpoints" / "latest").write_text("step_000002")
    (run / COMPLETE).unlink()
    wait_all({"ep2-resumed": start("ep2", "train.expert_parallel_size=2", "run.resume=true")}, timeout=600)
    assert (run / COMPLETE).exists() and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    resumed = load_file(str(run / "checkpoints" / "step_000003" / "model.safetensors"))
    assert final.keys() == resumed.keys()
    for name, tensor in final.items():  # the same layout and the same sums: bit for bit
        assert torch.equal(resumed[name], tensor), name
