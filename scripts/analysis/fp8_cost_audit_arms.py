"""The gradient-level decomposition: `jetflow audit` of one model under each arm's recipe, the row of all
the quantizable linears in FP8 at once. Reads <dir>/<model>-<arm>/audit.json (written by the commands in
README.md) and prints a markdown table a model.

    python scripts/analysis/fp8_cost_audit_arms.py /work/fp8-cost/audit
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ARMS = ["unified", "bf16-wgrad", "fwd-only", "hybrid", "block32"]


def main(root: str) -> None:
    models = sorted({p.name.rsplit("-", 1)[0] for p in Path(root).iterdir() if p.is_dir()}
                    | {p.name[: -len(f"-{arm}")] for arm in ARMS for p in Path(root).glob(f"*-{arm}") if p.is_dir()})
    for model in models:
        rows = []
        for arm in ARMS:
            path = Path(root) / f"{model}-{arm}" / "audit.json"
            if not path.exists():
                continue
            d = json.loads(path.read_text())
            a = next(e for e in d["effects"] if e["group"] == "all")
            rows.append(f"| {arm} | {a['kl']:.3g} | {a['max_abs_dlogp']:.3g} | {a['flip_frac']:.3f} | "
                        f"{a['wgrad_rel_err']:.3g} | {a['wgrad_cos']:.5f} | {a['dgrad_rel_err']:.3g} | "
                        f"{a['dgrad_cos']:.5f} | {d['seconds']:.0f} s |")
        if rows:
            print(f"\n{model} ({d['sequences']} sequences, {d['response_tokens']} response tokens)\n")
            print("| arm | KL(bf16 \\|\\| FP8) | max \\|dlogp\\| | greedy flips | wgrad rel. err | wgrad cos | "
                  "dgrad rel. err | dgrad cos | audit time |")
            print("|---|---|---|---|---|---|---|---|---|")
            print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1])
