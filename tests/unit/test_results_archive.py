"""A study's runs read in place from its archive (jetflow.ablate.archive, issue 76): the same rows, status
and figures' series as from the loose run folders, and results/'s archived studies read back."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

from jetflow.ablate import archive
from jetflow.ablate.figures import position_series
from jetflow.ablate.report import cell_summary
from jetflow.run.report import position_curve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "analysis"))
import archive_runs  # noqa: E402  (scripts/analysis/archive_runs.py)


def _rows(n: int, seed: int) -> list[dict]:
    rows = [{"step": s, "phase": "rl", "reward/mean": 0.1 * s + seed, "mismatch/kl_k3": 1e-3 * (s + 1)} for s in range(n)]
    return rows + [{"step": n, "phase": "eval", "eval/pass@1": 0.5 + seed}]


def _study(root: Path) -> Path:
    study = root / "study"
    for seed, done in ((0, True), (1, False)):
        run = study / "runs" / f"cell{seed}"
        run.mkdir(parents=True)
        text = "".join(json.dumps(r) + "\n" for r in _rows(5, seed))
        if seed:
            (run / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (run / "metrics.jsonl").write_text(text)
        (run / "mismatch_positions.jsonl").write_text("".join(
            json.dumps({"step": s, "kl_k3": [1e-3, 2e-3 * s, 0.0], "count": [4, 3, 0]}) + "\n" for s in range(4)))
        (run / "config.yaml").write_text(f"run:\n  seed: {seed}\n")
        if done:
            (run / "COMPLETE").write_text("done\n")
    (study / "job.log").write_text("log\n")
    (study / "summary.md").write_text("# kept\n")
    return study


def _observe(study: Path) -> dict:
    runs = study / "runs"
    return {
        "list": archive.listdir(runs),
        "rows": {c: archive.metrics_rows(runs / c) for c in ("cell0", "cell1", "nope")},
        "rl": archive.metrics_rows(runs / "cell1", "rl"),
        "status": {c: archive.run_status(runs / c) for c in ("cell0", "cell1", "nope")},
        "exists": [archive.exists(runs / "cell0" / "COMPLETE"), archive.exists(runs / "cell1" / "COMPLETE"),
                   archive.exists(runs / "cell1"), archive.exists(study / "job.log")],
        "positions": position_series(runs / "cell0"),
        "config": archive.read_bytes(runs / "cell1" / "config.yaml"),
        "summary": {k: v for k, v in cell_summary("cell0", "complete", runs / "cell0", []).items() if k != "run_dir"},
    }


def test_archive_reads_what_the_run_folders_held(tmp_path: Path) -> None:
    study = _study(tmp_path)
    loose = _observe(study)
    assert loose["rows"]["cell1"] == _rows(5, 1) and loose["rows"]["nope"] == []
    assert loose["status"] == {"cell0": "complete", "cell1": "partial", "nope": "pending"}
    assert loose["positions"] == dict(zip(*position_curve(study / "runs" / "cell0")))  # the run report's pooling

    files = [p for p in sorted(study.rglob("*")) if p.is_file()]
    packed = archive_runs.packed_files(study, files)
    assert study / "summary.md" not in packed and study / "job.log" in packed and len(packed) == len(files) - 1
    archive_runs.write(study / archive.ARCHIVE, archive_runs.build(study, packed))
    shutil.rmtree(study / "runs")
    (study / "job.log").unlink()
    assert "runs/cell1/metrics.jsonl" in archive.members(study / archive.ARCHIVE)  # the .gz went in as .jsonl
    assert _observe(study) == loose

    again = study / "again.tar.xz"  # the same files make the same bytes
    archive_runs.write(again, archive.members(study / archive.ARCHIVE))
    assert again.read_bytes() == (study / archive.ARCHIVE).read_bytes()


def test_a_loose_file_comes_before_its_archived_member(tmp_path: Path) -> None:
    study = _study(tmp_path)
    files = [p for p in sorted(study.rglob("*")) if p.is_file()]
    archive_runs.write(study / archive.ARCHIVE, archive_runs.build(study, archive_runs.packed_files(study, files)))
    (study / "runs" / "cell0" / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "rl"}) + "\n")
    assert archive.metrics_rows(study / "runs" / "cell0") == [{"step": 0, "phase": "rl"}]


@pytest.mark.parametrize("study", ["precision", "precision-moe", "smollm2", "smoke"])
def test_results_studies_read_from_their_archives(study: str) -> None:
    """Every cell of an archived study in results/ is complete and gives the numbers its summary.json has."""
    folder = ROOT / "results" / study
    if not (folder / archive.ARCHIVE).is_file():
        pytest.skip(f"results/{study} has no archive")
    assert not (folder / "runs").exists(), "the run folders are in the archive, not beside it"
    for cell in json.loads((folder / "summary.json").read_text())["cells"]:
        run_dir = folder / "runs" / cell["cell"]
        assert archive.run_status(run_dir) == "complete"
        got = cell_summary(cell["cell"], "complete", run_dir, cell["overrides"])
        for key in ("steps", "reward_final", "kl_k3_mean", "equal_frac_mean", "time_rollout"):
            assert got[key] == cell[key], (study, cell["cell"], key)


ANALYSIS_PATHS = ["scripts/analysis", "results/long-train/grpo-2048-reward/reward.py",
                  "results/long-train/host-memory/trim_wrapper.py"]
"""The studies' scripts: linted here (scripts/test.sh lints jetflow/), type-checked by `mypy` (pyproject's files)."""


def test_the_studies_scripts_pass_ruff() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).is_file():
        pytest.skip("ruff is not installed")
    import subprocess
    done = subprocess.run([ruff, "check", "--quiet", *ANALYSIS_PATHS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    beside = {str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*.py")
              if p.relative_to(ROOT).parts[1] not in ("async", "ci")}  # two folders this test does not own
    assert beside <= set(ANALYSIS_PATHS), f"scripts under results/ that nothing lints: {sorted(beside - set(ANALYSIS_PATHS))}"
