"""A run's report (`jetflow report RUN`, also written at the end of a run): its table against hand-computed
values from a hand-written run directory, its plots, and its errors."""

import json
from pathlib import Path

import pytest
import yaml

from jetflow.cli import main
from jetflow.run import report as run_report
from jetflow.run.report import position_curve, report_at_end, write_run_report

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(tmp_path: Path, kl: list[float], evals=((0, 0.25), (5, 0.75))) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"path": "smollm2"}, "task": {"name": "arithmetic"}, "precision": {"mode": "unified"},
        "train": {"steps": 5}}))
    rewards = [0.1, 0.2, 0.3, 0.5, 0.6, 0.7]  # first 3: mean 0.2; last 3: mean 0.6; best 0.7
    rows = [{"step": s, "phase": "rl", "reward/mean": r, "mismatch/kl_k3": k, "mismatch/equal_frac": 1.0,
             "policy/entropy": 1.0, "response/length_mean": 4.0, "response/truncated_frac": 0.0,
             "throughput/tokens_per_s": 100.0, "time/rollout": 1.0, "time/reward": 0.25, "time/old_logprobs": 0.0,
             "time/train": 3.0, "time/sync": 0.5, "time/step": 5.0}
            for s, (r, k) in enumerate(zip(rewards, kl))]
    rows += [{"step": s, "phase": "eval", "eval/pass@1": p, "eval/reward": p, "eval/num_prompts": 8.0,
              "time/eval": 2.0} for s, p in evals]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # two steps: index 0 has 2 + 2 tokens with k3 0.1 and 0.3 -> 0.2; index 1 only in step 1
    positions = [{"step": 0, "kl_k3": [0.1], "count": [2]}, {"step": 1, "kl_k3": [0.3, 0.5], "count": [2, 1]}]
    (run / "mismatch_positions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in positions))
    return run


def test_table_and_plots_of_a_hand_written_run(tmp_path):
    run = make_run(tmp_path, kl=[0.0] * 6)
    md = write_run_report(run).read_text()
    assert "Precision mode: `unified`; model: `smollm2`; task: `arithmetic`" in md
    assert "RL steps logged: 6 of 5" in md
    assert "| training reward (mean of 3 steps) | 0.2 | 0.6 | best 0.7 |" in md
    assert "| held-out pass@1 (greedy, 8 prompts) | 0.25 | 0.75 | at steps 0 and 5 |" in md
    assert "(exactly 0 on every step)" in md
    # time split: 1 + 0.25 + 0 + 3 + 0.5 of a 5 s step, the other 0.25 s is `other`
    assert "| rollout | 1 | 20% |" in md and "| reward | 0.25 | 5% |" in md and "| train | 3 | 60% |" in md
    assert "| other (advantages, logging) | 0.25 | 5% |" in md
    assert "| held-out evaluation (total, 2 evaluations) | 4 s | |" in md
    for name in run_report.PLOTS:
        data = (run / "report" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
        assert f"![{name}]({name}.png)" in md


def test_position_curve_pools_steps_by_token_count(tmp_path):
    run = make_run(tmp_path, kl=[0.01] * 6)
    xs, ys = position_curve(run)
    assert xs == [0, 1] and ys == pytest.approx([0.2, 0.5])


def test_cli_report_of_a_run_and_of_a_non_run(tmp_path, capsys):
    run = make_run(tmp_path, kl=[0.02, 0.01, 0.0, 0.01, 0.02, 0.01], evals=())
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {run / 'report' / 'report.md'}"
    md = (run / "report" / "report.md").read_text()
    assert "held-out pass@1" not in md  # no evaluation rows, no held-out line
    assert "max 0.02 |" in md
    assert main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a run directory" in err


def test_a_failed_report_at_the_end_of_a_run_is_one_warning(tmp_path, monkeypatch, capsys):
    def broken(run_dir):
        raise RuntimeError("no fonts")
    monkeypatch.setattr(run_report, "write_run_report", broken)
    assert report_at_end(tmp_path) is None
    err = capsys.readouterr().err
    assert "warning: the run report could not be written (RuntimeError: no fonts)" in err
    assert f"jetflow report {tmp_path}" in err


def test_jetflow_train_ends_with_the_report_and_prints_its_path(tmp_path, monkeypatch, capsys):
    import jetflow.run.runner as runner
    run = make_run(tmp_path, kl=[0.0] * 6)
    monkeypatch.setattr(runner, "train", lambda cfg: run)
    assert main(["train", "--config", str(Path(__file__).parents[2] / "configs/tiny.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"run complete: {run}", f"report: {run / 'report' / 'report.md'}"]
    assert (run / "report" / "reward.png").read_bytes().startswith(PNG)


def test_jetflow_train_no_report_skips_it(tmp_path, monkeypatch, capsys):
    import jetflow.run.runner as runner
    run = make_run(tmp_path, kl=[0.0] * 6)
    monkeypatch.setattr(runner, "train", lambda cfg: run)
    assert main(["train", "--no-report", "--config", str(Path(__file__).parents[2] / "configs/tiny.yaml")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"run complete: {run}"]
    assert not (run / "report").exists()
