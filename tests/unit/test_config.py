"""Config schema, YAML, overrides and their errors."""

import pytest

from jetflow.config import ConfigError, load_config, save_config


def test_defaults_yaml_and_overrides(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("precision:\n  mode: mixed\ntrain:\n  steps: 7\n")
    cfg = load_config(yaml, ["train.steps=9", "task.params.digits=2"])
    assert cfg.precision.mode == "mixed" and cfg.train.steps == 9 and cfg.task.params == {"digits": 2}
    out = tmp_path / "resolved.yaml"
    save_config(cfg, out)
    assert load_config(out).train.steps == 9


@pytest.mark.parametrize("override, message", [
    ("precision.mdoe=unified", "valid keys here: .*'mode'"),
    ("nosuch.key=1", "valid keys here: .*'precision'"),
    ("precision.mode=fp4", "choose one of .*'unified'"),
    ("train.steps=many", "train.steps"),
    ("rollout.group_size=0", "rollout.group_size"),
    ("precision.fmt=e3m4", "precision.fmt"),
    ("justakey", "key=value"),
])
def test_bad_keys_and_values_name_themselves(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("does/not/exist.yaml")


def test_recipe_from_config():
    cfg = load_config(None, ["precision.scale_rule=pow2", "precision.fmt=hybrid"])
    r = cfg.precision.recipe()
    assert r.scale_rule == "pow2" and r.grad_format == "e5m2" and r.weight_block == (128, 128)


def test_configs_default_yaml_is_the_embedded_default():
    from pathlib import Path
    from jetflow.config import Config, to_dict
    root = Path(__file__).resolve().parents[2]
    assert to_dict(load_config(root / "configs/default.yaml")) == to_dict(Config())


def test_shipped_configs_load():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    run_configs = [p for p in sorted((root / "configs").rglob("*.yaml")) if p.parent.name != "ablations"]
    assert run_configs
    for path in run_configs:  # ablation grids are checked by tests/unit/test_ablate.py
        load_config(path)


@pytest.mark.parametrize("override,message", [
    ("train.grad_clip=-1", r"train.grad_clip=-1.0 is out of range; it must be >= 0"),
    ("train.min_lr_ratio=-1", r"train.min_lr_ratio=-1.0 is out of range; it must be in \[0, 1\]"),
    ("train.min_lr_ratio=1.5", r"train.min_lr_ratio=1.5 is out of range"),
    ("train.weight_decay=-0.1", r"train.weight_decay"),
    ("train.warmup_steps=-2", r"train.warmup_steps"),
    ("train.betas=[0.9,1.0]", r"train.betas"),
    ("train.checkpoint_every=-1", r"train.checkpoint_every"),
    ("rollout.group_size=1", r"rollout.group_size=1 is out of range; it must be >= 2: GRPO"),
    ("algo.kl_coef=0.1", r"algo.kl_coef=0.1 is out of range; it must be 0: a KL penalty needs a reference policy"),
])
def test_out_of_range_values_are_refused_by_name(override, message):
    """Values that used to run silently as something else (gradient ascent, a negative LR, zero
    advantages, a KL term that never reached the loss) are refused before anything is built."""
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", [override])
    load_config("configs/tiny.yaml", ["train.grad_clip=0", "train.min_lr_ratio=0", "rollout.group_size=2"])  # edges
