"""Every arm's final weights scored by one bf16 decoding engine on more held-out problems
(scripts/reeval_heldout.py --all-arms --problems 200): per seed, and each arm minus bf16, paired by seed.

    python results/learning-length/engine_eval.py results/learning-length/len64_bf16_engine_eval.json len64
"""
import json
import re
import sys

from jetflow.ablate.length_study import paired

ARMS = ["bf16", "mixed-none", "mixed-token_tis", "mixed-ais", "unified"]
rows = json.load(open(sys.argv[1]))
setting = sys.argv[2]
scores: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}
for cell, row in rows.items():
    m = re.fullmatch(rf"seed(\d+)-{re.escape(setting)}-(.+)", cell)
    if m and m.group(2) in scores:
        scores[m.group(2)][int(m.group(1))] = row["in_mode"]
seeds = sorted(set().union(*scores.values()))
print("| seed | " + " | ".join(ARMS) + " |")
print("|---" * (len(ARMS) + 1) + "|")
for s in seeds:
    print(f"| {s} | " + " | ".join(f"{scores[a][s]:.3f}" if s in scores[a] else "" for a in ARMS) + " |")
print()
print("| a - bf16 | seeds | difference ± SE | a > b / a < b / equal |")
print("|---|---|---|---|")
for a in ARMS[1:] + [("mixed-none", "unified")]:
    a, b = a if isinstance(a, tuple) else (a, "bf16")
    d = paired(scores[a], scores[b])
    se = f" ± {d['se']:.3f}" if d["se"] is not None else ""
    print(f"| {a} - {b} | {d['n']} | {d['mean']:+.3f}{se} | {d['above']} / {d['below']} / {d['equal']} |")
