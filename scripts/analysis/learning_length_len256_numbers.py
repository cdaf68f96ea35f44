"""The figures of README's len256 section that the generated tables do not give: mixed-none's mismatch KL by
quarter of the response over the first 20 RL steps (per length), and seed 1's RL draws (grid cell and replicates):
start, last-5 mean, last and lowest held-out pass@1, mismatch KL, unified's smallest equal share, and the paired
differences over the draws (mean ± SE), also on one bf16 engine; then the NVFP4 arms at seed 1 and seed 0's RL
from its warm-up continued to 4500 steps; the len256 warm-ups' loss by seed; the lr 3e-5 row's cells (seeds 0
to 4, seed 1's draws, token TIS and AIS among them) and their pairs over draws and over starts (all of them, and
the strong ones: a start is strong when its bf16 arm's held-out pass@1 at RL step 0 is at least 0.5).

    python scripts/analysis/learning_length_len256_numbers.py
"""
import json
import statistics
from pathlib import Path

from jetflow.ablate.length_study import paired
from jetflow.ablate.archive import exists, metrics_rows

OUT = Path("results/learning-length")


def rows(cell: Path, phase: str) -> list[dict]:
    return metrics_rows(cell, phase)


def mean(rs, key):
    return statistics.fmean(r[key] for r in rs)


PAIRS = [("mixed-none", "bf16"), ("unified", "bf16"), ("mixed-none", "unified"), ("mixed-ais", "bf16"),
         ("mixed-ais", "unified")]
LR_PAIRS = PAIRS + [("mixed-token_tis", "bf16"), ("mixed-token_tis", "unified")]  # token TIS: at lr 3e-5 only


def describe(label: str, cell: Path, engine_score: float) -> float:
    """Print a finished RL cell's held-out and mismatch figures; return its mean of the last 5 evaluations."""
    ev, rl = [r["eval/pass@1"] for r in rows(cell, "eval")], rows(cell, "rl")
    late = statistics.fmean(ev[-5:])
    print(f"{label}: start {ev[0]:.2f}, last 5 {late:.3f} ({ev[-1]:.2f}), lowest {min(ev):.2f}; sampled accuracy "
          f"{mean(rl[:20], 'reward/accuracy'):.3f} -> {mean(rl[-20:], 'reward/accuracy'):.3f}; KL per token "
          f"{mean(rl[:20], 'mismatch/kl_k3'):.1e} -> steps 200-299 {mean(rl[200:], 'mismatch/kl_k3'):.1e}; entropy "
          f"{mean(rl[:20], 'policy/entropy'):.3f} -> {mean(rl[-20:], 'policy/entropy'):.3f}; smallest equal share "
          f"{min(r['mismatch/equal_frac'] for r in rl):.3f}; one bf16 engine {engine_score:.3f}")
    return late


def arm_pair(table: dict, keys: list, a: str, b: str) -> dict:
    """jetflow's paired a - b (n, mean, SE, how many below) over the keys where `table` has both arms."""
    return paired({k: table[(*k, a)] for k in keys if (*k, a) in table},
                  {k: table[(*k, b)] for k in keys if (*k, b) in table})


def paired_text(p: dict) -> str:
    return f"{p['mean']:+.3f} ± {p['se']:.3f} ({p['below']} of {p['n']} below)"


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
late: dict[tuple, float] = {}
one_engine: dict[tuple, float] = {}
for draw, runs in draws.items():
    for arm in ("bf16", "mixed-none", "unified", "mixed-ais"):
        name = f"seed1-len256-{arm}" if draw == 1 else f"seed1r{draw}-len256-{arm}"
        one_engine[(draw, arm)] = engine[name]["in_mode"]
        late[(draw, arm)] = describe(f"draw {draw} {arm}", runs / name, one_engine[(draw, arm)])
for a, b in PAIRS:
    for label, table in (("own engines", late), ("one bf16 engine", one_engine)):
        print(f"{a} - {b}, {label}: {paired_text(arm_pair(table, [(k,) for k in draws], a, b))}")

print("NVFP4 arms from seed 1's warm-up (the first 20 RL steps, then all of them):")
nvfp4_engine = json.loads((OUT / "nvfp4_bf16_engine_eval.json").read_text())
for name, cell in (("mixed-none-nvfp4-len256-seed1", OUT / "runs/mixed-none-nvfp4-len256-seed1"),
                   ("unified-nvfp4-len256-seed1", OUT / "partial/unified-nvfp4-len256-seed1-stopped147")):  # stopped
    ev, rl = rows(cell, "eval"), rows(cell, "rl")
    print(f"{name}: {len(rl)} RL steps; held-out {[r['eval/pass@1'] for r in ev]}; KL per token "
          f"{mean(rl[:20], 'mismatch/kl_k3'):.2e} -> {mean(rl, 'mismatch/kl_k3'):.2e}; steps with a right sample "
          f"{sum(r['reward/accuracy'] > 0 for r in rl)}; response length {mean(rl[:20], 'response/length_mean'):.1f}; "
          f"median s a step {statistics.median(r['time/step'] for r in rl):.1f}; one bf16 engine "
          f"{nvfp4_engine[name]['in_mode'] if name in nvfp4_engine else 'n/a'}")

print("seed 0 from its warm-up continued to 4500 steps:")
for arm in ("bf16", "mixed-none", "unified"):
    cell = OUT / "extended-warmup/runs" / f"seed0x4500-len256-{arm}"
    ev, rl = rows(cell, "eval"), rows(cell, "rl")
    right = [r["step"] for r in rl if r["reward/accuracy"] > 0]
    print(f"{arm}: held-out {[(r['step'], r['eval/pass@1']) for r in ev]}; sampled accuracy over steps 0-19 "
          f"{mean(rl[:20], 'reward/accuracy'):.3f}; last step with a right sample {max(right) if right else None}; "
          f"KL per token {mean(rl[:20], 'mismatch/kl_k3'):.1e}; entropy {mean(rl[:20], 'policy/entropy'):.3f} -> "
          f"{mean(rl[-20:], 'policy/entropy'):.3f}")

print("seed 0 from the 4500-step warm-up, RL at lr 3e-5 (and bf16 at temperature 0.7, stopped at step 193):")
lr_engine = json.loads((OUT / "extended-warmup/bf16_engine_eval_lr3e-5.json").read_text())
for where, name in (("runs", "seed0x4500-len256-bf16-lr3e-5"), ("runs", "seed0x4500-len256-mixed-none-lr3e-5"),
                    ("runs", "seed0x4500-len256-unified-lr3e-5"), ("stopped", "seed0x4500-len256-bf16-T0.7")):
    cell = OUT / "extended-warmup" / where / name
    scores, rl = [r["eval/pass@1"] for r in rows(cell, "eval")], rows(cell, "rl")
    print(f"{name}: {len(rl)} RL steps; start {scores[0]:.2f}, last 5 {statistics.fmean(scores[-5:]):.3f} "
          f"({scores[-1]:.2f}), lowest {min(scores):.2f}; sampled accuracy {mean(rl[:20], 'reward/accuracy'):.3f} -> "
          f"{mean(rl[-20:], 'reward/accuracy'):.3f}"
          f"; KL per token {mean(rl[:20], 'mismatch/kl_k3'):.1e} -> {mean(rl[-100:], 'mismatch/kl_k3'):.1e}; smallest "
          f"equal share {min(r['mismatch/equal_frac'] for r in rl):.3f}; one bf16 engine "
          f"{lr_engine[name]['in_mode'] if name in lr_engine else 'n/a'}")

print("len256's 3000-step warm-ups: SFT loss per token, mean of steps b..b+49, by seed")
WARMUPS = {s: f"warmups/seed{s}-len256-bf16" for s in range(5)}
for seed, where in WARMUPS.items():
    warm = [r["loss/sft"] for r in metrics_rows(OUT / where) if r.get("loss/sft") is not None]
    print(f"seed {seed} ({len(warm)} steps): " + " ".join(f"{b}: {statistics.fmean(warm[b:b + 50]):.3f}"
                                      for b in (500, 1000, 1250, 1500, 2000, 2500, 2950) if b + 50 <= len(warm)))

print("len256 at RL lr 3e-5 from the 3000-step warm-ups (the grid's len256-lr3e-5 row; seed 1's RL draws 11-17 "
      "from configs/ablations/learning-length-draws.yaml):")
lr_row_engine = {**json.loads((OUT / "len256_lr3e-5_bf16_engine_eval.json").read_text()),
                 **json.loads((OUT / "draws-len256/bf16_engine_eval.json").read_text())}
LR_ARMS = ("bf16", "mixed-none", "mixed-token_tis", "mixed-ais", "unified")
DRAWS = (1, 11, 12, 13, 14, 15, 16, 17)  # seed 1's RL draws (draws-len256/runs/draw1-* but token TIS: copies of grid cells)
STARTS = (0, 1, 2, 3, 4)  # the row's seeds with RL cells
STRONG_START = 0.5  # a start is strong when its bf16 arm's held-out pass@1 at RL step 0 reaches this
START_KEYS = [(s, 1 if s == 1 else 0) for s in STARTS]  # one draw a start: seed 1's draw 1 is its grid cell
lr_cells = {**{(s, 0): f"runs/seed{s}-len256-lr3e-5-{{}}" for s in STARTS if s != 1},
            **{(1, d): f"draws-len256/runs/draw{d}-lr3e-5-{{}}" for d in DRAWS}}
late, one_engine = {}, {}
for (seed, draw), pattern in lr_cells.items():
    for arm in LR_ARMS:
        cell = OUT / pattern.format(arm)
        if not exists(cell / "COMPLETE"):
            continue
        one_engine[(seed, draw, arm)] = lr_row_engine[cell.name]["in_mode"]
        late[(seed, draw, arm)] = describe(f"seed {seed} draw {draw or '-'} {arm}", cell, one_engine[(seed, draw, arm)])
start_bf16 = {k: rows(OUT / lr_cells[k].format("bf16"), "eval")[0]["eval/pass@1"] for k in START_KEYS
              if (*k, "bf16") in late}  # held-out pass@1 at RL step 0
strong_keys = [k for k, start in start_bf16.items() if start >= STRONG_START]
print(f"strong starts (bf16 held-out pass@1 at RL step 0 >= {STRONG_START}): seeds {[k[0] for k in strong_keys]}")
for a, b in LR_PAIRS:
    for label, table in (("own engines", late), ("one bf16 engine", one_engine)):
        for which, keys in (("seed 1's draws", [(1, d) for d in DRAWS]),
                            ("seed 1's draws 1, 11, 12", [(1, d) for d in DRAWS[:3]]),
                            (f"seeds {STARTS} (seed 1: draw 1)", START_KEYS),
                            ("strong starts (seed 1: draw 1)", strong_keys)):
            pair = arm_pair(table, keys, a, b)
            if pair["n"] > 1:
                some = f" [{pair['n']} of {len(keys)} have both]" if pair["n"] < len(keys) else ""
                print(f"{a} - {b}, {which}, {label}: {paired_text(pair)}{some}")
            elif pair["n"]:
                print(f"{a} - {b}, {which}, {label}: {pair['mean']:+.3f} (one pair: 1 of the {len(keys)} have both)")
