"""FSDP two ranks against one process, SmolLM2: each run's mismatch, loss and reward per step.

    python scripts/analysis/fsdp_smollm2_2rank_compare.py      # from the folder holding the run directories
"""
from jetflow.ablate.archive import metrics_rows


def rows(run: str) -> list[dict]:
    return metrics_rows(run)


for run in ("fsdp-fp32", "fsdp-bf16", "fsdp-unified", "native-fp32"):
    r = rows(run)
    if not r:
        continue
    print(run, [(x["mismatch/kl_k3"], x["mismatch/equal_frac"], round(x["train/loss"], 9), x["reward/mean"]) for x in r])
a, b = rows("fsdp-fp32"), rows("native-fp32")
print("fp32 fsdp vs native loss gap", [abs(x["train/loss"] - y["train/loss"]) for x, y in zip(a, b)],
      "grad_norm gap", [abs(x["train/grad_norm"] - y["train/grad_norm"]) for x, y in zip(a, b)],
      "rewards equal", [x["reward/mean"] == y["reward/mean"] for x, y in zip(a, b)])
