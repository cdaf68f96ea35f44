"""Weight sync payload of each recipe family (issue 28): `jetflow bench sync`'s measurement (jetflow.bench.
weight_sync.measure_mode: one trainer -> rollout sync as RLLoop.sync does it, bytes = WeightUpdate.nbytes())
for bf16 and for unified under fp8_block, mxfp8 and nvfp4, written to results/recipes/sync.{json,md}.

    python scripts/recipe_sync.py [--model smollm2] [--reps 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

from jetflow.bench.common import markdown_table
from jetflow.bench.weight_sync import measure_mode
from jetflow.bench.workload import bench_config
from jetflow.run.build import build_policy


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out-dir", default="results/recipes")
    args = parser.parse_args()
    cfg = bench_config(args.model)
    base, _ = build_policy(cfg)
    rows = []
    for mode, family in (("bf16", "fp8_block"), ("unified", "fp8_block"), ("unified", "mxfp8"), ("unified", "nvfp4")):
        c = copy.deepcopy(cfg)
        c.precision.mode, c.precision.family = mode, family
        row = measure_mode(c, base, args.reps)
        row["family"] = family if mode == "unified" else "-"
        rows.append(row)
        print(f"  {mode:8s} {row['family']:10s} {row['total_bytes'] / 2**20:8.1f} MiB", flush=True)
    bf16 = rows[0]["total_bytes"]
    for row in rows:
        row["vs_bf16"] = row["total_bytes"] / bf16
        row["total_mib"] = row["total_bytes"] / 2**20
        row["quantized_mib"] = (row["fp8_data_bytes"] + row["scale_bytes"]) / 2**20
    table = markdown_table(rows, ["mode", "family", "total_mib", "vs_bf16", "quantized_mib", "fp8_data_bytes",
                                  "scale_bytes", "other_bytes"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    machine = f"{platform.processor() or platform.machine()}, {platform.node()}, 2-core CPU developer machine, no GPU"
    (out / "sync.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1,
                                              default=str))
    (out / "sync.md").write_text(
        f"# Weight sync payload per recipe family ({args.model})\n\n`{command}` on {machine}, "
        f"{time.strftime('%Y-%m-%d')}. One trainer -> rollout sync (jetflow.bench.weight_sync.measure_mode); "
        "`quantized` = the linears' codes + scales, `other` = what stays bf16 (embedding, norms).\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
