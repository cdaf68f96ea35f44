"""jetflow.ablate.length_study on hand-made run directories: collapse steps, per-arm means and seed
spreads, paired differences with their SE and sign counts, all computed by hand below."""

import json
from pathlib import Path

import pytest

from jetflow.ablate.grid import load_ablation
from jetflow.ablate.length_study import (TABLES_BEGIN, TABLES_END, cell_result, collapse_step, collapsed_at_end,
                                         gather, mismatch_table, pair_table, paired, write_tables)

ROOT = Path(__file__).resolve().parents[2]

# (length, arm, seed) -> held-out pass@1 at steps 0, 10, 20; None: the cell is partial (no COMPLETE)
EVALS = {
    ("lenA", "bf16", 0): [0.8, 0.6, 0.9],   # no collapse (0.6 >= 0.4)
    ("lenA", "bf16", 1): [0.8, 0.3, 0.5],   # collapse at 10 (0.3 < 0.8 / 2)
    ("lenA", "bf16", 2): [0.6, 0.7, 0.7],
    ("lenA", "mixed", 0): [0.8, 0.2, 0.5],  # collapse at 10
    ("lenA", "mixed", 1): [0.8, 0.7, 0.6],
    ("lenA", "mixed", 2): [0.6, 0.5, 0.4],
    ("lenB", "bf16", 0): [0.2, 0.2, 0.2],
    ("lenB", "bf16", 1): [0.0, 0.0, 0.1],   # best 0 before step 20: no collapse
    ("lenB", "mixed", 0): [0.2, 0.1, 0.2],  # 0.1 is half the best, not below it: no collapse
    ("lenB", "mixed", 1): None,
}


def _ablation(tmp_path: Path):
    spec = {"name": "t", "base_config": str(ROOT / "configs/tiny.yaml"), "out_dir": str(tmp_path / "out"),
            "grid": {"run.seed": [0, 1, 2],
                     "length": [{"id": "lenA", "task.params.num_operands": 3},
                                {"id": "lenB", "task.params.num_operands": 4}],
                     "precision.mode": ["bf16", "mixed"]},
            "compare": [["mixed", "bf16"]]}
    (tmp_path / "ab.yaml").write_text(json.dumps(spec))
    ab = load_ablation(tmp_path / "ab.yaml")
    for (length, arm, seed), evals in EVALS.items():
        run = ab.out_dir / "runs" / f"seed{seed}-{length}-{arm}"
        run.mkdir(parents=True)
        rows = [{"step": s, "phase": "rl", "policy/entropy": float(s + 1), "response/length_mean": 10.0 * (s + 1),
                 "mismatch/kl_k3": (0.001 * (s + 1) * (seed + 1)) if arm == "mixed" else 0.0} for s in range(4)]
        rows += [{"step": 10 * i, "phase": "eval", "eval/pass@1": v} for i, v in enumerate(evals or [0.5])]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if evals is not None:
            (run / "COMPLETE").write_text("")
    return ab


def test_collapse_step():
    assert collapse_step([(0, 0.8), (10, 0.6), (20, 0.9)]) is None
    assert collapse_step([(0, 0.8), (10, 0.3), (20, 0.5)]) == 10
    assert collapse_step([(0, 0.2), (10, 0.9), (20, 0.44)]) == 20  # half of the best so far (0.9), not the first
    assert collapse_step([(0, 0.0), (10, 0.0)]) is None
    assert collapse_step([(0, 1.0), (10, 0.5)]) is None
    assert collapse_step([(0, 1.0), (10, 0.49)]) == 10


def test_collapsed_at_end_tells_a_lasting_collapse_from_a_dip_that_recovers():
    assert collapsed_at_end([(0, 0.72), (20, 0.18), (40, 0.0)])       # mixed-none at len256, seed 1
    assert not collapsed_at_end([(0, 0.72), (20, 0.32), (40, 0.66)])  # a dip like unified's at len256 (seed 1), recovered
    assert collapsed_at_end([(0, 0.2), (10, 0.9), (20, 0.44)])        # below half the best before it (0.9)
    assert not collapsed_at_end([(0, 1.0), (10, 0.5)])                # half is not below half
    assert not collapsed_at_end([(0, 0.0), (10, 0.0)]) and not collapsed_at_end([(0, 0.5)])


def test_cell_result_and_partial_cells(tmp_path):
    ab = _ablation(tmp_path)
    r = cell_result(ab.out_dir / "runs/seed1-lenA-bf16")
    assert (r.final, r.best, r.collapse_step, r.collapsed_at_end) == (0.5, 0.8, 10, False)  # 0.5 >= 0.8 / 2
    assert r.late == pytest.approx(1.6 / 3)  # the mean of its 3 evaluations, 0.8, 0.3, 0.5
    assert (r.entropy_start, r.entropy_end) == (2.0, 3.0)  # mean of 1, 2, 3 and of 2, 3, 4
    assert (r.length_start, r.length_end) == (20.0, 30.0)
    assert cell_result(ab.out_dir / "runs/seed1-lenB-mixed") is None  # partial
    results = gather(ab)
    assert sorted(results[("lenB", "mixed")]) == [(0, 0)]  # (run.seed, RL draw)
    assert sorted(results[("lenA", "bf16")]) == [(0, 0), (1, 1), (2, 2)]


def test_paired_by_hand():
    d = paired({0: 0.5, 1: 0.6, 2: 0.4, 3: 0.9}, {0: 0.9, 1: 0.5, 2: 0.7})  # seed 3 has no partner
    # differences -0.4, +0.1, -0.3: mean -0.2, sample sd sqrt(0.14 / 2), SE = sd / sqrt(3)
    assert d["n"] == 3 and d["mean"] == pytest.approx(-0.2)
    assert d["se"] == pytest.approx((0.07 ** 0.5) / 3 ** 0.5)
    assert (d["above"], d["below"], d["equal"]) == (1, 2, 0)


def test_tables_by_hand(tmp_path):
    ab = _ablation(tmp_path)
    rows = pair_table(gather(ab), ab.compare)
    assert rows == [
        # late (the mean of the 3 evaluations, fewer than LATE): bf16 0.767, 0.533, 0.667, mixed 0.5, 0.7, 0.5
        # -> differences -0.267, +0.167, -0.167: mean -0.089, sd 0.227, SE 0.131
        {"length": "lenA", "a - b": "mixed - bf16", "seeds": 3, "paired difference ± SE": "-0.200 ± 0.153",
         "seeds a > b / a < b / equal": "1 / 2 / 0", "last 5 evaluations: difference ± SE": "-0.089 ± 0.131",
         "last 5: a > b / a < b / equal": "1 / 2 / 0"},
        # lenB: seed 1 of mixed is partial, so one pair (0.2 - 0.2), no SE; late 0.167 - 0.2
        {"length": "lenB", "a - b": "mixed - bf16", "seeds": 1, "paired difference ± SE": "+0.000",
         "seeds a > b / a < b / equal": "0 / 0 / 1", "last 5 evaluations: difference ± SE": "-0.033",
         "last 5: a > b / a < b / equal": "0 / 1 / 0"},
    ]
    readme = ab.out_dir / "README.md"
    readme.write_text("# Study\n\nProse before.\n\n" + TABLES_BEGIN + "\nold\n" + TABLES_END + "\n\nProse after.\n")
    write_tables(ab, readme)
    text = write_tables(ab, readme).read_text()  # twice: the section is replaced, not appended
    assert text.startswith("# Study\n\nProse before.\n\n") and text.endswith("\n\nProse after.\n")
    assert text.count(TABLES_BEGIN) == 1 and "old" not in text
    assert (ab.out_dir / "accuracy_vs_length.png").read_bytes().startswith(b"\x89PNG")
    assert "![final held-out pass@1 by length](accuracy_vs_length.png)" in text
    # bf16 at lenA: finals 0.9, 0.5, 0.7 -> mean 0.7, sd 0.2; bests 0.9, 0.8, 0.7 -> 0.8; collapsed
    # seed 1 at step 10 and climbed back (0.5 >= 0.8 / 2); entropy 2 -> 3, response length 20 -> 30 on every seed
    assert "| lenA | bf16 | 3 | 0.700 ± 0.200 | 0.50 .. 0.90 | 0.800 | 1 of 3 | 10 | 0 of 3 | 2 -> 3 | 20 -> 30 |" in text
    # mixed at lenA: finals 0.5, 0.6, 0.4 -> mean 0.5, sd 0.1; best 0.8, 0.8, 0.6
    assert "| lenA | mixed | 3 | 0.500 ± 0.100 | 0.40 .. 0.60 | 0.733 | 1 of 3 | 10 |" in text
    # lenB bf16: finals 0.2, 0.1 -> mean 0.15, sd sqrt(0.005) = 0.0707; no collapse
    assert "| lenB | bf16 | 2 | 0.150 ± 0.071 | 0.10 .. 0.20 | 0.150 | 0 of 2 |  |" in text
    assert "| lenB | mixed | 1 | 0.200 | 0.20 .. 0.20 | 0.200 | 0 of 1 |  |" in text


def test_mismatch_by_hand(tmp_path):
    ab = _ablation(tmp_path)
    results = gather(ab)
    # seed s of mixed logs k3 = 0.001 (step + 1) (s + 1) at steps 0-3: mean 0.0025 (s + 1)
    assert results[("lenA", "mixed")][(2, 2)].mismatch_kl == pytest.approx(0.0075)
    rows = {(r["length"], r["arm"]): r for r in mismatch_table(results)}
    # lenA mixed, seeds 0-2: 0.0025, 0.005, 0.0075 -> 0.005 per token; every run's response length is
    # (mean of 10, 20, 30 and of 20, 30, 40) / 2 = 25 tokens -> 0.125 per response
    assert rows[("lenA", "mixed")] == {"length": "lenA", "arm": "mixed", "seeds": 3, "KL per token": "5.00e-03",
                                       "response tokens": "25.0", "KL per response": "0.125"}
    assert rows[("lenA", "bf16")]["KL per response"] == "0.000"
    assert rows[("lenB", "mixed")]["seeds"] == 1  # the partial cell is left out
    write_tables(ab, ab.out_dir / "README.md")
    assert (ab.out_dir / "gap_vs_length.png").read_bytes().startswith(b"\x89PNG")  # lenA's pair has 3 seeds


def test_the_grid_config(tmp_path):
    """configs/ablations/learning-length.yaml: 10 seeds x 4 settings (3 lengths and len256 at lr 3e-5) x 5 arms
    and two NVFP4 arms at seed 1, len256; the lr 3e-5 row and the NVFP4 arms start RL from the seed's len256
    warm-up; the lengths it names (the reference answers' characters, one token each, plus the newline), and
    room for them."""
    from jetflow.ablate.grid import cell_config, place_cells
    from jetflow.tasks.base import make_task

    ab = load_ablation(ROOT / "configs/ablations/learning-length.yaml", out_dir=tmp_path)
    placed = place_cells(ab)
    assert len(ab.cells) == 10 * 4 * 5 + 2
    assert list(dict.fromkeys(p.panel for p in placed)) == ["len16", "len64", "len256", "len256-lr3e-5"]
    assert list(dict.fromkeys(p.line for p in placed)) == ["bf16", "mixed-none", "mixed-token_tis", "mixed-ais", "unified",
                                                           "mixed-none-nvfp4", "unified-nvfp4"]
    groups = ab.warmup_groups()
    for nvfp4 in ("mixed-none-nvfp4-len256-seed1", "unified-nvfp4-len256-seed1"):
        assert groups[nvfp4] == groups["seed1-len256-unified"] == "seed1-len256-bf16"
        cfg = cell_config(ab, next(c for c in ab.cells if c.id == nvfp4))
        assert (cfg.precision.family, cfg.task.params["num_operands"], cfg.train.sft_warmup_steps) == ("nvfp4", 70, 3000)
    for arm in ("bf16", "mixed-none", "unified"):
        assert groups[f"seed2-len256-lr3e-5-{arm}"] == "seed2-len256-bf16"
        lrs = {cell_config(ab, next(c for c in ab.cells if c.id == f"seed2-{row}-{arm}")).train.lr
               for row in ("len256", "len256-lr3e-5")}
        assert lrs == {1e-4, 3e-5}
    for cell, target in (("seed0-len16-bf16", 16), ("seed0-len64-mixed-ais", 64), ("seed0-len256-unified", 256)):
        cfg = cell_config(ab, next(c for c in ab.cells if c.id == cell))
        task = make_task(cfg.task.name, **cfg.task.params)
        problems = [task._problem(i, 0) for i in range(1000)]
        lengths = [len(p.answer) + 1 for p in problems]
        assert 0.8 * target <= sum(lengths) / len(lengths) <= 1.2 * target, (cell, lengths)
        assert max(lengths) <= cfg.rollout.max_new_tokens
        assert max(len(p.prompt) for p in problems) + cfg.rollout.max_new_tokens <= cfg.model.tiny.max_position


def test_the_draws_config_is_the_grids_seed_1_at_len256_with_rl_draws(tmp_path):
    """configs/ablations/learning-length-draws.yaml: 8 RL draws x 2 learning rates x 5 arms from one warm-up, each
    cell the grid's seed 1 cell of its arm and row (len256, len256-lr3e-5) but for the RL draw (run.rl_seed)."""
    from jetflow.ablate.grid import cell_config, place_cells
    from jetflow.config import to_dict

    draws = load_ablation(ROOT / "configs/ablations/learning-length-draws.yaml", out_dir=tmp_path / "d")
    grid = load_ablation(ROOT / "configs/ablations/learning-length.yaml", out_dir=tmp_path / "g")
    assert len(draws.cells) == 8 * 2 * 5 and set(draws.warmup_groups().values()) == {"draw1-lr1e-4-bf16"}
    assert {p.panel for p in place_cells(draws)} == {"lr1e-4", "lr3e-5"}  # the draws are pooled, not panels

    def settings(ab, cell_id: str) -> dict:
        cfg = to_dict(cell_config(ab, next(c for c in ab.cells if c.id == cell_id)))
        cfg["run"] = {k: v for k, v in cfg["run"].items() if k not in ("name", "out_dir", "rl_seed")}
        return cfg

    for arm in ("bf16", "mixed-none", "mixed-token_tis", "mixed-ais", "unified"):
        assert settings(draws, f"draw12-lr1e-4-{arm}") == settings(grid, f"seed1-len256-{arm}")
        assert settings(draws, f"draw12-lr3e-5-{arm}") == settings(grid, f"seed1-len256-lr3e-5-{arm}")
    assert cell_config(draws, draws.cells[10]).run.rl_seed == 11
