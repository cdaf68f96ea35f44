"""`jetflow ablate`: grid expansion, up-front validation, cell selection and the dry run (no training)."""

from pathlib import Path

import pytest
import yaml

from jetflow.ablate import expand_grid, format_value, load_ablation, resolve_cells, run_ablation, select
from jetflow.cli import main
from jetflow.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, spec: dict, name="abl.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_cross_product_in_axis_order_with_readable_ids():
    cells = expand_grid({"precision.mode": ["bf16", "unified"], "rollout.max_new_tokens": [8, 64], "run.seed": [0, 1]})
    assert [c.id for c in cells][:4] == ["bf16-len8-seed0", "bf16-len8-seed1", "bf16-len64-seed0", "bf16-len64-seed1"]
    assert len(cells) == 8
    assert cells[-1].overrides == ["precision.mode=unified", "rollout.max_new_tokens=64", "run.seed=1"]


def test_conditional_axis_only_multiplies_matching_cells():
    grid = {"precision.mode": ["bf16", "mixed", "unified"],
            "algo.correction": {"values": ["none", "token_tis", "token_mis", "ais"], "only_when": {"precision.mode": "mixed"}},
            "run.seed": [0, 1]}
    ids = [c.id for c in expand_grid(grid)]
    assert len(ids) == (1 + 4 + 1) * 2
    assert "bf16-seed0" in ids and "unified-seed1" in ids and "mixed-seed0" not in ids
    assert {i for i in ids if i.startswith("mixed")} == {
        f"mixed-{c}-seed{s}" for c in ("none", "token_tis", "token_mis", "ais") for s in (0, 1)}
    bf16 = next(c for c in expand_grid(grid) if c.id == "bf16-seed0")
    assert "algo.correction" not in bf16.settings  # the base value (auto) stays


def test_linked_axis_labels_and_extra_cells():
    grid = {"precision.mode": ["mixed"],
            "length": [{"id": "short", "rollout.max_new_tokens": 8},
                       {"rollout.max_new_tokens": 64, "task.params.show_work": True}],
            "train.lr": {"values": [0.001], "label": "lr{}"}}
    cells = expand_grid(grid, extra=[{"id": "one-off", "precision.mode": "bf16"}, {"run.seed": 3}])
    assert [c.id for c in cells] == ["mixed-short-lr0.001", "mixed-len64-show_worktrue-lr0.001", "one-off", "seed3"]
    assert cells[1].overrides == ["precision.mode=mixed", "rollout.max_new_tokens=64", "task.params.show_work=true",
                                  "train.lr=0.001"]


def test_grid_errors():
    with pytest.raises(ConfigError, match="not unique"):
        expand_grid({"length": [{"id": "a", "run.seed": 0}, {"id": "a", "run.seed": 1}]})
    with pytest.raises(ConfigError, match="earlier axis"):
        expand_grid({"algo.correction": {"values": ["none"], "only_when": {"precision.mode": "mixed"}}})
    with pytest.raises(ConfigError, match="non-empty list"):
        expand_grid({"run.seed": []})
    with pytest.raises(ConfigError, match="no cells"):
        expand_grid({})


def test_format_value_round_trips_through_yaml():
    for v in (True, None, 3, 0.5, 1e-05, 2e20, "mixed", "none", [128, 128], {"C": 2.0}, "yes", "1e-3"):
        assert yaml.safe_load(format_value(v)) == v


def test_bad_key_fails_up_front_naming_the_cell(tmp_path):
    path = write(tmp_path, {"name": "bad", "base_config": str(ROOT / "configs/tiny.yaml"),
                            "grid": {"precision.mode": ["bf16", "mixed"],
                                     "algo.correction": {"values": ["none", "tiss"],
                                                         "only_when": {"precision.mode": "mixed"}}}})
    with pytest.raises(ConfigError, match=r"cell 'mixed-tiss'.*algo.correction='tiss'"):
        run_ablation(path, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written

    path = write(tmp_path, {"name": "typo", "grid": {"rollout.max_new_token": [8]}})
    with pytest.raises(ConfigError, match=r"cell 'max_new_token8'.*max_new_token"):
        run_ablation(path, out_dir=tmp_path / "out", dry_run=True)

    # task parameters are only checked when the task is built: validation builds it
    path = write(tmp_path, {"name": "task", "base_config": str(ROOT / "configs/tiny.yaml"),
                            "grid": {"task.params.num_operands": [2, 1]}})
    with pytest.raises(ConfigError, match=r"cell 'num_operands1'.*num_operands"):
        run_ablation(path, out_dir=tmp_path / "out", dry_run=True)


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown keys.*grids"):
        load_ablation(write(tmp_path, {"name": "x", "grids": {}}))


def test_dry_run_lists_cells_and_their_overrides(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", str(ROOT / "configs/ablations/precision.yaml"), "--out-dir", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    ab = load_ablation(ROOT / "configs/ablations/precision.yaml", out)
    assert f"{len(ab.cells)} of {len(ab.cells)} cells" in text
    for cell in ab.cells:
        assert cell.id in text and " ".join(cell.overrides) in text
    assert "mixed-ais-len256-seed1" in text and "[pending]" in text
    assert not out.exists()

    assert main(["ablate", str(ROOT / "configs/ablations/precision.yaml"), "--out-dir", str(out), "--dry-run",
                 "--only", "unified-*-seed0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in lines] == ["unified-len8-seed0", "unified-len64-seed0", "unified-len256-seed0"]


def test_only_rejects_patterns_that_match_nothing():
    cells = expand_grid({"precision.mode": ["bf16", "mixed"]})
    assert [c.id for c in select(cells, ["mix*"])] == ["mixed"]
    with pytest.raises(ConfigError, match="matches no cell"):
        select(cells, ["unified"])


def test_a_run_dir_made_with_another_config_is_refused(tmp_path):
    from jetflow.config import config_text
    path = write(tmp_path, {"name": "x", "base_config": str(ROOT / "configs/tiny.yaml"),
                            "grid": {"precision.mode": ["bf16"]}})
    ab = load_ablation(path, tmp_path / "out")
    (cfg,) = resolve_cells(ab, ab.cells).values()
    run_dir = ab.run_dir(ab.cells[0])
    run_dir.mkdir(parents=True)
    cfg.run.progress = False  # session settings may differ
    (run_dir / "config.yaml").write_text(config_text(cfg))
    resolve_cells(ab, ab.cells)
    cfg.train.lr = 1.0
    (run_dir / "config.yaml").write_text(config_text(cfg))
    with pytest.raises(ConfigError, match=r"cell 'bf16'.*started with another config \(train.lr differ"):
        resolve_cells(ab, ab.cells)


def test_a_failing_cell_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """train() is faked: `bf16` writes two metric rows and finishes, `mixed` raises."""
    import json

    import jetflow.run.runner as runner
    from jetflow.run.files import COMPLETE

    def fake_train(cfg):
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.precision.mode == "mixed":
            raise RuntimeError("boom")
        rows = [{"step": s, "phase": "rl", "reward/mean": 0.5 * s, "mismatch/kl_k3": 0.0, "time/rollout": 1.0,
                 "policy/entropy": 2.0 - 0.5 * s}
                for s in range(2)]
        rows += [{"step": s, "phase": "eval", "eval/pass@1": p} for s, p in ((0, 0.25), (2, 0.5))]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / COMPLETE).write_text("done\n")
        return run_dir

    monkeypatch.setattr(runner, "train", fake_train)
    path = write(tmp_path, {"name": "f", "base_config": str(ROOT / "configs/tiny.yaml"),
                            "grid": {"precision.mode": ["mixed", "bf16"]}})
    out = tmp_path / "out"
    logs = []
    assert run_ablation(path, out_dir=out, command="test", log=logs.append) == 1
    assert "boom" in (out / "runs" / "mixed" / "error.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["cell"]: r for r in summary["cells"]}
    assert rows["mixed"]["status"] == "failed" and "boom" in rows["mixed"]["error"]
    assert rows["bf16"]["status"] == "complete" and rows["bf16"]["reward_best"] == 0.5
    assert rows["bf16"]["kl_k3_max"] == 0.0 and rows["bf16"]["time_train"] is None
    # the first and last 3 steps of two: both mean (2.0 + 1.5) / 2
    assert rows["bf16"]["entropy_first"] == rows["bf16"]["entropy_final"] == 1.75
    assert rows["bf16"]["rollout_log_ppl_final"] is None  # not logged by the fake: an empty cell, no crash
    assert (rows["bf16"]["heldout_pass1_start"], rows["bf16"]["heldout_pass1_end"]) == (0.25, 0.5)
    assert (out / "entropy.png").read_bytes().startswith(b"\x89PNG")
    md = (out / "summary.md").read_text()
    assert "| mixed | failed |" in md and "RuntimeError: boom" in md
    assert "| all cells | bf16 | 1 | 0.25 |  | 0.25 -> 0.5 | 0 |" in md  # variants table: mean of rewards 0, 0.5
    assert (out / "heldout.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "mismatch_kl.png").read_bytes().startswith(b"\x89PNG")  # all-zero KL: "no data yet", still a PNG
    assert (out / ".gitignore").read_text().split() == ["runs/*/checkpoints/", "metrics.jsonl"]  # derived: kept once

    # the rerun retries only the failed cell
    logs.clear()
    assert run_ablation(path, out_dir=out, command="test", log=logs.append) == 1
    assert any("bf16: complete, skipped" in line for line in logs) and any("mixed: resuming" in line for line in logs)


def test_figures_draw_one_panel_per_length_one_line_per_variant_seeds_pooled(tmp_path):
    from jetflow.ablate.figures import _styles
    from jetflow.ablate.grid import place_cells
    from jetflow.plots import MODE_COLORS

    ab = load_ablation(ROOT / "configs/ablations/precision.yaml", out_dir=tmp_path)
    placed = place_cells(ab)
    assert list(dict.fromkeys(p.panel for p in placed)) == ["len8", "len64", "len256"]
    lines = ["bf16", "mixed-none", "mixed-token_tis", "mixed-token_mis", "mixed-ais", "unified"]
    assert list(dict.fromkeys(p.line for p in placed)) == lines
    for panel in ("len8", "len64", "len256"):  # two seeds pooled in every (panel, line)
        for line in lines:
            assert sorted(p.cell.settings["run.seed"] for p in placed if (p.panel, p.line) == (panel, line)) == [0, 1]
    styles = _styles(placed)
    assert styles["bf16"][0] == MODE_COLORS["bf16"] and styles["unified"][0] == MODE_COLORS["unified"]
    mixed = [styles[line] for line in lines if line.startswith("mixed")]
    assert {c for c, _ in mixed} == {MODE_COLORS["mixed"]} and len({s for _, s in mixed}) == 4


def test_extra_cells_make_one_line_across_panels(tmp_path):
    """precision-moe.yaml's extra cells (mixed with routing replay, per length and seed) are one
    variant: one line name in every length panel, seeds pooled, mixed's colour in its own style."""
    from jetflow.ablate.figures import _styles
    from jetflow.ablate.grid import place_cells
    from jetflow.plots import MODE_COLORS

    placed = [p for p in place_cells(load_ablation(ROOT / "configs/ablations/precision-moe.yaml", out_dir=tmp_path))
              if p.cell.id.startswith("mixed-replay")]
    assert {(p.panel, p.line) for p in placed} == {("len8", "mixed-replay"), ("len64", "mixed-replay")}
    assert sorted(p.cell.settings["run.seed"] for p in placed if p.panel == "len64") == [0, 1]
    color, style = _styles(place_cells(load_ablation(ROOT / "configs/ablations/precision-moe.yaml",
                                                    out_dir=tmp_path)))["mixed-replay"]
    assert color == MODE_COLORS["mixed"] and style != "-"


def test_seed_pooling_and_smoothing_by_hand():
    from jetflow.ablate.figures import pooled
    from jetflow.plots import smooth

    # step 1 exists in one seed only: its mean, min and max are that seed's value
    assert pooled([{0: 1.0, 1: 2.0}, {0: 3.0}]) == ([0, 1], [2.0, 2.0], [1.0, 2.0], [3.0, 2.0])
    # debiased EMA, weight 0.5: 1; (0.25 + 1.5) / 0.75; a missing point stays missing
    assert smooth([1.0, None, 3.0], weight=0.5) == pytest.approx([1.0, None, 1.75 / 0.75])


def test_difference_of_means_and_its_standard_errors_by_hand():
    from jetflow.ablate.report import difference, seed_stats

    st = seed_stats([0.2, 0.4, 0.6])
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.4) and st["sd"] == pytest.approx(0.2)
    assert (st["min"], st["max"]) == (0.2, 0.6)
    assert seed_stats([0.5])["sd"] is None and seed_stats([])["mean"] is None
    # a: 0.2, 0.4, 0.6 (mean 0.4, s 0.2); b: 0.1, 0.1, 0.4, 0.6 (mean 0.3, s^2 = 0.18 / 3 = 0.06)
    d = difference({0: 0.2, 1: 0.4, 2: 0.6}, {0: 0.1, 1: 0.1, 2: 0.4, 3: 0.6})
    assert d["diff"] == pytest.approx(0.1)
    assert d["se"] == pytest.approx((0.04 / 3 + 0.06 / 4) ** 0.5)  # 0.1683
    # paired over seeds 0, 1, 2: differences 0.1, 0.3, 0.2 -> mean 0.2, s 0.1, SE 0.1 / sqrt(3)
    assert d["paired_n"] == 3 and d["paired_diff"] == pytest.approx(0.2)
    assert d["paired_se"] == pytest.approx(0.1 / 3 ** 0.5)
    one = difference({0: 0.5}, {1: 0.25})  # one seed each, none shared: a difference, no SE, no pairs
    assert one["diff"] == 0.25 and one["se"] is None and one["paired_n"] == 0 and one["paired_diff"] is None


def test_a_cell_is_drawn_under_the_most_specific_value_of_a_linked_axis(tmp_path):
    """len-lr's settings contain len's: its cells are drawn in their own panel, not in len's (the first that
    agrees), whichever order the values come in."""
    from jetflow.ablate.grid import place_cells

    for rows in (["long", "long-lr"], ["long-lr", "long"]):
        values = {"long": {"id": "long", "rollout.max_new_tokens": 64},
                  "long-lr": {"id": "long-lr", "rollout.max_new_tokens": 64, "train.lr": 3.0e-5}}
        grid = {"setting": [values[r] for r in rows], "precision.mode": ["bf16", "mixed"], "run.seed": [0]}
        placed = place_cells(load_ablation(write(tmp_path, {"name": "c", "grid": grid})))
        assert {p.cell.id: p.panel for p in placed} == {"long-bf16-seed0": "long", "long-mixed-seed0": "long",
                                                       "long-lr-bf16-seed0": "long-lr", "long-lr-mixed-seed0": "long-lr"}


def test_compare_pairs_are_checked_against_the_variants(tmp_path):
    grid = {"precision.mode": ["bf16", "mixed"],
            "precision.family": {"values": [{"id": "fp8", "precision.family": "fp8_block"},
                                            {"id": "nvfp4", "precision.family": "nvfp4"}],
                                 "only_when": {"precision.mode": "mixed"}},
            "run.seed": [0, 1]}
    ok = load_ablation(write(tmp_path, {"name": "c", "grid": grid, "compare": [["mixed-nvfp4", "bf16"]]}))
    assert ok.compare == [("mixed-nvfp4", "bf16")]
    from jetflow.ablate.grid import place_cells
    assert list(dict.fromkeys(p.line for p in place_cells(ok))) == ["bf16", "mixed-fp8", "mixed-nvfp4"]  # family: a line axis
    with pytest.raises(ConfigError, match=r"not variants of this ablation; variants: \['bf16', 'mixed-fp8'"):
        load_ablation(write(tmp_path, {"name": "c", "grid": grid, "compare": [["mixed", "bf16"]]}))
    with pytest.raises(ConfigError, match="not a \\[variant, variant\\] pair"):
        load_ablation(write(tmp_path, {"name": "c", "grid": grid, "compare": [["bf16"]]}))


def test_compare_tables_in_the_report(tmp_path, monkeypatch):
    """train() is faked: each cell logs a held-out curve whose values follow from its mode and seed."""
    import json

    import jetflow.run.runner as runner
    from jetflow.run.files import COMPLETE

    final = {("bf16", 0): 0.5, ("bf16", 1): 0.7, ("bf16", 2): 0.6, ("mixed", 0): 0.4, ("mixed", 1): 0.5,
             ("mixed", 2): 0.6}

    def fake_train(cfg):
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        end = final[(cfg.precision.mode, cfg.run.seed)]
        rows = [{"step": s, "phase": "rl", "reward/mean": end, "train/grad_norm": 1.0 + s,
                 "policy/low_prob_frac": 0.1} for s in range(4)]
        rows += [{"step": s, "phase": "eval", "eval/pass@1": p} for s, p in ((0, 0.9), (2, end - 0.2), (4, end))]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / COMPLETE).write_text("done\n")
        return run_dir

    monkeypatch.setattr(runner, "train", fake_train)
    path = write(tmp_path, {"name": "c", "base_config": str(ROOT / "configs/tiny.yaml"),
                            "grid": {"precision.mode": ["bf16", "mixed"],
                                     "algo.correction": {"values": ["none"], "only_when": {"precision.mode": "mixed"}},
                                     "run.seed": [0, 1, 2]},
                            "compare": [["mixed-none", "bf16"]]})
    out = tmp_path / "out"
    assert run_ablation(path, out_dir=out, command="test", log=lambda s: None) == 0
    summary = json.loads((out / "summary.json").read_text())
    arms = {a["variant"]: a for a in summary["arms"]}
    assert arms["bf16"]["heldout_pass1_end"]["mean"] == pytest.approx(0.6)
    assert arms["bf16"]["heldout_pass1_end"]["sd"] == pytest.approx(0.1)
    # the curve after the first evaluation: (end - 0.2 + end) / 2 = end - 0.1 -> bf16 mean 0.5
    assert arms["bf16"]["heldout_pass1_mean"]["mean"] == pytest.approx(0.5)
    assert arms["bf16"]["grad_norm_max"] == 4.0 and arms["bf16"]["grad_norm_mean"] == 2.5
    cmp = {r["metric"]: r for r in summary["comparisons"]}
    end = cmp["heldout_pass1_end"]
    # mixed 0.4, 0.5, 0.6 (mean 0.5, s 0.1) - bf16 0.5, 0.7, 0.6 (mean 0.6, s 0.1): -0.1 ± sqrt(0.02 / 3)
    assert end["diff"] == pytest.approx(-0.1) and end["se"] == pytest.approx((0.02 / 3) ** 0.5)
    # per seed: -0.1, -0.2, 0 -> mean -0.1, s 0.1
    assert end["paired_diff"] == pytest.approx(-0.1) and end["paired_se"] == pytest.approx(0.1 / 3 ** 0.5)
    md = (out / "summary.md").read_text()
    assert "| all cells | bf16 | 3 | 0.600 ± 0.100 (0.5 .. 0.7) |" in md
    assert "| all cells | mixed-none - bf16 | final held-out pass@1 | 3 / 3 | -0.100 ± 0.082 | -0.100 ± 0.058 (3) |" in md
    assert (out / "grad_norm.png").read_bytes().startswith(b"\x89PNG") and (out / "low_prob.png").exists()
    assert not (out / "response_length.png").exists()  # no cell logged response/length_mean: not drawn
    assert "![grad norm](grad_norm.png)" in md


def test_a_cell_a_conditional_panel_axis_skipped_is_drawn_in_every_panel(tmp_path):
    """configs/ablations/learning.yaml: the recipe family is a panel axis of mixed and unified only; bf16
    (no family) is drawn beside each, and compared within each."""
    from jetflow.ablate.grid import place_cells

    ab = load_ablation(ROOT / "configs/ablations/learning.yaml", out_dir=tmp_path)
    placed = place_cells(ab)
    seeds = len(yaml.safe_load((ROOT / "configs/ablations/learning.yaml").read_text())["grid"]["run.seed"])
    assert seeds >= 3
    assert len(ab.cells) == seeds * 3 * 9 and len(placed) == seeds * 3 * 10  # bf16 twice per seed and setting
    assert list(dict.fromkeys(p.panel for p in placed)) == [f"{s}-{r}" for s in ("sum3-T0.5", "sum3-T0.5-wu20", "sum2-T1")
                                                            for r in ("fp8", "nvfp4")]
    assert list(dict.fromkeys(p.line for p in placed)) == ["bf16", "mixed-none", "mixed-token_tis", "mixed-ais",
                                                           "unified"]
    assert {p.panel for p in placed if p.cell.id == "seed3-sum2-T1-bf16"} == {"sum2-T1-fp8", "sum2-T1-nvfp4"}
    assert [p.panel for p in placed if p.cell.id == "seed3-sum2-T1-unified-nvfp4"] == ["sum2-T1-nvfp4"]
    assert ab.compare[0] == ("mixed-none", "bf16")
    from jetflow.ablate.figures import panel_columns
    assert panel_columns(placed) == 2  # a setting per row, its two recipe families side by side
    assert panel_columns(place_cells(load_ablation(ROOT / "configs/ablations/precision.yaml", out_dir=tmp_path))) == 3
    # an axis that skips nothing keeps one panel per cell (the precision study)
    precision = load_ablation(ROOT / "configs/ablations/precision.yaml", out_dir=tmp_path)
    assert len(place_cells(precision)) == len(precision.cells)
