"""The figures of README's len256 section that the generated tables do not give: mixed-none's mismatch KL by
quarter of the response over the first 20 RL steps (per length), and seed 1's RL draws (grid cell and replicates):
start, last-5 mean, last and lowest held-out pass@1, mismatch KL, unified's smallest equal share, and the paired
differences over the draws (mean ± SE), also on one bf16 engine.

    python results/learning-length/len256_numbers.py
"""
import json
import statistics
from pathlib import Path

from jetflow.metrics_log import read_jsonl

OUT = Path("results/learning-length")


def rows(cell: Path, phase: str) -> list[dict]:
    return [r for r in read_jsonl(cell / "metrics.jsonl") if r.get("phase") == phase]


def mean(rs, key):
    return statistics.fmean(r[key] for r in rs)


print("| length | cell | KL per token | by quarter | KL per response | entropy |")
for length, seeds in [("len16", range(8)), ("len64", range(8)), ("len256", [1]), ("len256", [0])]:
    first = [rows(OUT / "runs" / f"seed{s}-{length}-mixed-none", "rl")[:20] for s in seeds]
    kl = statistics.fmean(mean(rl, "mismatch/kl_k3") for rl in first)
    per_response = statistics.fmean(mean(rl, "mismatch/kl_k3") * mean(rl, "response/length_mean") for rl in first)
    quarters = [statistics.fmean(mean(rl, f"mismatch/kl_k3/pos_{i}of4") for rl in first) for i in range(4)]
    print(f"| {length} | seeds {list(seeds)} | {kl:.1e} | {' / '.join(f'{q:.1e}' for q in quarters)} | "
          f"{per_response:.3f} | {statistics.fmean(mean(rl, 'policy/entropy') for rl in first):.3f} |")

draws = {1: OUT / "runs", 11: OUT / "replicate-len256/runs", 12: OUT / "replicate-len256/runs"}
engine = {**json.loads((OUT / "len256_bf16_engine_eval_seed1.json").read_text()),
          **json.loads((OUT / "replicate-len256/bf16_engine_eval.json").read_text())}
late, one_engine = {}, {}
for draw, runs in draws.items():
    for arm in ("bf16", "mixed-none", "unified"):
        name = f"seed1-len256-{arm}" if draw == 1 else f"seed1r{draw}-len256-{arm}"
        ev = [r["eval/pass@1"] for r in rows(runs / name, "eval")]
        rl = rows(runs / name, "rl")
        late[(draw, arm)], one_engine[(draw, arm)] = statistics.fmean(ev[-5:]), engine[name]["in_mode"]
        print(f"draw {draw} {arm}: start {ev[0]:.2f}, last 5 {late[(draw, arm)]:.3f} ({ev[-1]:.2f}), lowest "
              f"{min(ev):.2f}; KL first 20 {mean(rl[:20], 'mismatch/kl_k3'):.1e} -> steps 200-299 "
              f"{mean(rl[200:], 'mismatch/kl_k3'):.1e}; smallest equal share {min(r['mismatch/equal_frac'] for r in rl):.3f}"
              f"; one bf16 engine {one_engine[(draw, arm)]:.3f}")
for a, b in [("mixed-none", "bf16"), ("unified", "bf16"), ("mixed-none", "unified")]:
    for label, table in (("own engines", late), ("one bf16 engine", one_engine)):
        d = [table[(k, a)] - table[(k, b)] for k in draws]
        print(f"{a} - {b}, {label}: {statistics.fmean(d):+.3f} ± {statistics.stdev(d) / len(d) ** 0.5:.3f} "
              f"({sum(x < 0 for x in d)} of {len(d)} below)")
