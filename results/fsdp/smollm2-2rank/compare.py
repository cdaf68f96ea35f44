import json, sys
def rows(run): return [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
for run in ("fsdp-fp32", "fsdp-bf16", "fsdp-unified", "native-fp32"):
    try: r = rows(run)
    except FileNotFoundError: continue
    print(run, [(x["mismatch/kl_k3"], x["mismatch/equal_frac"], round(x["train/loss"], 9), x["reward/mean"]) for x in r])
a, b = rows("fsdp-fp32"), rows("native-fp32")
print("fp32 fsdp vs native loss gap", [abs(x["train/loss"] - y["train/loss"]) for x, y in zip(a, b)],
      "grad_norm gap", [abs(x["train/grad_norm"] - y["train/grad_norm"]) for x, y in zip(a, b)],
      "rewards equal", [x["reward/mean"] == y["reward/mean"] for x, y in zip(a, b)])
