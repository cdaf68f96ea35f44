#!/usr/bin/env bash
# Everything jetflow checks on a CUDA GPU (an H100), in one command, in under 10 minutes (the steps'
# time limits add up to 580 s):
#
#   bash scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]
#
# It runs from the source tree against the machine's preinstalled torch and triton (nothing is
# installed from a registry; the GPU machines reach no network) and writes into OUT_DIR:
#   env.txt              GPU, driver, torch / CUDA / triton versions, block-scaled scaled_mm probe
#   tests-gpu.log, .xml  pytest tests/gpu (Triton kernels on the hardware, scaled_mm, rollout
#                        log-probs == trainer log-probs for a random-init model; the paged Triton attention
#                        with the CPU's arithmetic == the C++ kernel's bits on fp32 / bf16 / E4M3 pages:
#                        test_paged_exact_attention_equals_the_cpu_kernel)
#   bench/gemm-gpu.*     jetflow bench gemm: 8192^3 and Llama-3-8B's linear shapes at M = 16 and
#                        8192; cuBLAS bf16, torch._scaled_mm block FP8, Triton FP8 (+ act quant),
#                        Triton bf16, in TFLOP/s
#   train/*.jsonl, train.md
#                        jetflow train on cuda: a random-init ~240M-parameter model built there
#                        (16 layers of 1024), unified vs bf16, fast numerics (cuBLAS / scaled_mm) and
#                        exact numerics (the Triton kernels); step time split rollout / old log-probs /
#                        train / sync
#   summary.md           each step's status and duration
#
# WHEEL_DIR (default .cache/gpu-wheels): pure-Python wheels the GPU image lacks, unpacked into a
# scratch directory on PYTHONPATH (never installed into the image's Python). Make them on a machine
# with a network:
#   pip download --no-deps -d .cache/gpu-wheels omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
# A failed step is recorded and the script goes on; it exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
WHEELS=${2:-.cache/gpu-wheels}
PYTHON=${PYTHON:-python3}
SCRATCH=$(mktemp -d /tmp/jetflow-gpu-check.XXXXXX)
mkdir -p "$OUT/bench" "$OUT/train"

if [ -d "$WHEELS" ]; then
  for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] && "$PYTHON" -m zipfile -e "$whl" "$SCRATCH/pydeps"
  done
fi
export PYTHONPATH="$PWD:$SCRATCH/pydeps${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=0  # the kernels also pass enable_fp_fusion=False themselves
export TRITON_CACHE_DIR="$SCRATCH/triton-cache" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  > "$OUT/summary.md"
echo "| step | status | seconds |" >> "$OUT/summary.md"
echo "|---|---|---|" >> "$OUT/summary.md"
FAILED=0

# step NAME TIMEOUT_S COMMAND...: run it with a time limit, log to OUT/NAME.log, record the outcome
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (at most ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local status=ok
  if [ $rc -ne 0 ]; then
    status="failed (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
    FAILED=1
  fi
  echo "| $name | $status | $(( $(date +%s) - t0 )) |" >> "$OUT/summary.md"
  tail -n 3 "$OUT/$name.log" >&2
}

step env 30 "$PYTHON" - <<'EOF'
import subprocess
import torch
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "capability", torch.cuda.get_device_capability(0))
import triton
print("triton", triton.__version__)
from jetflow.precision.gemm import resolve_backend
print("fp8 backend auto ->", resolve_backend("auto", torch.device("cuda")))
for mod in ("omegaconf", "yaml", "safetensors", "tqdm", "tensorboard"):
    try:
        __import__(mod)
        print(mod, "ok")
    except ImportError as e:
        print(mod, "missing:", e)
EOF
cp "$OUT/env.log" "$OUT/env.txt"

step tests-gpu 210 "$PYTHON" -m pytest -q -rA -p no:cacheprovider tests/gpu -m gpu -s \
  --junitxml="$OUT/tests-gpu.xml" --durations=20

step bench-gemm 110 "$PYTHON" -m jetflow.cli bench gemm --out-dir "$OUT/bench"

# A random-init model of ~240M parameters (16 layers, hidden 1024, 16 heads / 4 KV heads, MLP 4096) on the
# arithmetic task: 5 supervised warm-up steps, then 4 RL steps of 8 prompts x 8 samples.
TRAIN=(configs/tiny.yaml model.device=cuda model.tiny.hidden_size=1024 model.tiny.num_layers=16
       model.tiny.num_heads=16 model.tiny.num_kv_heads=4 model.tiny.intermediate_size=4096
       model.tiny.max_position=128 train.steps=4 train.sft_warmup_steps=5 train.prompts_per_step=8
       rollout.group_size=8 eval.num_prompts=0 run.tensorboard=false run.progress=false
       "run.out_dir=$SCRATCH/runs")
for mode in unified bf16; do
  step "train-$mode-fast" 50 "$PYTHON" -m jetflow.cli train --config "${TRAIN[@]}" "precision.mode=$mode" \
    precision.numerics=fast "run.name=$mode-fast"
done
# exact numerics on CUDA: loaded for the CPU (config validation still refuses exact off the CPU), then moved
for mode in unified bf16; do
  step "train-$mode-exact" 65 "$PYTHON" - "$mode" "$SCRATCH/runs" "${TRAIN[@]:1}" <<'EOF'
import sys
from jetflow.config import load_config
from jetflow.run.runner import train
mode, runs, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
overrides = [o for o in overrides if not o.startswith("model.device=")]
cfg = load_config("configs/tiny.yaml", overrides + [f"precision.mode={mode}", "precision.numerics=exact",
                                                    f"run.name={mode}-exact", f"run.out_dir={runs}"])
cfg.model.device = "cuda"
print("run complete:", train(cfg))
EOF
done

"$PYTHON" - "$SCRATCH/runs" "$OUT" <<'EOF' || FAILED=1
import json, shutil, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
keys = ["time/step", "time/rollout", "time/old_logprobs", "time/train", "time/sync"]
lines = ["# jetflow train on cuda: step time split (RL steps after the first, mean seconds)", "",
         "| run | RL steps | " + " | ".join(keys) + " | tokens/s |", "|---" * (len(keys) + 3) + "|"]
for run in sorted(runs.glob("*")) if runs.exists() else []:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        continue
    shutil.copy(metrics, out / "train" / f"{run.name}.jsonl")
    rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    use = rl[1:] or rl
    mean = lambda k: sum(r.get(k) or 0.0 for r in use) / max(len(use), 1)
    lines.append(f"| {run.name} | {len(rl)} | " + " | ".join(f"{mean(k):.3f}" for k in keys)
                 + f" | {mean('throughput/tokens_per_s'):.0f} |")
(out / "train.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

rm -rf "$SCRATCH"
cat "$OUT/summary.md"
exit $FAILED
