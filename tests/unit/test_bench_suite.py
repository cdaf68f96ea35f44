"""The benchmark suite on the tiny model: train-step, sync, rl-step (jetflow half; TRL skipped with a
reason when it cannot run), the suite index and the command line. Small sizes: seconds each."""

import json
import math
import sys

import pytest

from jetflow.bench import rl_step, suite, train_step, trl_grpo
from jetflow.bench.workload import bench_config, response_lengths

RESULT_KEYS = {"command", "environment", "workload", "rows", "headline", "loadavg_1m"}


def read_json(path):
    return json.loads(path.read_text())


def test_train_step_bench_writes_modes_and_ratios(tmp_path):
    train_step.run("tiny", batch=2, prompt_len=8, response_len=8, reps=1, out_dir=str(tmp_path))
    result = read_json(tmp_path / "train-step-cpu.json")
    assert RESULT_KEYS <= set(result) and (tmp_path / "train-step-cpu.md").is_file()
    assert {"torch", "cpu_count", "device"} <= set(result["environment"])
    assert {"before", "after"} <= set(result["loadavg_1m"])
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["fp32", "bf16", "unified"]
    assert [rows[m]["trainer_linear"] for m in rows] == ["fp32", "bf16", "fp8"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and math.isfinite(r["loss"])
        assert r["skipped_steps"] == 0
    assert rows["fp32"]["vs_fp32"] == 1.0
    expected = {"bf16_over_fp32", "unified_over_fp32", "unified_over_bf16", "unified_over_fp32_cpu"}
    assert expected <= set(result["ratios"])
    assert result["headline"]["value"] == pytest.approx(result["ratios"]["unified_over_fp32"])
    assert result["workload"]["tokens_per_step"] == 2 * 16


def test_train_step_bench_packs_through_the_cli(tmp_path):
    """--max-tokens-per-micro-batch reaches the trainer: 8 long-tail rows of 4 + (16 | 2) tokens, each taking
    128 columns on packing's grid (exact numerics), in rows of at most 256: two a row, 4 micro-batches; the
    peak RSS stands beside tokens/s."""
    from jetflow.cli import main
    assert main(["bench", "train-step", "--model", "tiny", "--modes", "fp32", "--batch", "8", "--prompt-len", "4",
                 "--response-len", "16", "--lengths", "longtail", "--reps", "1", "--warmup", "0",
                 "--max-tokens-per-micro-batch", "256", "--out-dir", str(tmp_path)]) == 0
    result = read_json(tmp_path / "train-step-cpu.json")
    workload, (row,) = result["workload"], result["rows"]
    assert workload["max_tokens_per_micro_batch"] == 256 and workload["micro_batches"] == 4
    assert workload["tokens_per_step"] == 20 + 7 * 6 and row["peak_rss_gb"] > 0 and math.isfinite(row["loss"])
    assert "peak_rss_gb" in (tmp_path / "train-step-cpu.md").read_text()


def test_train_step_sweep_runs_each_configuration_in_its_own_process(tmp_path):
    """The long-response sweep: one mode per fresh process, long-tail lengths (8 rows: one at the max,
    seven at max / 8), the memory savers' overrides reaching the trainer, peak RSS reported."""
    from jetflow.bench import train_step_sweep
    assert response_lengths(8, 64, "longtail") == [64] + [8] * 7 and response_lengths(2, 5) == [5, 5]
    train_step_sweep.main(["--model", "tiny", "--batch", "8", "--prompt-len", "4", "--response-lens", "16",
                           "--lengths", "longtail", "--chunk", "16", "--out-dir", str(tmp_path)])
    rows = read_json(tmp_path / "sweep.json")["rows"]
    assert [r["setting"] for r in rows] == ["before", "after"] and all("error" not in r for r in rows)
    assert all(r["tokens"] == 8 * 4 + 16 + 7 * 2 and r["peak_rss_gb"] > 0 for r in rows)
    after = read_json(tmp_path / "runs" / "after-b8-r16-longtail.json")["workload"]
    assert after["logprob_chunk_tokens"] == 16 and after["activation_checkpointing"] is True
    assert rows[0]["loss"] == rows[1]["loss"]  # the same step, bit for bit (exact numerics)


def test_sync_bench_through_the_cli_bytes_add_up(tmp_path):
    from jetflow.cli import main
    assert main(["bench", "sync", "--model", "tiny", "--reps", "1", "--out-dir", str(tmp_path)]) == 0
    result = read_json(tmp_path / "sync-cpu.json")
    assert RESULT_KEYS <= set(result) and result["command"]  # the process's command line (here: pytest's)
    rows = {r["mode"]: r for r in result["rows"]}
    for r in rows.values():
        assert r["fp8_data_bytes"] + r["scale_bytes"] + r["other_bytes"] == r["total_bytes"]
        assert sum(r["other_bytes_by_dtype"].values()) == r["other_bytes"]
        assert r["total_s"] >= r["build_s"] > 0
    assert rows["unified"]["total_bytes"] < rows["bf16"]["total_bytes"] < rows["fp32"]["total_bytes"]
    assert rows["bf16"]["total_bytes"] == rows["mixed"]["total_bytes"]
    assert rows["unified"]["fp8_data_bytes"] > 0 and rows["unified"]["scale_bytes"] > 0
    # bf16 ships its matrices in bf16 and its norm vectors as the trainer holds them (fp32)
    bf16_bytes = rows["bf16"]["other_bytes_by_dtype"]
    assert rows["bf16"]["fp8_data_bytes"] == 0 and set(bf16_bytes) == {"bfloat16", "float32"}
    assert bf16_bytes["bfloat16"] > 50 * bf16_bytes["float32"]
    assert result["headline"]["value"] == pytest.approx(
        rows["unified"]["total_bytes"] / rows["bf16"]["total_bytes"])


def test_rl_step_runs_jetflow_and_skips_trl_when_missing(tmp_path, monkeypatch):
    """A model TRL could load, but TRL not importable: jetflow's steps still run, the note says why."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    monkeypatch.setattr(rl_step, "hf_model_dir", lambda cfg: tmp_path)
    rl_step.run("tiny", prompts=2, group_size=2, max_new_tokens=4, reps=1, out_dir=str(tmp_path))
    result = read_json(tmp_path / "rl-step-cpu.json")
    assert RESULT_KEYS <= set(result) and (tmp_path / "rl-step-cpu.md").is_file()
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"jetflow fp32", "jetflow unified"}
    for r in rows.values():
        assert r["seconds_per_step"] > 0 and r["rollout_s"] > 0 and r["train_s"] > 0
        assert len(r["seconds_all"]) == 2  # warm-up + 1 measured
    assert any("TRL skipped" in n and trl_grpo.INSTALL_HINT in n for n in result["notes"])
    assert result["headline"]["value"] is None


def test_trl_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match=r"pip install -e \.\[bench\]"):
        trl_grpo.import_trl()


def test_tiny_has_no_directory_for_trl():
    assert rl_step.hf_model_dir(bench_config("tiny")) is None


def test_suite_index_lists_each_bench_and_keeps_going_after_a_failure(tmp_path):
    options = {"train-step": {"batch": 2, "prompt_len": 8, "response_len": 8, "reps": 1}, "sync": {"reps": 1}}
    result = suite.run("tiny", benches=("rollout", "train-step", "sync"), out_dir=str(tmp_path), options=options)
    assert result["failed"] == ["rollout"]  # rollout needs a HF directory: recorded, the rest still ran
    index = (tmp_path / "suite.md").read_text()
    assert "[train-step-cpu.md](train-step-cpu.md)" in index and "[sync-cpu.md](sync-cpu.md)" in index
    rows = {r["bench"]: r for r in read_json(tmp_path / "suite.json")["rows"]}
    assert rows["sync"]["value"] < 1 and rows["train-step"]["value"] > 0
    assert "error" in rows["rollout"]
