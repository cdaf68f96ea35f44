"""Issue 42's two figures over both machine kinds: each arm's final held-out pass@1 against response length, and
the paired differences (each FP8 arm minus bf16, mixed-none minus unified) against length, every arm's final
weights scored by one bf16 engine on 200 problems (scripts/reeval_heldout.py --all-arms --problems 200). The three
lengths are the grid's rows with every arm at 8 or more seeds: len16 from the 1000-step warm-up (the strong-start
control), len64, and len256 at RL lr 3e-5. Seeds are keyed (kind, seed) and pooled, as in two_kinds.py.

    python scripts/analysis/learning_length_by_length.py      # prints the table, writes by_length.png
"""
import statistics
from pathlib import Path

from learning_length_engine_eval import ARMS, difference, load, pool  # beside this script (its folder is on sys.path)

from jetflow.ablate.length_study import paired

HERE = Path(__file__).resolve().parents[2] / "results" / "learning-length"
# (mean answer tokens, label, grid setting, AMD EPYC Zen 5 file, Intel Xeon file)
ROWS = [
    (16, "len16, 1000-step warm-up", "len16-wu1000", "strong-start/bf16_engine_eval.json",
     "intel-strong-start/bf16_engine_eval.json"),
    (65, "len64", "len64", "len64_bf16_engine_eval.json", "intel-len64/bf16_engine_eval.json"),
    (257, "len256, RL lr 3e-5", "len256-lr3e-5", "len256_lr3e-5_bf16_engine_eval.json",
     "intel-len256/bf16_engine_eval.json"),
]
PAIRS = [("mixed-none", "bf16"), ("unified", "bf16"), ("mixed-token_tis", "bf16"), ("mixed-ais", "bf16"),
         ("mixed-none", "unified")]


def pooled(setting: str, amd_file: str, intel_file: str) -> dict[str, dict]:
    return pool(load(str(HERE / amd_file), setting, "amd"), load(str(HERE / intel_file), setting, "intel"))


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def common_seeds(by_arm: dict[str, dict]) -> set:
    """The seeds every arm completed: the accuracy panel compares arms on one set of starts (at len256 the arms
    ran at different seeds; the paired panel uses each pair's own common seeds)."""
    return set.intersection(*(set(seeds) for seeds in by_arm.values()))


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    lengths = [tokens for tokens, *_ in ROWS]
    scores = [pooled(*row[2:]) for row in ROWS]
    print("| length | " + " | ".join(f"{a} - {b}" for a, b in PAIRS) + " |")
    print("|---" * (len(PAIRS) + 1) + "|")
    for (tokens, label, *_), by_arm in zip(ROWS, scores):
        cells = [difference(paired(by_arm[a], by_arm[b])) for a, b in PAIRS]
        print(f"| {label} ({tokens} tokens) | " + " | ".join(cells) + " |")
    common = [common_seeds(by_arm) for by_arm in scores]
    print("\n| length | seeds with every arm | " + " | ".join(ARMS) + " |")
    print("|---" * (len(ARMS) + 2) + "|")
    for (tokens, label, *_), by_arm, seeds in zip(ROWS, scores, common):
        cells = [f"{m:.3f} ± {se:.3f}" for m, se in (mean_se([by_arm[arm][k] for k in seeds]) for arm in ARMS)]
        print(f"| {label} ({tokens} tokens) | {len(seeds)} | " + " | ".join(cells) + " |")
    for i, arm in enumerate(ARMS):
        stats = [mean_se([by_arm[arm][k] for k in seeds]) for by_arm, seeds in zip(scores, common)]
        x = [t * (1 + 0.03 * (i - 2)) for t in lengths]  # arms side by side on the log axis
        acc_ax.errorbar(x, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3, label=arm)
    for i, (a, b) in enumerate(PAIRS):
        diffs = [paired(by_arm[a], by_arm[b]) for by_arm in scores]
        x = [t * (1 + 0.03 * (i - 2)) for t in lengths]
        style = {"color": "black", "ls": "--"} if b != "bf16" else {}  # the pair that is not "FP8 minus bf16"
        gap_ax.errorbar(x, [d["mean"] for d in diffs], yerr=[d["se"] for d in diffs], marker="o", capsize=3,
                        label=f"{a} - {b}", **style)
    gap_ax.axhline(0, color="grey", lw=0.8)
    n_common = "/".join(str(len(seeds)) for seeds in common)
    for ax, title in ((acc_ax, f"final pass@1 (one bf16 engine) ± SE, seeds with every arm: {n_common}"),
                      (gap_ax, "paired difference (one bf16 engine) ± SE")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.set_xlabel("answer length (tokens)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("AMD EPYC Zen 5 + Intel Xeon seeds pooled. len16 / len64: RL lr 1e-4, 16 seeds; "
                 "len256: RL lr 3e-5, 8-9 draws a pair",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "by_length.png", dpi=120)


if __name__ == "__main__":
    main()
