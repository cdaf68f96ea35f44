"""The FSDP2 trainer (`train.backend=fsdp`) under torchrun, 2 CPU processes over gloo (issue 41):

- exact on-policy: the rollout engine's log-probs equal the sharded trainer's on every RL step (KL 0,
  every token equal), in fp32 and unified;
- fp32: per-step losses within summation-order noise of the native trainer's torchrun data parallelism
  at the same world size (the bound of numeric_bounds: the two differ in summation order only);
- the reference policy (algo.log_ref_kl in fp32, algo.kl_coef in unified): KL to it 0 at RL step 0, > 0 after,
  and the same after a resume (reference.pt);
- deterministic: two identical unified runs log identical metrics;
- HSDP (train.data_parallel_shard_size=2 at 4 ranks): exact on-policy, fp32 losses within summation-order
  noise of the 2-rank FSDP run;
- the FP8 all-gather (unified): across 2 ranks the gathered bytes and scales are the whole weight's,
  the gradients those of a replicated Decoder, and the all-gathers move 1 byte an FP8 weight;
- checkpoints: the optimizer shards in a DCP directory; a resume at 2 ranks from the step before the end
  writes the same final weights bit for bit, a resume at 1 rank completes within summation-order noise;
  the exported model directory loads as any run's; a rank SIGKILLed in the warm-up ends the run in one line
  (jetflow.launch.torchrun) and the directory resumes at 1 rank (-m long: a SIGTERM in the warm-up at 2 ranks).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow.launch.torchrun import RESUME
from jetflow.metrics_log import read_metrics
from jetflow.run.stop import EXIT_FAULT
from jetflow.run.files import COMPLETE
from numeric_bounds import loss_gap
from torchrun_jobs import launch_worker, torchrun, wait_all

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--config", "configs/tiny.yaml", "train.steps=3", "train.sft_warmup_steps=10", "train.prompts_per_step=4",
          "rollout.group_size=4", "run.progress=false", "run.tensorboard=false", "run.num_threads=1",
          "eval.num_prompts=0", "train.checkpoint_every=1", "run.name=r",
          "train.micro_batch_size=2"]  # 4 micro-batches per rank in an RL step: FSDP accumulates 4 reduce-scatters
# the fp32 FSDP runs keep a reference policy and log the KL to it (algo.log_ref_kl: the loss unchanged)
FSDP_FP32 = ["precision.mode=fp32", "train.backend=fsdp", "algo.log_ref_kl=true"]
FP32_GAP = 1e-5  # as tests/integration/test_torchrun_dp.py: fp32 summation order over a few steps (numeric_bounds)


def _run(launcher: list[str], out: Path, *overrides: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([*launcher, "-m", "jetflow.cli", "train", "--no-report", *COMMON, f"run.out_dir={out}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "r"


def _rl(run: Path) -> list[dict]:
    return read_metrics(run, "rl")


def _assert_exact_on_policy(run: Path) -> None:
    rows = _rl(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, r


def _assert_reference_kl(run: Path) -> None:
    """The reference (a second FSDPPolicy, frozen when RL began) is the policy at step 0, then it is not."""
    kl = [r["kl/ref"] for r in _rl(run)]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:]), kl
    assert (run / "reference.pt").is_file()


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_fp32")
    fsdp = _run(torchrun(2), root / "fsdp", *FSDP_FP32)
    native = _run(torchrun(2), root / "native", "precision.mode=fp32")
    return fsdp, native


def test_fsdp_fp32_is_exact_on_policy_and_within_summation_order_of_native_data_parallel(fp32_runs):
    fsdp, native = fp32_runs
    _assert_exact_on_policy(fsdp)
    _assert_reference_kl(fsdp)
    a, b = read_metrics(fsdp), read_metrics(native)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    assert any(abs(r["train/loss"]) > 1e-3 for r in _rl(fsdp)), "no RL step had a learning signal: vacuous"
    for x, y in zip(a, b):
        assert loss_gap(x["train/loss"], y["train/loss"]) <= FP32_GAP, (x["phase"], x["step"], x["train/loss"],
                                                                       y["train/loss"])
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4, abs=1e-6)
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["data_parallel_size"] == 2 and (fsdp / COMPLETE).exists()


def test_fsdp_checkpoint_holds_every_ranks_optimizer_shards_and_exports_the_model(fp32_runs):
    fsdp, _ = fp32_runs
    ckpt = fsdp / "checkpoints" / "step_000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= set(manifest)
    assert torch.load(ckpt / "trainer.pt", weights_only=True)["optimizer"] is None  # moved into the shards
    from jetflow.model import load
    exported = load(str(fsdp / "model"))  # the final HF directory, read by the model loader
    weights = load_file(str(ckpt / "model.safetensors"))
    for name, tensor in exported.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name].to(torch.bfloat16).to(tensor.dtype)), name


def test_hsdp_two_by_two_is_exact_on_policy_and_within_summation_order_of_fsdp(fp32_runs, tmp_path):
    """HSDP at 4 ranks (train.data_parallel_shard_size=2: 2 replicas of 2 shards): KL 0 on every RL step, and
    every loss within fp32 summation-order noise of the 2-rank FSDP run (the fixture's: the same global
    batches; the two sum the same per-rank gradient terms grouped otherwise, jetflow.train.fsdp.policy)."""
    fsdp, _ = fp32_runs
    hsdp = _run(torchrun(4), tmp_path, *FSDP_FP32, "train.data_parallel_shard_size=2")
    _assert_exact_on_policy(hsdp)
    a, b = read_metrics(hsdp, "sft") + _rl(hsdp), read_metrics(fsdp, "sft") + _rl(fsdp)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b] and len(a) == 13
    for x, y in zip(a, b):
        assert loss_gap(x["train/loss"], y["train/loss"]) <= FP32_GAP, (x["phase"], x["step"], x["train/loss"],
                                                                       y["train/loss"])
    summary = json.loads((hsdp / "summary.json").read_text())
    assert summary["data_parallel_size"] == 4 and summary["config"]["train"]["data_parallel_shard_size"] == 2
    assert {f"optimizer/__{r}_0.distcp" for r in range(4)} <= set(
        json.loads((hsdp / "checkpoints" / "step_000003" / "manifest.json").read_text()))


def _truncated_copy(run: Path, dest: Path) -> Path:
    """The run as if killed after writing step 2's checkpoint: step_000003 and the end marker gone."""
    shutil.copytree(run.parent, dest)
    copy = dest / run.name
    shutil.rmtree(copy / "checkpoints" / "step_000003")
    (copy / COMPLETE).unlink()
    (copy / "checkpoints" / "latest").write_text("step_000002")
    return copy


def test_fsdp_resumes_bit_for_bit_at_two_ranks_and_completes_at_one_rank(fp32_runs, tmp_path):
    fsdp, _ = fp32_runs
    final = load_file(str(fsdp / "checkpoints" / "step_000003" / "model.safetensors"))
    two = _truncated_copy(fsdp, tmp_path / "two")
    _run(torchrun(2), two.parent, *FSDP_FP32, "run.resume=true")
    again = load_file(str(two / "checkpoints" / "step_000003" / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)
    assert [r["train/loss"] for r in _rl(two)] == [r["train/loss"] for r in _rl(fsdp)]
    # the reference from reference.pt (the initial weights), not the resumed policy's step-2 weights
    assert [r["kl/ref"] for r in _rl(two)] == [r["kl/ref"] for r in _rl(fsdp)]

    one = _truncated_copy(fsdp, tmp_path / "one")
    _run([sys.executable], one.parent, *FSDP_FP32, "run.resume=true")
    assert (one / COMPLETE).exists()
    for x, y in zip(_rl(one), _rl(fsdp)):
        assert loss_gap(x["train/loss"], y["train/loss"]) <= FP32_GAP
    resumed = load_file(str(one / "checkpoints" / "step_000003" / "model.safetensors"))
    # one AdamW step from restored moments moves a weight by summation-order noise; from fresh moments (a
    # lost optimizer state) by about lr = 5e-4 (Adam's first step is lr * sign)
    assert max((final[k] - resumed[k]).abs().max().item() for k in final) < 1e-6


def test_fsdp_unified_is_exact_on_policy_and_deterministic(tmp_path):
    """With a KL penalty: the reference's FP8 weights are their bytes only (hidden 128 at 2 ranks: 64 rows a
    rank, each 128-row block's scale shared by both)."""
    kl = "algo.kl_coef=0.05"
    first = _run(torchrun(2), tmp_path / "a", "precision.mode=unified", "train.backend=fsdp", kl)
    second = _run(torchrun(2), tmp_path / "b", "precision.mode=unified", "train.backend=fsdp", kl)
    _assert_exact_on_policy(first)
    _assert_reference_kl(first)
    assert _rl(first)[-1]["loss/kl"] > 0

    def numbers(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_metrics(run)]
    assert numbers(first) == numbers(second)


def _launcher() -> list[str]:
    """jetflow's torchrun (jetflow.launch.torchrun: one line where a rank fails), 2 ranks."""
    return [sys.executable, "-m", "jetflow.launch.torchrun", *torchrun(2)[3:]]


def _start_and_wait(args: list[str], env: dict, metrics: Path, rows: int) -> subprocess.Popen:
    """The 2-rank run, once metrics.jsonl has `rows` rows."""
    proc = subprocess.Popen([*_launcher(), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled in its warm-up"
        time.sleep(0.05)
    return proc


def _warmup_args(out: Path) -> tuple[dict, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return env, ["-m", "jetflow.cli", "train", "--no-report", *COMMON, "precision.mode=fp32", "train.backend=fsdp",
                 "train.steps=1", "train.sft_warmup_steps=60", "run.resume=true", f"run.out_dir={out}"]


def test_fsdp_rank_killed_in_the_warmup_ends_in_one_line_and_resumes_at_one_rank(tmp_path):
    """A rank SIGKILLed in the supervised warm-up: the run ends with one line per side (the surviving rank's
    fault, the launcher's naming the killed rank), no traceback; its last warm-up checkpoint holds both
    ranks' optimizer shards (the RL trainer's has not stepped), and a single process resumes it to
    completion."""
    env, args = _warmup_args(tmp_path)
    run, metrics = tmp_path / "r", tmp_path / "r" / "metrics.jsonl"
    proc = _start_and_wait(args, env, metrics, 3)
    ranks = subprocess.run(["ps", "--ppid", str(proc.pid), "-o", "pid="], capture_output=True, text=True).stdout.split()
    os.kill(int(ranks[-1]), signal.SIGKILL)  # a rank this test started, by its pid
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_FAULT and "Traceback" not in log, log[-3000:]
    assert f"was killed by SIGKILL; the other ranks stopped; {RESUME}" in log, log[-3000:]
    killed_at = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert killed_at.name.startswith("warmup_") and not (run / COMPLETE).exists()
    assert (killed_at / "optimizer" / "__1_0.distcp").is_file()
    resumed = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run, "sft")] == list(range(60))
    assert (run / COMPLETE).exists()


@pytest.mark.long  # a third 2-rank launch; SIGTERM under torchrun is test_run_faults' (native DP), the
# warm-up shards' resume the test above
def test_fsdp_stopped_in_the_warmup_at_two_ranks_writes_the_warmup_shards(tmp_path):
    """SIGTERM in the supervised warm-up at 2 ranks: exit 128 + SIGTERM without a traceback, STOPPED says
    warm-up, the checkpoint holds rank 1's warm-up optimizer shard."""
    env, args = _warmup_args(tmp_path)
    run = tmp_path / "r"
    proc = _start_and_wait(args, env, run / "metrics.jsonl", 3)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in log, log[-3000:]
    stopped = json.loads((run / "STOPPED").read_text())
    assert stopped["phase"] == "warm-up", log[-3000:]
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert ckpt.name.startswith("warmup_") and (ckpt / "optimizer" / "__1_0.distcp").is_file()


def test_fsdp_fp8_all_gather_moves_the_whole_weights_bytes_and_gives_the_replicated_gradients(tmp_path):
    """fsdp_fp8_gather_worker.py at 2 ranks: weights split on and off the 128-row block boundaries; the same
    weights sharded from rank 0 alone."""
    out = tmp_path / "result.json"
    wait_all({"fp8-gather": launch_worker(2, Path(__file__).parent / "fsdp_fp8_gather_worker.py", "--out", out)})
    result = json.loads(out.read_text())
    assert result["wrapped"] == {"fp8": 14, "bf16": 1} and result["world"] == 2  # the tied embedding
    assert result["bytes_equal"] and all(result["bytes_equal"].values()), result["bytes_equal"]
    assert all(result["bytes_equal_after_step"].values()), result["bytes_equal_after_step"]
    assert all(result["grads_equal"].values()), result["grads_equal"]
    assert result["gathered_bytes"] == result["expected_fp8_bytes"] < 0.3 * result["fp32_bytes"]
    # sharded from rank 0 alone (rank 1 a meta shell): every rank's shards equal, the tied lm_head still tied
    assert result["from_rank0_equal"] and all(result["from_rank0_equal"].values()), result["from_rank0_equal"]
    assert result["from_rank0_tied"] and result["rng_shared"]
