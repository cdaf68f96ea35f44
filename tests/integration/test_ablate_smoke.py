"""`jetflow ablate` end to end on configs/ablations/smoke.yaml (2 tiny cells x 2 RL steps): the report,
skipping finished cells on a rerun, and resuming an interrupted cell from its last checkpoint."""

import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from jetflow.ablate import load_ablation, run_ablation
from jetflow.run.files import COMPLETE

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs/ablations/smoke.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def _rl_steps(out: Path, cell: str) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["cell"] == cell and r["phase"] == "rl"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "smoke"
    logs: list[str] = []
    assert run_ablation(SMOKE, out_dir=out, command="pytest smoke", log=logs.append) == 0, logs
    return out, load_ablation(SMOKE, out)


def test_report(smoke):
    out, ab = smoke
    cells = [c.id for c in ab.cells]
    assert cells == ["mixed", "unified"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"] == "pytest smoke" and summary["environment"]["torch"]
    assert [r["cell"] for r in summary["cells"]] == cells
    for row in summary["cells"]:
        assert row["status"] == "complete" and row["steps"] == 2
        for key in ("reward_final", "reward_best", "kl_k3_mean", "kl_k3_max", "time_rollout", "time_old_logprobs",
                    "time_train", "time_sync", "tokens_per_s", "rollout_tokens_per_s", "entropy_first", "entropy_final",
                    "rollout_log_ppl_final", "equal_frac_mean"):
            assert row[key] is not None, key
    kl = {r["cell"]: r["kl_k3_mean"] for r in summary["cells"]}
    assert kl["mixed"] > kl["unified"]

    md = (out / "summary.md").read_text()
    assert "Command: `pytest smoke`" in md and "Machine:" in md
    rows = [line for line in md.splitlines() if "| complete | 2 |" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| mixed", "| unified"]

    for name in ("reward.png", "entropy.png", "mismatch_kl.png", "mismatch_position.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    for cell in cells:
        assert _rl_steps(out, cell) == [0, 1]
        positions = (out / "runs" / cell / "mismatch_positions.jsonl").read_text().splitlines()
        assert [json.loads(p)["step"] for p in positions] == [0, 1]


def test_rerun_skips_then_an_interrupted_cell_resumes(smoke):
    out, _ = smoke
    logs: list[str] = []
    t0 = time.perf_counter()
    assert run_ablation(SMOKE, out_dir=out, command="pytest smoke", log=logs.append) == 0
    assert time.perf_counter() - t0 < 30  # validation + report only
    assert sum("complete, skipped" in line for line in logs) == 2, logs

    # Interrupt `unified` after step 1's checkpoint: as if killed during its last step.
    run = out / "runs" / "unified"
    ckpts = run / "checkpoints"
    final = load_file(str(ckpts / "step_000002" / "model.safetensors"))
    for name in (COMPLETE, "summary.json"):
        (run / name).unlink()
    (ckpts / "latest").write_text("step_000001")
    for p in (ckpts / "step_000002").iterdir():
        p.unlink()
    (ckpts / "step_000002").rmdir()

    logs.clear()
    assert run_ablation(SMOKE, out_dir=out, command="pytest smoke", log=logs.append) == 0
    assert any("mixed: complete, skipped" in line for line in logs), logs
    assert any("unified: resuming" in line for line in logs), logs
    assert (run / COMPLETE).exists()
    resumed = load_file(str(ckpts / "step_000002" / "model.safetensors"))
    assert all((resumed[k] == final[k]).all() for k in final)  # the same weights as uninterrupted
    assert _rl_steps(out, "unified") == [0, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in summary["cells"]] == ["complete", "complete"]
