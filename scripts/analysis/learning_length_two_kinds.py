"""One setting of the grid on both machine kinds: each arm minus bf16 (and mixed-none minus unified), paired by
seed, for the Intel Xeon kind, the AMD EPYC Zen 5 kind and the two pooled, every arm's final weights scored by one
bf16 engine (scripts/reeval_heldout.py --all-arms --problems 200). The kind is one more source of randomness: the
same seed number on two kinds is another draw (another warm-up, other RL samples), so pooled seeds are keyed by
(kind, seed). The last column keeps one draw per seed number (the AMD kind's where both kinds ran it): the
issue's "N seeds" counted without a second draw of one seed.

    python scripts/analysis/learning_length_two_kinds.py len64 results/learning-length/len64_bf16_engine_eval.json \
        results/learning-length/intel-len64/bf16_engine_eval.json
"""
import sys

from learning_length_engine_eval import ARMS, difference, load, pool  # beside this script (its folder is on sys.path)

from jetflow.ablate.length_study import paired

PAIRS = [("mixed-none", "bf16"), ("unified", "bf16"), ("mixed-none", "unified"),
         ("mixed-token_tis", "bf16"), ("mixed-ais", "bf16"),
         ("mixed-token_tis", "unified"), ("mixed-ais", "unified"),
         ("mixed-token_tis", "mixed-none"), ("mixed-ais", "mixed-none")]


def cell(scores: dict[str, dict], a: str, b: str) -> str:
    return difference(paired(scores[a], scores[b]))


setting, amd_file, intel_file = sys.argv[1:4]
amd, intel = load(amd_file, setting, "amd"), load(intel_file, setting, "intel")
pooled = pool(amd, intel)
amd_seeds = {seed for _, seed in amd["bf16"]}
one_draw = {arm: {**amd[arm], **{k: v for k, v in intel[arm].items() if k[1] not in amd_seeds}} for arm in ARMS}
print("| a - b | Intel Xeon | AMD Zen 5 | both kinds | one draw per seed number |")
print("|---|---|---|---|---|")
for a, b in PAIRS:
    print(f"| {a} - {b} | {cell(intel, a, b)} | {cell(amd, a, b)} | {cell(pooled, a, b)} | {cell(one_draw, a, b)} |")
print("\nEach cell: mean ± SE over the seeds both arms completed (a > b / a < b / equal; their sum is the number of "
      "seeds, which differs between pairs where an arm has not run at every seed).")
