"""The memory estimate (jetflow.run.memory_estimate) against the peak RSS measured by measure.sh.

    PYTHONPATH=. python scripts/analysis/memory_estimate_compare.py      # -> results/memory-estimate/table.{md,json}

Each measurement describes itself: a bench's JSON (model, mode, batch, lengths, overrides), a run's
/usr/bin/time file (the command line). The estimate is computed for the same configuration: the bench's
process (estimate_train_step: its source model and one Trainer) or `jetflow train`'s (estimate_run).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from jetflow.bench.workload import bench_config
from jetflow.config import derive, load_config
from jetflow.run.build import load_inputs, model_architecture
from jetflow.run.memory_estimate import GIB, estimate_run, estimate_train_step

HERE = Path(__file__).resolve().parents[2] / "results" / "memory-estimate"
RUNS = HERE / "runs"


def peak_rss(time_file: Path) -> int:
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_file.read_text())
    assert kib is not None, time_file
    return int(kib.group(1)) * 1024


def command(time_file: Path) -> list[str]:
    found = re.search(r'Command being timed: "(.*)"', time_file.read_text())
    assert found is not None, time_file
    line = found.group(1)
    return shlex.split(line)


def estimate_for(name: str, where: Path = RUNS):
    """(estimate, description) for measurement `name` (its bench JSON in `where`, or its run's time file)."""
    bench = where / f"{name}.json"
    if bench.exists():
        payload = json.loads(bench.read_text())
        w, mode = payload["workload"], payload["rows"][0]["mode"]
        cfg = bench_config(w["model"], [*w["overrides"], f"precision.mode={mode}"])
        first = w["warmup"] == 0 and w["reps"] == 1
        est = estimate_train_step(cfg, derive(cfg), model_architecture(cfg), w["batch"], w["prompt_len"], w["response_len"],
                                  first_step_only=first)
        what = (f"bench train-step {w['model']} {mode}, {w['batch']} x ({w['prompt_len']} + {w['response_len']})"
                f"{', first step only' if first else ''}"
                f"{', chunk ' + str(w['logprob_chunk_tokens']) if w['logprob_chunk_tokens'] else ''}"
                f"{', checkpointing' if w['activation_checkpointing'] else ''}")
        return est, what
    args = command(RUNS / f"{name}.time")
    overrides = [a for a in args[args.index("train") + 1:] if "=" in a]
    cfg = load_config(None, overrides)
    prompt = load_inputs(cfg).longest_prompt
    est = estimate_run(cfg, derive(cfg), model_architecture(cfg), prompt)
    what = f"jetflow train {cfg.model.path} {cfg.precision.mode}, {' '.join(overrides)}"
    return est, what


ISSUE39 = Path("results/train-step-long/runs")
ISSUE39_VALID = ("before-b4-r256-fixed", "after-b4-r256-fixed")
"""issue 39's SmolLM2 measurements that today's code reproduces: at 320 positions the exact attention's
backward, since then computed in 128-row blocks, held under 0.1 GB of (B, H, T, S) scores; at 1024 and
more positions it held 0.5-1.8 GB that today's code does not (results/train-step-long/README.md)."""


def measurements() -> list[tuple[str, Path, int]]:
    """(name, bench JSON dir, measured peak bytes): this directory's /usr/bin/time files, then issue 39's."""
    out = [(t.stem, RUNS, peak_rss(t)) for t in sorted(RUNS.glob("*.time")) if "Maximum resident" in t.read_text()]
    for name in ISSUE39_VALID:
        payload = json.loads((ISSUE39 / f"{name}.json").read_text())
        out.append((f"issue39/{name}", ISSUE39, int(payload["peak_rss_gb"] * 1e9)))  # its ru_maxrss, GB
    return out


def main() -> None:
    rows = []
    for name, where, measured in measurements():
        est, what = estimate_for(name.split("/")[-1], where)
        rows.append({"name": name, "configuration": what, "estimate_gib": round(est.total / GIB, 3),
                     "measured_gib": round(measured / GIB, 3), "ratio": round(est.total / measured, 3),
                     "terms_gib": {t.name: round(t.bytes / GIB, 3) for t in est.terms}})
        print(f"{name}: estimate {est.total / GIB:.2f} GiB, measured {measured / GIB:.2f} GiB, "
              f"ratio {est.total / measured:.2f}\n{est.table()}\n", flush=True)
    md = ["| measurement | configuration | estimate (GiB) | measured peak RSS (GiB) | estimate / measured |",
          "|---|---|---|---|---|"]
    md += [f"| {r['name']} | {r['configuration']} | {r['estimate_gib']:.2f} | {r['measured_gib']:.2f} | {r['ratio']:.2f} |"
           for r in rows]
    (HERE / "table.md").write_text("\n".join(md) + "\n")
    (HERE / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
