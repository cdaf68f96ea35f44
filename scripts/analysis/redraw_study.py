"""Redraw an ablation study's report from its runs into another folder, and compare it with the study's.

    python scripts/analysis/redraw_study.py results/precision /tmp/redraw/precision

What `jetflow report results/<study>` does (summary.md, summary.json, the figures; for a study whose
README has the length study's tables, also `python -m jetflow.ablate.length_study`), but into OUT, with
the time and the machine that summary.md names taken from the study's summary.json (a redraw on another
machine writes the same bytes when the runs give the same numbers). The runs are read from the
study's archive (runs.tar.xz, copied into OUT; a study inside another's archive is drawn at its place
under OUT) or, for a study without one, from its run folders (linked).
Prints, per file, whether the redraw is byte-equal to the study's.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import types
from pathlib import Path

from jetflow.ablate import length_study, report
from jetflow.ablate.archive import ARCHIVE, archive_of
from jetflow.ablate.grid import load_ablation


def redraw(study: Path, out: Path, loose: bool = False) -> tuple[Path, list[str]]:
    """Redraw `study` under `out`: (the folder it was drawn into, the names of the files written there
    that the study also has). A study inside another's archive (results/learning-length/draws-len256)
    is drawn into the same place under `out`, beside a copy of that archive. `loose`: read the run
    folders on disk even where an archive holds them (to compare the two before the folders go)."""
    summary = json.loads((study / "summary.json").read_text())
    found = None if loose else archive_of(study / "_")
    out.mkdir(parents=True, exist_ok=True)
    if found is not None:
        shutil.copy(found[0], out / ARCHIVE)
        into = out / found[1].removesuffix("_")
    else:
        into = out
    into.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "README.md"):
        if (study / name).is_file():
            shutil.copy(study / name, into / name)
    if found is None:
        for sub in study.iterdir():
            if sub.is_dir() and not (into / sub.name).exists():
                (into / sub.name).symlink_to(sub.resolve())
    report.environment = lambda: summary["environment"]
    report.time = types.SimpleNamespace(strftime=lambda _fmt: summary["generated"])  # type: ignore[assignment]
    ab = load_ablation(summary["ablation_file"], into)
    report.write_report(ab, summary["command"])
    names = ["summary.md", *summary.get("plots", {}).values()]
    readme = into / "README.md"
    if readme.is_file() and length_study.TABLES_BEGIN in readme.read_text():
        length_study.write_tables(ab, readme)
        names += ["README.md", length_study.FIGURE, length_study.GAP_FIGURE]
    return into, [n for n in dict.fromkeys(names) if (study / n).is_file() and (into / n).is_file()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="e.g. results/precision")
    ap.add_argument("out", type=Path, help="an empty folder for the redraw")
    ap.add_argument("--loose", action="store_true", help="read the run folders on disk, not the archive")
    args = ap.parse_args(argv)
    into, names = redraw(args.study, args.out, args.loose)
    for name in names:
        same = filecmp.cmp(args.study / name, into / name, shallow=False)
        print(f"{args.study / name}: {'byte-equal' if same else 'differs'}")


if __name__ == "__main__":
    main()
