"""Do two runs log the same numbers? Compares two run directories' metrics.jsonl row by row, leaving
out the wall-clock keys (time/*, throughput/*), and their mismatch_positions.jsonl.

    python scripts/same_metrics.py RUN_DIR_A RUN_DIR_B      # exit 0 and "identical", else the first difference
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CLOCK = ("time/", "throughput/")


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append({k: v for k, v in row.items() if not k.startswith(CLOCK)})
    return out


def main(a: str, b: str) -> int:
    for name in ("metrics.jsonl", "mismatch_positions.jsonl"):
        ra, rb = rows(Path(a) / name), rows(Path(b) / name)
        if ra != rb:
            if len(ra) != len(rb):
                print(f"{name}: {len(ra)} rows vs {len(rb)}")
                return 1
            for x, y in zip(ra, rb):
                diff = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
                if diff:
                    print(f"{name}: step {x.get('step')} ({x.get('phase')}) differs: {dict(list(diff.items())[:5])}")
                    return 1
        print(f"{name}: {len(ra)} rows identical (clock keys aside)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
