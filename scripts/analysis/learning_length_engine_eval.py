"""Every arm's final weights scored by one bf16 decoding engine on more held-out problems
(scripts/reeval_heldout.py --all-arms --problems 200): per seed, and each arm minus bf16, paired by seed.

    python scripts/analysis/learning_length_engine_eval.py results/learning-length/len64_bf16_engine_eval.json len64

`load` reads such a file for one setting of the grid, `pool` joins two kinds' files, `difference` prints a paired
difference; two_kinds.py and by_length.py import them.
"""
import json
import re
import sys

from jetflow.ablate.length_study import paired

ARMS = ["bf16", "mixed-none", "mixed-token_tis", "mixed-ais", "unified"]


def load(path: str, setting: str, kind: str | None = None) -> dict[str, dict]:
    """arm -> {seed: pass@1 on the one engine} for the cells `seed<N>-<setting>-<arm>`; with `kind` the seeds
    are keyed (kind, N), so that files from the two machine kinds can be pooled."""
    scores: dict[str, dict] = {arm: {} for arm in ARMS}
    for cell, row in json.load(open(path)).items():
        m = re.fullmatch(rf"seed(\d+)-{re.escape(setting)}-(.+)", cell)
        if m and m.group(2) in scores:
            seed = int(m.group(1))
            scores[m.group(2)][seed if kind is None else (kind, seed)] = row["in_mode"]
    return scores


def pool(*by_kind: dict[str, dict]) -> dict[str, dict]:
    """Files of several machine kinds (each `load`ed with its `kind`) as one: arm -> {(kind, seed): pass@1}."""
    return {arm: {key: v for scores in by_kind for key, v in scores[arm].items()} for arm in ARMS}


def difference(d: dict) -> str:
    """A paired difference (jetflow.ablate.length_study.paired) as "mean ± SE (above / below / equal)":
    no ± below 2 seeds, empty without a seed."""
    if not d["n"]:
        return ""
    se = f" ± {d['se']:.3f}" if d["se"] is not None else ""
    return f"{d['mean']:+.3f}{se} ({d['above']} / {d['below']} / {d['equal']})"


def main(path: str, setting: str) -> None:
    scores = load(path, setting)
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
        if not d["n"]:  # an arm not run at these seeds (yet)
            continue
        se = f" ± {d['se']:.3f}" if d["se"] is not None else ""
        print(f"| {a} - {b} | {d['n']} | {d['mean']:+.3f}{se} | {d['above']} / {d['below']} / {d['equal']} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
