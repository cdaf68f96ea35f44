"""Config schema, YAML, overrides and their errors (keys, types and the choices typed at each field;
the values' ranges are the pre-run pass's: tests/unit/test_validate.py)."""

import pytest

from jetflow.config import ConfigError, config_text, load_config


def test_defaults_yaml_and_overrides(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("precision:\n  mode: mixed\ntrain:\n  steps: 7\n")
    cfg = load_config(yaml, ["train.steps=9", "task.params.digits=2"])
    assert cfg.precision.mode == "mixed" and cfg.train.steps == 9 and cfg.task.params == {"digits": 2}
    out = tmp_path / "resolved.yaml"
    out.write_text(config_text(cfg))
    assert load_config(out).train.steps == 9


@pytest.mark.parametrize("override, message", [
    ("precision.mdoe=unified", "valid keys here: .*'mode'"),
    ("nosuch.key=1", "valid keys here: .*'precision'"),
    ("precision.mode=fp4", "choose one of .*'unified'"),
    ("train.steps=many", "train.steps"),
    ("precision.fmt=e3m4", r"precision.fmt='e3m4' is not valid; choose one of \['e4m3', 'hybrid'\]"),
    ("algo.correction_params={cap: high}", "algo.correction_params.cap"),
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


def test_choices_are_typed_at_their_fields():
    """Every choice is a Literal at its field (no separate table): the schema refuses anything else."""
    import dataclasses
    from typing import Literal, get_args, get_origin, get_type_hints

    from jetflow.config import Config
    typed = {f"{section.name}.{name}": get_args(hint)
             for section in dataclasses.fields(Config)
             for name, hint in get_type_hints(section.type if isinstance(section.type, type) else
                                              type(getattr(Config(), section.name))).items()
             if get_origin(hint) is Literal}
    assert typed["precision.mode"] == ("fp32", "bf16", "mixed", "unified")
    assert typed["algo.correction"][0] == "auto" and "ais" in typed["algo.correction"]
    assert {"train.backend", "rollout.backend", "run.orchestrator", "task.name", "model.dtype"} <= set(typed)
    for key, choices in typed.items():
        with pytest.raises(ConfigError, match=rf"{key}='nope' is not valid; choose one of"):
            load_config(None, [f"{key}=nope"])
        assert load_config(None, [f"{key}={choices[-1]}"])  # and each choice loads


def test_overrides_apply_in_order_whatever_their_keys():
    """Overrides of unrelated keys are merged together (load_config's speed); one whose key contains or is
    contained in an earlier one's still lands after it, as if applied one at a time."""
    cfg = load_config("configs/tiny.yaml", ["train.steps=5", "model.tiny.num_layers=3", "train.steps=7",
                                            "model.tiny={hidden_size: 64}", "task.params.digits=2",
                                            "task.params={num_operands: 3}", "task.params.style=plain"])
    assert cfg.train.steps == 7
    assert (cfg.model.tiny.num_layers, cfg.model.tiny.hidden_size, cfg.model.tiny.num_heads) == (3, 64, 4)
    assert cfg.task.params == {"num_operands": 3, "style": "plain"}  # `task.params=` replaces the mapping
    cfg = load_config("configs/tiny.yaml", ["model.tiny={hidden_size: 64}", "model.tiny.hidden_size=32"])
    assert cfg.model.tiny.hidden_size == 32


def test_a_removed_key_loads_at_its_one_value_and_is_refused_at_another(tmp_path):
    """train.fp8_backend is gone (jetflow's own GEMMs were the only backend a run could take): a saved run's
    config.yaml still lists it as `jetflow` and loads; `te`, in a file or an override, is refused in one line."""
    saved, te = tmp_path / "saved.yaml", tmp_path / "te.yaml"
    saved.write_text("train:\n  fp8_backend: jetflow\n  steps: 3\n")
    te.write_text("train:\n  fp8_backend: te\n")
    assert load_config(saved) == load_config(None, ["train.steps=3"])
    assert load_config(None, ["train.fp8_backend=jetflow"]) == load_config(None)
    for path, overrides in ((None, ["train.fp8_backend=te"]), (te, [])):
        with pytest.raises(ConfigError, match=r"^train.fp8_backend='te': the key was removed \(.*\); delete it$"):
            load_config(path, overrides)
