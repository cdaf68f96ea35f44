"""Which functions of jetflow/ are longer than 80 lines (bench/ aside: a benchmark's script reads top to
bottom)? A function's length is its `def` line to its last line, its docstring and comments included.

    python scripts/long_functions.py      # each one, longest first, and their number
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80


def main() -> int:
    long = []
    for path in sorted((ROOT / "jetflow").rglob("*.py")):
        if "bench" in path.relative_to(ROOT / "jetflow").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LIMIT:
                    long.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    for n, where in sorted(long, reverse=True):
        print(f"{n:4d}  {where}")
    print(f"functions over {LIMIT} lines outside bench/: {len(long)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
