"""Pack a study's per-run files into its one archive, results/<study>/runs.tar.xz (issue 76).

    python scripts/analysis/archive_runs.py results/learning-length [...] [--list FILE]

Which files: every tracked file (git ls-files) in a run directory (a folder holding config.yaml,
metrics.jsonl[.gz], COMPLETE or STOPPED) or below one, and every log (*.log) and JSON-lines file
(*.jsonl, *.jsonl.gz) elsewhere in the study; never a README, summary.md, figure, script or .gitignore
(those stay files). A `.jsonl.gz` goes in as its `.jsonl` (the archive compresses). Members already in
the archive are kept, a loose file replaces its member. The archive is the same bytes for the same
files (sorted members, no times or owners), and is read back and compared member by member before the
command ends. `--list FILE` writes the packed loose files' paths (for `git rm --pathspec-from-file`).

jetflow.ablate.archive reads a run's files from the archive in place; nothing is extracted.
"""

from __future__ import annotations

import argparse
import gzip
import io
import subprocess
import sys
import tarfile
from pathlib import Path

from jetflow.ablate.archive import ARCHIVE, members

RUN_MARKS = {"config.yaml", "metrics.jsonl", "metrics.jsonl.gz", "COMPLETE", "STOPPED"}
KEPT_SUFFIXES = (".md", ".png", ".py")


def tracked(study: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", str(study)], check=True, capture_output=True).stdout
    return [Path(p) for p in out.decode().split("\0") if p and Path(p).is_file()]


def packed_files(study: Path, files: list[Path]) -> list[Path]:
    """The files of `study` that go into its archive (the module docstring's rule)."""
    by_dir: dict[Path, set[str]] = {}
    for f in files:
        by_dir.setdefault(f.parent, set()).add(f.name)
    run_dirs = {d for d, names in by_dir.items() if names & RUN_MARKS and d != study}

    def in_run(f: Path) -> bool:
        return any(p in run_dirs for p in f.parents)

    return [f for f in files if f.name != ARCHIVE and f.name != ".gitignore" and not f.name.endswith(KEPT_SUFFIXES)
            and (in_run(f) or f.name.endswith((".log", ".jsonl", ".jsonl.gz")))]


def build(study: Path, loose: list[Path]) -> dict[str, bytes]:
    archive = study / ARCHIVE
    content = dict(members(archive)) if archive.is_file() else {}
    for f in loose:
        name, data = f.relative_to(study).as_posix(), f.read_bytes()
        if name.endswith(".jsonl.gz"):
            name, data = name.removesuffix(".gz"), gzip.decompress(data)
        content[name] = data
    return content


def write(archive: Path, content: dict[str, bytes]) -> None:
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9, format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(content):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(content[name]))
    tmp.replace(archive)
    back = members(archive)
    if back != content:
        sys.exit(f"{archive}: read back differs from what was packed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", type=Path, nargs="+", help="study folders, e.g. results/learning-length")
    ap.add_argument("--list", type=Path, default=None, help="write the packed loose files' paths here")
    args = ap.parse_args(argv)
    listed: list[str] = []
    for study in args.studies:
        loose = packed_files(study, tracked(study))
        if not loose:
            print(f"{study}: nothing to pack")
            continue
        content = build(study, loose)
        write(study / ARCHIVE, content)
        raw = sum(len(v) for v in content.values())
        size = (study / ARCHIVE).stat().st_size
        print(f"{study / ARCHIVE}: {len(loose)} loose files packed, {len(content)} members, "
              f"{raw:,} bytes -> {size:,} bytes")
        listed += [str(f) for f in loose]
    if args.list:
        args.list.write_text("".join(p + "\n" for p in listed))


if __name__ == "__main__":
    main()
