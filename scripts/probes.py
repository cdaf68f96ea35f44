"""How often does jetflow ask its own objects what they are? Counts the getattr / hasattr probes on
jetflow's own objects in jetflow/ (bench/ included).

    python scripts/probes.py          # the counted calls, file:line, and their number
    python scripts/probes.py --all    # also the calls left out, each with why

The rule, read from the code's syntax tree (nothing is run):
- a probe is `hasattr(obj, ...)`, `getattr(obj, ..., default)`, or `getattr(obj, "literal")`;
  `getattr(obj, name)` with a name held in a variable and no default is reflection over fields
  (a dataclass walked by field name, a method picked by name) and is not a probe;
- left out: an `obj` whose first name is bound by an import of a module that is not jetflow's
  (`getattr(torch, dtype)`, `hasattr(F, "scaled_mm")`), and the objects of other libraries listed in
  THIRD_PARTY below (a vLLM layer, a Megatron module, an exception, argparse's namespace), each with
  its reason. The list is kept by hand: an object of another library that is not in it is counted.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = {  # (path under jetflow/, the source of `obj`) -> why it is not one of jetflow's objects
    ("cli.py", "args"): "argparse.Namespace",
    ("config.py", "e"): "an omegaconf exception",
    ("config.py", "hint"): "a typing annotation",
    ("writes.py", "error"): "an OSError",
    ("tasks/rewards.py", "out"): "a user reward function's return value",
    ("tasks/rewards.py", "module"): "a user's Python module",
    ("run/build.py", "module"): "a torch.nn.Linear",
    ("train/te.py", "t"): "a Transformer Engine tensor",
    ("train/megatron/weights.py", "self.gpt"): "Megatron's GPTModel",
    ("train/megatron/linear.py", "self"): "the attributes of Megatron's parallel linear it subclasses",
    ("rollout/vllm/policies.py", "vllm_config"): "vLLM's config",
    ("rollout/vllm/payload.py", "layer"): "a vLLM layer",
    ("rollout/vllm/payload.py", "getattr(layer, 'quant_method', None)"): "a vLLM quant method",
    ("rollout/vllm/payload.py", "kernel"): "a vLLM MoE kernel",
    ("rollout/vllm/serve.py", "module"): "a vLLM linear layer",
}


def foreign_modules(tree: ast.Module) -> set[str]:
    """Names bound by importing a module (or a name from a module) that is not jetflow's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("jetflow"):
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("jetflow"):
            names.update(a.asname or a.name for a in node.names)
    return names


def root_name(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def probes(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, source, why left out or None) for each getattr / hasattr probe in one file."""
    text = path.read_text()
    tree = ast.parse(text)
    foreign = foreign_modules(tree)
    rel = path.relative_to(ROOT / "jetflow").as_posix()
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        obj, name = node.args[0], node.args[1]
        literal = isinstance(name, ast.Constant)
        if node.func.id == "getattr" and len(node.args) == 2 and not literal:
            continue  # reflection: a field or method picked by a name in a variable
        src = ast.get_source_segment(text, node)
        why = None
        if root_name(obj) in foreign:
            why = f"`{root_name(obj)}` is an imported module or name of another library"
        elif (rel, ast.unparse(obj)) in THIRD_PARTY:
            why = THIRD_PARTY[(rel, ast.unparse(obj))]
        out.append((node.lineno, src, why))
    return sorted(out)


def main(argv: list[str]) -> int:
    show_all = "--all" in argv
    counted = 0
    for path in sorted((ROOT / "jetflow").rglob("*.py")):
        for line, src, why in probes(path):
            counted += why is None
            if why is None or show_all:
                where = f"{path.relative_to(ROOT)}:{line}"
                print(f"{where}: {src}" + (f"    [left out: {why}]" if why else ""))
    print(f"probes on jetflow's own objects: {counted}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
