"""Does jetflow keep its layers? Lists the modules over the line limit (counting code lines: docstrings,
comments and blank lines do not count, so documentation is never cut to fit), the import circles, the imports
that run up README.md's layer table (entry -> run -> sides -> model -> core: each layer imports only
from the ones below it), and imports between train/ and rollout/ (they meet in run/ and sync).

    python scripts/layers.py          # exit 0 when every list is empty, else 1

Every import counts, also one inside a function (a lazy import is still a dependency); imports under
`if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE_LIMIT = 450
LAYERS = {  # README.md, Architecture: a path prefix under jetflow/ -> its layer (higher imports lower)
    "cli.py": 5, "ablate/": 5, "bench/": 5, "launch/": 5,
    "run/": 4,
    "train/": 3, "rollout/": 3, "sync.py": 3, "export.py": 3,
    "model/": 2, "config.py": 2, "config_reference.py": 2,
    "precision/": 1, "kernels/": 1, "rl/": 1, "tasks/": 1, "distributed.py": 1, "metrics_log.py": 1, "metrics_registry.py": 1, "trackers.py": 1, "writes.py": 1, "host_memory.py": 1,
    "plots.py": 1, "errors.py": 1, "__init__.py": 1,
}
NAMES = {5: "entry", 4: "run", 3: "sides", 2: "model", 1: "core"}
APART = ("train/", "rollout/")  # the two sides never import each other


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not inside a docstring (a string expression
    standing alone as a statement: a module's, class's or function's docstring, or an attribute's)."""
    tree = ast.parse(source)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return sum(1 for n, line in enumerate(source.splitlines(), 1)
               if n not in doc and line.strip() and not line.strip().startswith("#"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> tuple[int, str]:
    rel = module.removeprefix("jetflow").lstrip(".").replace(".", "/")
    for prefix, level in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if (rel + ".py").startswith(prefix) or (rel + "/").startswith(prefix) or (rel == "" and prefix == "__init__.py"):
            return level, prefix
    raise KeyError(f"{module}: not in the layer table of scripts/layers.py")


def imports(path: Path, modules: set[str]) -> set[str]:
    """The jetflow modules `path` imports (a `from pkg import name` of a submodule names the submodule)."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != here}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    files = sorted((ROOT / "jetflow").rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports(f, modules) for f in files}
    long = [(code_lines(f.read_text()), f.relative_to(ROOT)) for f in files]
    long = sorted(((n, f) for n, f in long if n > LINE_LIMIT), reverse=True)
    up = [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if layer(b)[0] > layer(a)[0]]
    across = [(a, b) for a, b in ((a, b) for a in sorted(graph) for b in sorted(graph[a]))
              if {layer(a)[1], layer(b)[1]} == set(APART)]
    found = circles(graph)
    print(f"{len(files)} modules; largest: {max(code_lines(f.read_text()) for f in files)} code lines")
    print(f"over {LINE_LIMIT} code lines: {len(long)}" + "".join(f"\n  {f} {n}" for n, f in long))
    print(f"import circles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    print(f"imports up the layers: {len(up)}" + "".join(
        f"\n  {a} ({NAMES[layer(a)[0]]}) -> {b} ({NAMES[layer(b)[0]]})" for a, b in up))
    print(f"imports between train/ and rollout/: {len(across)}" + "".join(f"\n  {a} -> {b}" for a, b in across))
    return 1 if long or found or up or across else 0


if __name__ == "__main__":
    sys.exit(main())
