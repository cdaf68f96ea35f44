"""`jetflow ablate FILE`: run the cells of an ablation (jetflow.ablate.grid), then report
(jetflow.ablate.report).

Each cell is one `jetflow.run.runner.train` run in <out_dir>/runs/<cell id>/, run in this
process, one after another. In-process is enough: `train` seeds torch and Python's RNG itself, builds
its model, trainer and engine from scratch and keeps no module-level state, and it saves a
subprocess start and the torch import per cell. Resuming: a run directory with COMPLETE (on disk, or in the
study's runs.tar.xz: jetflow.ablate.archive) is skipped;
one without is continued with `run.resume=true` from its last checkpoint (set
`train.checkpoint_every` for fine-grained restarts), so re-running the command after a kill
continues where it stopped. A cell whose directory was made with a different config is refused (its
results would be mislabelled): delete that directory or choose another out_dir. A cell that raises is
recorded in `<run dir>/error.txt`, the next cells still run, and the command exits non-zero.

After each cell the report (summary.md / summary.json / metrics.jsonl / plots, see
jetflow.ablate.report) is rewritten from whatever runs exist, so partial results are always readable.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from jetflow.ablate.archive import run_status
from jetflow.ablate.grid import Ablation, load_ablation, resolve_cells, select, warmup_config
from jetflow.ablate.report import write_report
from jetflow.ablate.warmups import needs_warmup_start, start_from_warmup
from jetflow.config import Config, ConfigError
from jetflow.run.files import COMPLETE, ERROR_FILE
from jetflow.run.validate import validate_run
from jetflow.run.stop import RunStopped


def run_ablation(path: str | Path, out_dir: str | Path | None = None, only: list[str] | None = None,
                 dry_run: bool = False, command: str | None = None,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> int:
    """Validate, then run each selected cell not yet complete, rewriting the report after each.
    Returns 0, or 1 if a cell failed. A dry run prints the cells and their overrides and runs nothing."""
    ab = load_ablation(path, out_dir)
    cells = select(ab.cells, only)
    configs = resolve_cells(ab, cells)
    shared = {cid: name for cid, name in ab.warmup_groups().items() if cid in configs}
    warmups = _resolve_warmups(ab, set(shared.values()))
    if dry_run:
        base = ab.base_config or "(defaults)"
        print(f"ablation {ab.name}: {len(cells)} of {len(ab.cells)} cells, base {base}, out_dir {ab.out_dir}")
        print(f"common overrides: {' '.join(ab.overrides) or '(none)'}")
        for cell in cells:
            start = f"  (from warm-up {shared[cell.id]})" if cell.id in shared else ""
            print(f"  {cell.id:<32} [{run_status(ab.run_dir(cell))}]  {' '.join(cell.overrides)}{start}")
        return 0

    from jetflow.bench.common import command_line
    from jetflow.run.runner import train
    command = command or command_line()
    ab.out_dir.mkdir(parents=True, exist_ok=True)
    failed, stale = [], True  # stale: no report written by this invocation yet
    for i, cell in enumerate(cells, 1):
        run_dir = ab.run_dir(cell)
        status = run_status(run_dir)
        if status == "complete":
            log(f"[ablate] {i}/{len(cells)} {cell.id}: complete, skipped")
            continue
        log(f"[ablate] {i}/{len(cells)} {cell.id}: {'resuming' if run_dir.exists() else 'starting'}  "
            f"{' '.join(cell.overrides)}")
        (run_dir / ERROR_FILE).unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            if cell.id in shared and needs_warmup_start(run_dir):
                name = shared[cell.id]
                if not (ab.warmup_dir(name) / COMPLETE).exists():
                    log(f"[ablate] shared warm-up {name}: {'resuming' if ab.warmup_dir(name).exists() else 'starting'}")
                    train(warmups[name])
                start_from_warmup(ab.warmup_dir(name), run_dir)
            train(configs[cell.id])
        except RunStopped:
            write_report(ab, command)
            raise  # a stop request ends the ablation too (its cell resumes on the next run)
        except Exception as e:  # noqa: BLE001 - one bad cell should not lose the others
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ERROR_FILE).write_text(traceback.format_exc())
            failed.append(cell.id)
            log(f"[ablate] {cell.id}: FAILED ({type(e).__name__}: {e}); see {run_dir / ERROR_FILE}")
        else:
            log(f"[ablate] {cell.id}: done in {time.perf_counter() - t0:.1f}s")
        report = write_report(ab, command)
        stale = False
        log(f"[ablate] report updated: {report}")
    if stale:
        report = write_report(ab, command)
        log(f"[ablate] report: {report}")
    if failed:
        log(f"[ablate] {len(failed)} cell(s) failed: {failed}")
    return 1 if failed else 0


def _resolve_warmups(ab: Ablation, names: set[str]) -> dict[str, Config]:
    """The shared warm-ups' configs, through the pre-run pass; raise ConfigError naming a bad one."""
    configs = {}
    for name in sorted(names):
        try:
            configs[name] = warmup_config(ab, name)
            validate_run(configs[name])
        except ConfigError as e:
            raise ConfigError(f"shared warm-up {name!r}: {e}") from None
    return configs
