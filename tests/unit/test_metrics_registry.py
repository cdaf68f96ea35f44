"""The metrics registry (jetflow.metrics_registry): every key a run logs is documented there. Short tiny runs that
between them turn on most of what logs a metric (warm-up, evaluation, asynchronous rollouts, mixed precision, the
reference KL in the loss and in the reward, a custom task's reward parts, multi-turn tools, dynamic sampling, the
overlong punishment, the corrections), every correction mode's metrics, and the metric keys written as literals in
the source; every key must be documented for the phase that logs it, and every documented key must be logged by
one of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from jetflow.config import load_config
from jetflow.metrics_log import MetricsLogger, read_jsonl
from jetflow.metrics_registry import FAMILIES, METRICS, ROW_FIELDS, lookup, undocumented, undocumented_keys

REPO = Path(__file__).resolve().parents[2]
COMMON = ["run.progress=false", "run.loggers=[]", "run.num_threads=2", "run.name=r", "train.prompts_per_step=2",
          "rollout.group_size=2"]
RUNS = {  # a config and its overrides: each a few seconds on two CPU cores
    # warm-up, held-out evaluation, asynchronous rollouts (token_tis), mixed precision, the reference's KL logged,
    # a custom task with two reward functions
    "async-mixed-custom": ("examples/own_task/config.yaml",
                           ["train.sft_warmup_steps=2", "train.steps=3", "eval.num_prompts=2", "eval.every=2",
                            "rollout.max_staleness=1", "precision.mode=mixed", "algo.log_ref_kl=true"]),
    # multi-turn with a tool, the KL penalty in the reward, dynamic sampling, the overlong punishment, seq_mis
    "multiturn-kl-reward": ("examples/tool_use/config.yaml",
                            ["train.sft_warmup_steps=0", "train.steps=2", "eval.num_prompts=0",
                             "rollout.max_new_tokens=16", "rollout.max_total_tokens=64", "algo.kl_coef=0.1",
                             "algo.kl_in=reward", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_rounds=1",
                             "algo.overlong_buffer=4", "algo.correction=seq_mis"]),
    # the KL penalty in the loss, adaptive IS (pi_old recomputed), bf16
    "kl-loss-ais": ("configs/tiny.yaml",
                    ["train.sft_warmup_steps=0", "train.steps=2", "eval.num_prompts=0", "algo.kl_coef=0.1",
                     "algo.correction=ais", "precision.mode=bf16"]),
}
# the modules that write metric keys as literals, and those that read them (a reader's key must exist too)
SOURCES = ["jetflow/run/loop.py", "jetflow/train/trainer.py", "jetflow/rl", "jetflow/rollout/conversation.py",
           "jetflow/run/ray_placement.py", "jetflow/run/warmup.py", "jetflow/tasks/base.py", "jetflow/run/sequence.py",
           "jetflow/run/files.py", "jetflow/run/report.py", "jetflow/run/inflight.py"]
MESSAGE = ("metric keys that jetflow/metrics_registry.py does not document (add a Metric for each: its meaning, "
           "its phases, when it is logged)")


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict[str, list[dict]]:
    """{run: its metrics rows} of the short runs."""
    from jetflow.run.runner import train
    out, root = {}, tmp_path_factory.mktemp("metrics-registry")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the examples name their files from the repository root
        for name, (config, overrides) in RUNS.items():
            cfg = load_config(config, [*COMMON, *overrides, f"run.out_dir={root / name}"])
            out[name] = read_jsonl(train(cfg) / "metrics.jsonl")
    return out


@pytest.mark.parametrize("run", list(RUNS))
def test_every_key_a_short_run_logs_is_documented(logged, run):
    rows = logged[run]
    assert {r["phase"] for r in rows} >= {"rl"}
    missing = undocumented_keys(rows)
    assert not missing, f"{MESSAGE}: {missing}"


def _correction_keys() -> set[str]:
    from jetflow.rl.correction import CORRECTIONS, apply_correction
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 5, generator=g) * 3
    old = rollout + 0.5 * torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    return {k for mode in CORRECTIONS for k in apply_correction(mode, rollout, old, mask).metrics}


def test_every_corrections_metrics_are_documented():
    keys = _correction_keys()
    assert {"correction/seq_truncated_frac", "correction/ais_lambda", "correction/masked_frac"} <= keys
    missing = {k: why for k in keys if (why := undocumented(k, "rl"))}
    assert not missing, f"{MESSAGE}: {missing}"


def _literal_keys() -> dict[str, str]:
    """{key: where} of every string literal shaped like a metric key (family/name) in SOURCES."""
    files = [p for s in SOURCES for p in ([REPO / s] if s.endswith(".py") else sorted((REPO / s).rglob("*.py")))]
    found = {}
    for path in files:
        tree = ast.parse(path.read_text())
        # an f-string's parts are no keys of their own
        parts = {id(p) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for p in n.values}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts
                    and "/" in node.value and all(p and p.replace("_", "").replace("@", "").isalnum()
                                                  for p in node.value.split("/"))):
                found.setdefault(node.value, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_metric_key_written_in_the_source_is_documented():
    keys = _literal_keys()
    assert {"time/step", "rollout/actor_restarts_total", "moe/router_flip_frac", "loss/router_aux"} <= set(keys)
    missing = {f"{k} ({where})": "not in the registry" for k, where in keys.items() if lookup(k) is None}
    assert not missing, f"{MESSAGE}: {missing}"


def test_every_documented_metric_is_logged_somewhere(logged):
    """The registry keeps no metric that nothing logs any more: each entry is a key of the runs' rows, of a
    correction's metrics or a literal of the source (those only a GPU, MoE model or Ray run logs)."""
    seen = {k for rows in logged.values() for r in rows for k in r} | _correction_keys() | set(_literal_keys())
    matched = {lookup(k) for k in seen}
    stale = [m.key for m in METRICS if m not in matched]
    assert not stale, f"documented in jetflow/metrics_registry.py but logged by nothing: {stale}"


def test_families_and_placeholders():
    assert lookup("mismatch/kl_k3/pos_3of4").key == "mismatch/{stat}/pos_{i}of{n}"
    assert lookup("mismatch/ess/pos_0of16") is not None
    assert lookup("mismatch/unknown/pos_0of4") is None and lookup("mismatch/kl_k3/pos_xof4") is None
    assert lookup("reward/fn/exact_match").key == "reward/fn/{name}" and lookup("reward/fn/a/b") is None
    assert lookup("mismatch/kl_k3/low_prob").key == "mismatch/kl_k3/low_prob"
    assert undocumented("eval/pass@1", "eval") is None
    assert undocumented("eval/pass@1", "rl") == "documented for phase eval, logged in phase rl"
    assert undocumented("loss/sft", "sft") is None and undocumented("train/lr", "sft") is None
    assert all(m.meaning and set(m.phases) <= {"sft", "rl", "eval"} for m in METRICS)
    assert {m.family for m in METRICS} <= set(FAMILIES)  # each family has its line in the reference
    assert len({m.key for m in METRICS}) == len(METRICS)
    assert set(ROW_FIELDS) == {"step", "phase"}


def test_an_undocumented_key_is_logged_with_one_warning_and_fails_the_check(tmp_path, capsys):
    logger = MetricsLogger(tmp_path)
    for step in range(3):
        logger.log(step, {"reward/mean": 0.5, "my/new_metric": 1.0, "eval/pass@1": 0.25})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("warning: metric 'my/new_metric' (rl row): not in the registry; it is logged all the same") == 1
    assert err.count("metric 'eval/pass@1' (rl row): documented for phase eval, logged in phase rl") == 1
    assert "reward/mean" not in err
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["my/new_metric"] for r in rows] == [1.0, 1.0, 1.0]  # the run loses nothing
    assert undocumented_keys(rows) == {"my/new_metric": "not in the registry",
                                       "eval/pass@1": "documented for phase eval, logged in phase rl"}
