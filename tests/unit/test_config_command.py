"""`jetflow config [--config F] [key=value ...]` prints the resolved config as YAML that loads back to the same
config; `jetflow config explain KEY` prints the key's reference entry (jetflow.config_reference, the entries the
docs' configuration reference is generated from); an unknown key is one line suggesting the closest."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.config import Config, config_text, load_config
from jetflow.config_reference import config_keys, explain

REPO = Path(__file__).resolve().parents[2]


def test_the_resolved_config_is_printed_as_yaml_that_loads_back(tmp_path, capsys):
    overrides = ["precision.mode=mixed", "algo.kl_coef=0.05", "task.params.digits=2"]
    assert main(["config", "--config", str(REPO / "configs/tiny.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert out == config_text(load_config(REPO / "configs/tiny.yaml", overrides))
    assert "mode: mixed" in out and "kl_coef: 0.05" in out and "hidden_size: 128" in out  # override and file
    (tmp_path / "resolved.yaml").write_text(out)
    assert load_config(tmp_path / "resolved.yaml") == load_config(REPO / "configs/tiny.yaml", overrides)


def test_without_a_file_it_prints_the_defaults_and_options_may_follow_overrides(capsys):
    assert main(["config"]) == 0
    assert capsys.readouterr().out == config_text(Config())
    assert main(["config", "train.steps=3", "--config", str(REPO / "configs/tiny.yaml")]) == 0
    assert "steps: 3" in capsys.readouterr().out


def test_explain_prints_the_keys_type_default_valid_values_and_description(capsys):
    assert main(["config", "explain", "algo.correction", "rollout.max_staleness"]) == 0
    out = capsys.readouterr().out
    entry = next(k for k in config_keys() if k.key == "algo.correction")
    assert out.startswith("algo.correction\n  type:    Literal[")
    assert "  default: auto\n" in out and "  valid:   auto, none, token_tis, token_mis, seq_tis, seq_mis, ais\n" in out
    assert " ".join(entry.doc.split()[:6]) in " ".join(out.split())  # the field's docstring, wrapped
    assert "\nrollout.max_staleness\n  type:    int\n  default: 0\n" in out


def test_explain_a_section_lists_its_keys(capsys):
    assert main(["config", "explain", "model.tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[model.tiny]\n  A small Llama-style model")
    assert [line for line in out.splitlines() if line.startswith("model.tiny.")] == \
        [k.key for k in config_keys() if k.key.startswith("model.tiny.")]


def test_every_key_has_an_entry():
    for key in config_keys():
        text = explain(key.key)
        assert text.startswith(f"{key.key}\n  type:    {key.type}\n  default: {key.default}\n")
        assert "(undocumented)" not in text


@pytest.mark.parametrize("name, hint", [
    ("algo.kl_cof", "; did you mean algo.kl_coef?"),
    ("kl_coef", "; did you mean algo.kl_coef?"),  # the last part alone
    ("rollout.max_stalenes", "; did you mean rollout.max_staleness?"),
    ("precison", "; did you mean precision?"),  # a section
    ("zzzz", " (`jetflow config`"),  # nothing close: no suggestion
])
def test_an_unknown_key_is_one_line_with_the_closest_key(capsys, name, hint):
    assert main(["config", "explain", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jetflow: error: ConfigError: unknown config key {name!r}{hint}")


def test_explain_without_a_key_and_a_bad_override_are_one_line(capsys):
    assert main(["config", "explain"]) == 2
    assert "name a config key" in capsys.readouterr().err
    assert main(["config", "algo.kl_coff=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'algo.kl_coff'" in err and "kl_coef" in err
