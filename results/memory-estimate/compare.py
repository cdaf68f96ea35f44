"""The memory estimate (jetflow.run.memory_estimate) against the peak RSS measured by measure.sh.

    PYTHONPATH=. python results/memory-estimate/compare.py      # -> results/memory-estimate/table.{md,json}

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
from jetflow.run.build import build_task, build_tokenizer, longest_prompt, model_architecture
from jetflow.run.memory_estimate import GIB, estimate_run, estimate_train_step

HERE = Path(__file__).parent
RUNS = HERE / "runs"


def peak_rss(time_file: Path) -> int:
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_file.read_text())
    return int(kib.group(1)) * 1024


def command(time_file: Path) -> list[str]:
    line = re.search(r'Command being timed: "(.*)"', time_file.read_text()).group(1)
    return shlex.split(line)


def estimate_for(name: str):
    """(estimate, description) for measurement `name`."""
    bench = RUNS / f"{name}.json"
    if bench.exists():
        payload = json.loads(bench.read_text())
        w, mode = payload["workload"], payload["rows"][0]["mode"]
        cfg = bench_config(w["model"], [*w["overrides"], f"precision.mode={mode}"])
        est = estimate_train_step(cfg, derive(cfg), model_architecture(cfg), w["batch"], w["prompt_len"], w["response_len"])
        what = (f"bench train-step {w['model']} {mode}, {w['batch']} x ({w['prompt_len']} + {w['response_len']})"
                f"{', chunk ' + str(w['logprob_chunk_tokens']) if w['logprob_chunk_tokens'] else ''}"
                f"{', checkpointing' if w['activation_checkpointing'] else ''}")
        return est, what
    args = command(RUNS / f"{name}.time")
    overrides = [a for a in args[args.index("train") + 1:] if "=" in a]
    cfg = load_config(None, overrides)
    prompt = longest_prompt(cfg, build_tokenizer(cfg), build_task(cfg))
    est = estimate_run(cfg, derive(cfg), model_architecture(cfg), prompt)
    what = f"jetflow train {cfg.model.path} {cfg.precision.mode}, {' '.join(overrides)}"
    return est, what


def main() -> None:
    rows = []
    for time_file in sorted(RUNS.glob("*.time")):
        name = time_file.stem
        if "Maximum resident" not in time_file.read_text():
            continue  # still running, or killed
        est, what = estimate_for(name)
        measured = peak_rss(time_file)
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
