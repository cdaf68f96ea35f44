"""The docs' generated references (scripts/gen_docs.py): every config key documented, every key, metric and command
in its reference page, and the links that leave docs/ checked against the repository. (`mkdocs build --strict`
itself runs in scripts/test.sh.)"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_docs)


def test_every_config_key_has_a_docstring():
    missing = gen_docs.undocumented_keys()
    assert not missing, (f"config keys without a docstring (the string literal right after the field in "
                         f"jetflow/config.py; the configuration reference prints it): {missing}")


def test_a_key_without_a_docstring_is_found():
    """The check can fail: the same source with one field's docstring turned into a comment."""
    source = gen_docs.CONFIG_SOURCE.read_text()
    doc = '    max_staleness: int = 0\n    """'
    assert doc in source
    start = source.index(doc) + len("    max_staleness: int = 0\n")
    end = source.index('"""', source.index('"""', start) + 3) + 3
    before = set(gen_docs.undocumented_keys(source))
    assert set(gen_docs.undocumented_keys(source[:start] + "    # gone" + source[end:])) - before == {"rollout.max_staleness"}


def test_attribute_docstrings_are_the_string_after_the_field():
    source = 'class A:\n    x: int = 1\n    """X\n    spans lines."""\n    y: str = "y"  # a comment\n    z: int = 0\n'
    assert gen_docs.attribute_docs(source)["A"] == {"x": ("int", "X spans lines."), "y": ("str", ""), "z": ("int", "")}


def test_the_config_reference_lists_every_key_with_its_default_and_choices():
    page = gen_docs.config_reference()
    for key in gen_docs.config_keys():
        assert f"| `{key.key}` |" in page
    assert "| `rollout.max_staleness` | `int` | `0` |" in page
    assert "`fp8_block`, `mxfp8`, `nvfp4`" in page  # precision.family's Literal
    assert "`auto`" in page.split("| `train.activation_checkpointing` |")[1].splitlines()[0]  # bool | Literal["auto"]


def test_the_metrics_reference_lists_every_registered_metric():
    from jetflow.metrics_registry import METRICS
    page = gen_docs.metrics_reference()
    for m in METRICS:
        assert f"| `{m.key}` | {', '.join(m.phases)} |" in page
    assert "| `mismatch/{stat}/pos_{i}of{n}` | rl | always |" in page
    assert "| `time/train` | sft, rl | always |" in page and "## `eval` {#eval}" in page
    assert "- `step`: " in page and "`{stat}` is one of the mismatch statistics: kl_k1, kl_k3" in page


def test_the_cli_reference_has_every_subcommands_help():
    page = gen_docs.cli_reference()
    for name in ("train", "estimate-memory", "config", "ablate", "launch", "report", "bench", "audit", "convert", "export",
                 "generate"):
        assert f"## `jetflow {name}`" in page and f"usage: jetflow {name}" in page


def test_links_that_leave_docs_are_found():
    assert gen_docs._outbound("status.md", "../results/fsdp/README.md") == "results/fsdp/README.md"
    assert gen_docs._outbound("reference/cli.md", "../../tests/unit/test_docs.py#x") == "tests/unit/test_docs.py"
    assert gen_docs._outbound("status.md", "precision.md#exact") is None
    assert gen_docs._outbound("status.md", "https://example.org/a") is None
    assert gen_docs._outbound("reference/cli.md", "../install.md") is None
