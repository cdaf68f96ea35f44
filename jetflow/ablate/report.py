"""The report of an ablation (`jetflow ablate`), rebuilt from the run directories on disk.

<out_dir>/summary.md     one row per cell, the exact command and the machine, the plots
<out_dir>/summary.json   the same numbers, plus each cell's overrides and the environment
<out_dir>/metrics.jsonl  every cell's metric rows (SFT and RL phases), each with a `cell` field: a merge of
                         runs/<cell>/metrics.jsonl, redrawn with the report, so not kept in git
<out_dir>/reward.png, heldout.png, entropy.png, mismatch_kl.png, mismatch_position.png
                         (jetflow.ablate.figures: one panel per setting, one line per variant)
<out_dir>/.gitignore     keeps the runs' checkpoints and the merged metrics.jsonl out of git (runs/ holds
                         the rows once; the rest of it is small)

Per cell: final reward = mean `reward/mean` over the last 3 RL steps, best = its maximum; mismatch KL
= `mismatch/kl_k3` (KL(rollout || trainer) on the sampled tokens) mean and max over steps; equal =
mean `mismatch/equal_frac` (share of tokens whose two log-probs are bitwise equal); entropy = the
policy's entropy on the trainer side (`policy/entropy`), mean of the first and of the last 3 steps,
beside the rollout's own log-perplexity (`policy/rollout_log_ppl`) of the last 3; times =
mean seconds per step of each phase; tokens/s = mean of `throughput/tokens_per_s` (prompt + response
tokens through the whole step) and `throughput/rollout_tokens_per_s` (generated tokens / rollout time).

With `compare: [[a, b], ...]` in the ablation file, summary.md also gets, per setting, every variant's
mean and seed spread (sample standard deviation, lowest and highest seed) of the final held-out pass@1
(last evaluation), of its mean over the run's evaluations after the first (the curve), and of the
final reward, and for each pair the difference of means a - b with its standard error,
sqrt(s_a^2 / n_a + s_b^2 / n_b) (Welch), and the same difference over the seeds both variants ran
(paired: the mean of the per-seed differences, SE = their standard deviation / sqrt(n)). A seed of
two variants starts from the same initial weights and samples with the same random numbers; under
one trainer precision (bf16 and mixed) the warm-up is the same too.

The position plot reads each run's `mismatch_positions.jsonl` (one row per RL step: mean k3 per
response index and the token count there, written by jetflow.run.files) and pools all steps,
weighting each index by its token count. Cells without that file are left out of that plot.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jetflow.ablate import archive
from jetflow.ablate.figures import draw_all
from jetflow.ablate.grid import Ablation, Replicate, load_ablation, place_cells, replicate
from jetflow.bench.common import environment, markdown_table
from jetflow.run.files import ERROR_FILE, POSITIONS_FILE

TIME_KEYS = ("time/rollout", "time/old_logprobs", "time/train", "time/sync")
COLUMNS = {  # summary.json key -> summary.md column
    "cell": "cell", "status": "status", "steps": "steps", "reward_final": "final reward",
    "reward_best": "best reward", "kl_k3_mean": "KL k3 mean", "kl_k3_max": "KL k3 max",
    "equal_frac_mean": "equal", "entropy_first": "entropy first", "entropy_final": "entropy last",
    "heldout_pass1_start": "held-out start", "heldout_pass1_end": "held-out end",
    "heldout_pass1_mean": "held-out mean", "low_prob_frac_mean": "low-prob share", "grad_norm_max": "grad norm max",
    "rollout_log_ppl_final": "rollout log-ppl last", "response_length_mean": "resp len", "time_rollout": "rollout s",
    "time_old_logprobs": "old logp s",
    "time_train": "train s", "time_sync": "sync s", "tokens_per_s": "tok/s", "rollout_tokens_per_s": "rollout tok/s",
}


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def cell_summary(cell_id: str, status: str, run_dir: Path, overrides: list[str]) -> dict:
    rows = archive.metrics_rows(run_dir)
    rl = [r for r in rows if r.get("phase") == "rl"]

    def col(key: str) -> list[Any]:
        return [r.get(key) for r in rl]

    rewards = [v for v in col("reward/mean") if v is not None]
    evals = [r for r in rows if r.get("phase") == "eval"]
    kl = [v for v in col("mismatch/kl_k3") if v is not None]
    row = {
        "cell": cell_id, "status": status, "steps": len(rl),
        "reward_final": _mean(rewards[-3:]), "reward_first": _mean(rewards[:3]),
        "reward_best": max(rewards) if rewards else None,
        "accuracy_final": _mean(col("reward/accuracy")[-3:]),
        "heldout_pass1_start": evals[0].get("eval/pass@1") if evals else None,
        "heldout_pass1_end": evals[-1].get("eval/pass@1") if evals else None,
        "heldout_pass1_mean": _mean([r.get("eval/pass@1") for r in evals[1:]]),
        "kl_k3_mean": _mean(kl), "kl_k3_max": max(kl) if kl else None,
        "equal_frac_mean": _mean(col("mismatch/equal_frac")),
        "entropy_first": _mean(col("policy/entropy")[:3]), "entropy_final": _mean(col("policy/entropy")[-3:]),
        "rollout_log_ppl_final": _mean(col("policy/rollout_log_ppl")[-3:]),
        "low_prob_frac_mean": _mean(col("policy/low_prob_frac")),
        "grad_norm_mean": _mean(col("train/grad_norm")),
        "grad_norm_max": max((v for v in col("train/grad_norm") if v is not None), default=None),
        "response_length_mean": _mean(col("response/length_mean")),
        "response_length_max": max((v for v in col("response/length_max") if v is not None), default=None),
        "truncated_frac": _mean(col("response/truncated_frac")),
        **{"time_" + k.split("/", 1)[1]: _mean(col(k)) for k in TIME_KEYS},
        "time_step": _mean(col("time/step")),
        "tokens_per_s": _mean(col("throughput/tokens_per_s")),
        "rollout_tokens_per_s": _mean(col("throughput/rollout_tokens_per_s")),
        "overrides": overrides,
        "run_dir": str(run_dir),
    }
    error = archive.read_bytes(run_dir / ERROR_FILE) if status == "failed" else None
    if error is not None:
        lines = [line for line in error.decode(errors="replace").splitlines() if line.strip()]
        row["error"] = lines[-1] if lines else "unknown error"
    return row


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


VARIANT_COLUMNS = {"panel": "setting", "line": "variant", "seeds": "seeds", "reward": "final reward",
                   "reward_range": "seed range", "heldout": "held-out pass@1 start -> end", "kl": "KL k3 mean"}


def _g(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}"


def variant_rows(placed: list, by_cell: dict[str, dict]) -> list[dict]:
    """One row per (setting, variant): means over the variant's cells that ran."""
    rows = []
    for key in dict.fromkeys((p.panel, p.line) for p in placed):
        cells = [by_cell[p.cell.id] for p in placed if (p.panel, p.line) == key and by_cell[p.cell.id]["steps"]]
        if not cells:
            continue
        finals = [c["reward_final"] for c in cells if c["reward_final"] is not None]
        start, end = _mean([c["heldout_pass1_start"] for c in cells]), _mean([c["heldout_pass1_end"] for c in cells])
        rows.append({
            "setting": key[0], "variant": key[1], "seeds": len(cells), "final reward": _g(_mean(finals)),
            "seed range": f"{min(finals):.3g} .. {max(finals):.3g}" if len(finals) > 1 else "",
            "held-out pass@1 start -> end": f"{start:.3g} -> {end:.3g}" if start is not None else "",
            "KL k3 mean": _g(_mean([c["kl_k3_mean"] for c in cells])),
        })
    return rows


def seed_stats(values: list[float]) -> dict[str, float | None]:
    """n, mean, sample standard deviation (ddof 1; None below 2 values), min and max."""
    n = len(values)
    mean = sum(values) / n if n else None
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else None
    return {"n": n, "mean": mean, "sd": sd, "min": min(values) if n else None, "max": max(values) if n else None}


def difference(a: Mapping[Any, float], b: Mapping[Any, float]) -> dict[str, float | None]:
    """Difference of means a - b of two variants' per-seed values ({seed: value}): Welch's standard
    error over all seeds of each, and the paired difference over the seeds both have."""
    sa, sb = seed_stats(list(a.values())), seed_stats(list(b.values()))
    out: dict[str, float | None] = {"n_a": sa["n"], "n_b": sb["n"], "diff": None, "se": None,
                                    "paired_n": 0, "paired_diff": None, "paired_se": None}
    if sa["n"] and sb["n"]:
        out["diff"] = sa["mean"] - sb["mean"]
        if sa["sd"] is not None and sb["sd"] is not None:
            out["se"] = (sa["sd"] ** 2 / sa["n"] + sb["sd"] ** 2 / sb["n"]) ** 0.5
    common = sorted(set(a) & set(b))
    if common:
        d = seed_stats([a[s] - b[s] for s in common])
        out.update(paired_n=d["n"], paired_diff=d["mean"],
                   paired_se=d["sd"] / d["n"] ** 0.5 if d["sd"] is not None else None)
    return out


ARM_METRICS = {  # summary.json key -> what summary.md calls it
    "heldout_pass1_end": "final held-out pass@1",
    "heldout_pass1_mean": "held-out pass@1, mean of the curve",
    "reward_final": "final reward",
}


def _per_seed(placed: list, by_cell: dict[str, dict], panel: str, line: str, key: str) -> dict[Replicate, float]:
    out = {}
    for p in placed:
        row = by_cell[p.cell.id]
        if (p.panel, p.line) == (panel, line) and row["steps"] and row.get(key) is not None:
            out[replicate(p.cell)] = row[key]
    return out


def _pm(st: dict) -> str:
    if st["mean"] is None:
        return ""
    sd = f" ± {st['sd']:.3f}" if st["sd"] is not None else ""
    rng = f" ({st['min']:.3g} .. {st['max']:.3g})" if st["n"] > 1 else ""
    return f"{st['mean']:.3f}{sd}{rng}"


def arm_rows(placed: list, by_cell: dict[str, dict]) -> list[dict]:
    """Per (setting, variant): mean, seed spread and range of each ARM_METRICS value, with the
    variant's mean mismatch, entropy, low-probability share and gradient norm."""
    rows = []
    for panel, line in dict.fromkeys((p.panel, p.line) for p in placed):
        cells = [by_cell[p.cell.id] for p in placed if (p.panel, p.line) == (panel, line) and by_cell[p.cell.id]["steps"]]
        if not cells:
            continue
        row = {"setting": panel, "variant": line, "seeds": len(cells)}
        for key in ARM_METRICS:
            row[key] = seed_stats(list(_per_seed(placed, by_cell, panel, line, key).values()))
        for key in ("kl_k3_mean", "entropy_final", "low_prob_frac_mean", "grad_norm_mean", "grad_norm_max"):
            row[key] = _mean([c.get(key) for c in cells])
        rows.append(row)
    return rows


def comparison_rows(placed: list, by_cell: dict[str, dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """Per setting, pair (a, b) and ARM_METRICS value: `difference` of the two variants' seeds."""
    rows = []
    for panel in dict.fromkeys(p.panel for p in placed):
        for a, b in pairs:
            for key in ARM_METRICS:
                va, vb = (_per_seed(placed, by_cell, panel, v, key) for v in (a, b))
                if va and vb:
                    rows.append({"setting": panel, "a": a, "b": b, "metric": key, **difference(va, vb)})
    return rows


def _se(diff: float | None, se: float | None) -> str:
    if diff is None:
        return ""
    return f"{diff:+.3f} ± {se:.3f}" if se is not None else f"{diff:+.3f}"


def comparison_markdown(arms: list[dict], comparisons: list[dict]) -> list[str]:
    arm_table = [{"setting": r["setting"], "variant": r["variant"], "seeds": r["seeds"],
                  **{label: _pm(r[key]) for key, label in ARM_METRICS.items()},
                  "KL k3 mean": _g(r["kl_k3_mean"]), "entropy last": _g(r["entropy_final"]),
                  "low-prob share": _g(r["low_prob_frac_mean"]), "grad norm mean / max":
                  f"{_g(r['grad_norm_mean'])} / {_g(r['grad_norm_max'])}" if r["grad_norm_mean"] is not None else ""}
                 for r in arms]
    cmp_table = [{"setting": r["setting"], "a - b": f"{r['a']} - {r['b']}", "metric": ARM_METRICS[r["metric"]],
                  "seeds a / b": f"{r['n_a']} / {r['n_b']}", "difference ± SE": _se(r["diff"], r["se"]),
                  "paired (seeds)": (f"{_se(r['paired_diff'], r['paired_se'])} ({r['paired_n']})"
                                     if r["paired_n"] else "")}
                 for r in comparisons]
    return [
        "## Arms: mean and seed spread", "",
        markdown_table(arm_table, list(arm_table[0]) if arm_table else ["setting"]), "",
        "Per setting and variant, over its seeds: mean ± sample standard deviation (lowest .. highest seed). "
        "Final held-out pass@1: greedy pass@1 on the held-out split at the last evaluation; mean of the curve: "
        "its mean over every evaluation after the first (before any RL step); final reward: mean `reward/mean` "
        "of the last 3 RL steps. KL k3 mean, entropy last, low-prob share (`policy/low_prob_frac`, sampled tokens "
        "with rollout p < 0.1) and gradient norm (`train/grad_norm`, before clipping; mean over steps / "
        "largest step): means over the seeds.", "",
        "## Differences of means", "",
        markdown_table(cmp_table, list(cmp_table[0]) if cmp_table else ["setting"]), "",
        "a - b: difference of the two variants' means ± its standard error sqrt(s_a^2/n_a + s_b^2/n_b) "
        "(s: the sample standard deviation over seeds). Paired: the mean of the per-seed differences over the "
        "seeds both ran ± their standard deviation / sqrt(n) (a seed fixes the initial weights and the sampling "
        "random numbers of every variant). A difference within about two standard errors of 0 is not evidence "
        "of an effect.", "",
    ]


def is_ablation_dir(path: Path) -> bool:
    """An `jetflow ablate` output directory: its summary.json names the ablation file."""
    try:
        return "ablation_file" in json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False


def redraw_report(out_dir: Path) -> Path:
    """Rewrite an ablation's report from its runs, keeping the command that made them
    (`jetflow report results/precision`)."""
    summary = json.loads((out_dir / "summary.json").read_text())
    return write_report(load_ablation(summary["ablation_file"], out_dir), summary["command"])


def _fmt_env(env: dict) -> str:
    return (f"{env['device']} ({env['cpu']}, {env['cpu_count']} CPU cores, {env['torch_threads']} torch threads), "
            f"python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}")


def write_report(ab: Ablation, command: str) -> Path:
    """Rebuild every report file of `ab` from its run directories; returns summary.md's path."""
    out = ab.out_dir
    out.mkdir(parents=True, exist_ok=True)
    # results/ is committed; the runs' checkpoints (megabytes each, kept for resuming and for looking
    # at the final policies) are not
    if not (out / ".gitignore").exists():
        (out / ".gitignore").write_text("runs/*/checkpoints/\nmetrics.jsonl\n")
    env = environment()
    rows, all_metrics = [], []
    for cell in ab.cells:
        run_dir = ab.run_dir(cell)
        rows.append(cell_summary(cell.id, archive.run_status(run_dir), run_dir, cell.overrides))
        all_metrics += [{"cell": cell.id, **r} for r in archive.metrics_rows(run_dir)]
    placed = place_cells(ab)
    plots = draw_all(ab)
    by_cell = {r["cell"]: r for r in rows}
    variants = variant_rows(placed, by_cell)
    arms = arm_rows(placed, by_cell) if ab.compare else []
    comparisons = comparison_rows(placed, by_cell, ab.compare) if ab.compare else []

    _atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in all_metrics))
    generated = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary = {
        "name": ab.name, "ablation_file": str(ab.source), "command": command, "environment": env,
        "base_config": str(ab.base_config) if ab.base_config else None, "overrides": ab.overrides,
        "grid": ab.grid, "out_dir": str(out), "generated": generated, "cells": rows, "plots": plots,
    }
    if ab.compare:
        summary.update(compare=[list(p) for p in ab.compare], arms=arms, comparisons=comparisons)
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")

    md = _summary_markdown(ab, command, env, generated, rows, variants, arms, comparisons, plots)
    _atomic_write(out / "summary.md", "\n".join(md))
    return out / "summary.md"


def _summary_markdown(ab: Ablation, command: str, env: dict, generated: str, rows: list[dict], variants: list[dict],
                      arms: list, comparisons: list, plots: dict[str, str]) -> list[str]:
    """summary.md's lines: the variants, the cells, the comparisons, the failures, the figures, the overrides."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    table_rows = [{COLUMNS[k]: ("" if r.get(k) is None else r[k]) for k in COLUMNS} for r in rows]
    failed = [f"- `{r['cell']}`: {r['error']}" for r in rows if r.get("error")]
    no_pos = [r["cell"] for r in rows if r["steps"] and not archive.exists(Path(r["run_dir"]) / POSITIONS_FILE)]
    md = [
        f"# Ablation: {ab.name}", "",
        f"Command: `{command}`  ",
        f"Ablation file: `{ab.source}`; base config: `{ab.base_config or '(defaults)'}`  ",
        f"Common overrides: `{' '.join(ab.overrides) or '(none)'}`  ",
        f"Machine: {_fmt_env(env)}  ",
        f"Generated: {generated}; cells: {len(rows)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))})",
        "",
        "## Variants (mean over seeds)", "",
        markdown_table(variants, list(VARIANT_COLUMNS.values())), "",
        "One row per setting and variant, as the figures draw them: final reward as below, mean over the "
        "variant's seeds (with the lowest and highest seed); held-out pass@1: greedy accuracy on the task's "
        "held-out split (prompts training never sees) at the first and last evaluation; KL k3 mean: as below.", "",
        "## Cells", "",
        markdown_table(table_rows, list(COLUMNS.values())), "",
        "Final reward: mean `reward/mean` over the last 3 RL steps; best: its maximum. KL k3: "
        "`mismatch/kl_k3`, KL(rollout || trainer) on the sampled tokens, mean and max over steps; equal: "
        "mean share of tokens whose rollout and trainer log-probs are bitwise equal. entropy: the policy's "
        "entropy per token on the trainer side (`policy/entropy`), first and last 3 steps; rollout log-ppl: "
        "the rollout's own mean -log p of its tokens, last 3 steps. "
        "resp len: mean generated tokens. Times: mean seconds per step (rollout, trainer old log-probs, "
        "train, weight sync). tok/s: prompt + response tokens per step second; rollout tok/s: generated "
        "tokens per rollout second. held-out start / end: greedy pass@1 on the held-out split at the first "
        "and last evaluation (empty: the run had no evaluation); held-out mean: its mean over the evaluations "
        "after the first. low-prob share: mean `policy/low_prob_frac` (sampled tokens with rollout p < 0.1); "
        "grad norm max: the largest `train/grad_norm` (before clipping). Per-step rows of every cell: `metrics.jsonl`.", "",
    ]
    if ab.compare:
        md += comparison_markdown(arms, comparisons)
    if failed:
        md += ["Failed cells (details in `runs/<cell>/error.txt`):", *failed, ""]
    md += ["## Figures", "",
           "One panel per setting, one line per variant (the mean over its seeds, smoothed, with the unsmoothed "
           "mean faint beneath and a band from the lowest to the highest seed); one colour per precision mode "
           "(bf16 blue, mixed red, unified green), line styles for the variants of a mode.", "",
           "![reward](reward.png)", "", "![held-out pass@1](heldout.png)", "", "![entropy](entropy.png)", "",
           "![mismatch KL](mismatch_kl.png)", "",
           "Log axes leave out exact zeros (a step with no mismatch at all); a panel names the variants that "
           "were exactly 0 throughout.", "",
           "![mismatch by position](mismatch_position.png)", ""]
    md += [f"![{name.replace('_', ' ')}]({file})\n" for name, file in plots.items()
           if file not in ("reward.png", "heldout.png", "entropy.png", "mismatch_kl.png", "mismatch_position.png")]
    if no_pos:
        md += [f"No per-position data (`{POSITIONS_FILE}`) for: {', '.join(no_pos)}.", ""]
    md += ["## Cell overrides", "", markdown_table([{"cell": r["cell"], "overrides": "`" + " ".join(r["overrides"]) + "`"}
                                           for r in rows], ["cell", "overrides"]), ""]
    return md
