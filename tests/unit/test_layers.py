"""The house rules that scripts/layers.py measures: no module over the line limit, no import up README's
layer table, train/ and rollout/ apart. (Its import circles are reported by the script itself.)"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)


def graph():
    files = sorted((ROOT / "jetflow").rglob("*.py"))
    modules = {layers.module_name(f) for f in files}
    return files, {layers.module_name(f): layers.imports(f, modules) for f in files}


def test_no_module_over_the_line_limit():
    files, _ = graph()
    assert [f.name for f in files if layers.code_lines(f.read_text()) > layers.LINE_LIMIT] == []


def test_the_limit_counts_code_not_documentation():
    """Docstrings (module, function, attribute), comments and blank lines are free; code is counted."""
    source = '"""Module\ndocstring."""\n\n# a comment\nx = 1  # trailing\n"""x\'s docstring."""\n\n\ndef f():\n' \
             '    """One\n    two."""\n    return "not a docstring"\n'
    assert layers.code_lines(source) == 3


def test_every_module_has_a_layer_and_no_import_runs_up():
    _, g = graph()
    up = [(a, b) for a in g for b in g[a] if layers.layer(b)[0] > layers.layer(a)[0]]
    assert up == []
    assert layers.layer("jetflow.run.validate")[0] > layers.layer("jetflow.config")[0]


def test_train_and_rollout_never_import_each_other():
    _, g = graph()
    assert [(a, b) for a in g for b in g[a] if {layers.layer(a)[1], layers.layer(b)[1]} == set(layers.APART)] == []


def test_the_measure_sees_imports_and_circles():
    """The script can fail: a relative, a from-import of a submodule and a lazy import count, a
    TYPE_CHECKING one does not, and a loop of two modules is a circle."""
    modules = {"jetflow.run.validate", "jetflow.run.build", "jetflow.config", "jetflow.train.protocol",
               "jetflow.sync"}
    assert layers.imports(ROOT / "jetflow" / "run" / "validate.py", modules) >= {"jetflow.run.build", "jetflow.config"}
    assert "jetflow.sync" not in layers.imports(ROOT / "jetflow" / "train" / "protocol.py", modules)
    assert layers.circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
