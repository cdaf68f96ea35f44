"""A study's per-run files read in place: loose in a run directory, or from the study's one archive.

results/<study>/ keeps its README, summaries, tables and figures as files, and every run's raw files
(metrics.jsonl, mismatch_positions.jsonl, config.yaml, summary.json, COMPLETE / STOPPED, logs) in one
archive, results/<study>/runs.tar.xz (issue 76; built by scripts/analysis/archive_runs.py). A member
keeps the path it had under the study's folder, so `results/learning-length/runs/<cell>/metrics.jsonl`
is the member `runs/<cell>/metrics.jsonl` of `results/learning-length/runs.tar.xz`.

Every reader of a study's runs (jetflow.ablate's report, figures, length study and runner, and
scripts/analysis/) asks this module for a run file by the path it would have on disk: a loose file
there is read first (a run still going, or one not archived yet), then `<name>.gz` beside it, then the
member of the nearest archive in a folder above it. An archive is decompressed once per process and
held in memory (the two most recent ones): xz reads in one pass, not member by member.
"""

from __future__ import annotations

import functools
import gzip
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

from jetflow.metrics_log import METRICS_FILE, read_jsonl, warn
from jetflow.run.files import COMPLETE, ERROR_FILE, run_status as loose_run_status

ARCHIVE = "runs.tar.xz"


@functools.lru_cache(maxsize=2)
def _members(archive: Path, mtime_ns: int, size: int) -> dict[str, bytes]:
    """{member name: its bytes} of one archive (the key's mtime and size: a rebuilt archive is read again)."""
    with tarfile.open(archive, "r:xz") as tar:
        out = {}
        for m in tar:
            f = tar.extractfile(m) if m.isfile() else None
            if f is not None:
                out[m.name] = f.read()
        return out


def archive_of(path: str | Path) -> tuple[Path, str] | None:
    """(the archive that holds `path`, its member name there), or None when no folder above it has one."""
    path = Path(path)
    for parent in path.parents:
        archive = parent / ARCHIVE
        if archive.is_file():
            return archive, path.relative_to(parent).as_posix()
    return None


def members(archive: Path) -> dict[str, bytes]:
    """Every file of a study's archive by its path under the study's folder."""
    st = archive.stat()
    return _members(archive.resolve(), st.st_mtime_ns, st.st_size)


def read_bytes(path: str | Path) -> bytes | None:
    """A run file's bytes: the loose file, its `.gz` beside it, or the archive's member (None: none of them)."""
    path = Path(path)
    if path.is_file():
        return path.read_bytes()
    packed = path.with_name(path.name + ".gz")
    if packed.is_file():
        return gzip.decompress(packed.read_bytes())
    found = archive_of(path)
    if found is None:
        return None
    held = members(found[0])
    if found[1] in held:
        return held[found[1]]
    if found[1] + ".gz" in held:
        return gzip.decompress(held[found[1] + ".gz"])
    return None


def exists(path: str | Path) -> bool:
    """A run file or folder that is on disk or in its study's archive."""
    path = Path(path)
    if path.exists() or path.with_name(path.name + ".gz").is_file():
        return True
    found = archive_of(path)
    if found is None:
        return False
    name = found[1]
    return any(m == name or m == name + ".gz" or m.startswith(name + "/") for m in members(found[0]))


def listdir(path: str | Path) -> list[str]:
    """The names in a folder, on disk and in its study's archive, sorted (`.gz` of a member dropped)."""
    path = Path(path)
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    found = archive_of(path / "_")
    if found is not None:
        prefix = found[1][: -len("_")]
        names |= {m[len(prefix):].split("/", 1)[0].removesuffix(".gz")
                  for m in members(found[0]) if m.startswith(prefix)}
    return sorted(names)


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines run file (metrics.jsonl, mismatch_positions.jsonl), loose or archived;
    none when it is in neither place. A line that is not JSON is skipped with a warning, as
    jetflow.metrics_log.read_jsonl does for a loose one."""
    path = Path(path)
    if path.is_file() or path.with_name(path.name + ".gz").is_file():
        return read_jsonl(path)
    data = read_bytes(path)
    if data is None:
        return []
    rows, bad = [], 0
    for line in data.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                bad += 1
    if bad:
        warn(f"skipped {bad} line(s) of {path} in its archive that are not JSON")
    return rows


def metrics_rows(run_dir: str | Path, phase: str | None = None) -> list[dict]:
    """A run's metrics rows (of one phase: sft, rl, eval, when given), from its run directory or its
    study's archive: the one way a study's scripts read a run."""
    rows = read_rows(Path(run_dir) / METRICS_FILE)
    return rows if phase is None else [r for r in rows if r.get("phase") == phase]


def run_status(run_dir: str | Path) -> str:
    """complete | failed | partial | pending (jetflow.run.files.run_status), of a run directory on disk
    or, when it is not on disk, archived."""
    run_dir = Path(run_dir)
    if run_dir.exists() or archive_of(run_dir) is None:
        return loose_run_status(run_dir)
    if exists(run_dir / COMPLETE):
        return "complete"
    if exists(run_dir / ERROR_FILE):
        return "failed"
    return "partial" if exists(run_dir) else "pending"


def walk_files(root: str | Path) -> Iterator[tuple[str, bytes]]:
    """(path under `root`, bytes) of every archived member below `root` (a study folder or one under it)."""
    root = Path(root)
    found = archive_of(root / "_")
    if found is None:
        return
    prefix = found[1][: -len("_")]
    for name, data in sorted(members(found[0]).items()):
        if name.startswith(prefix):
            yield name[len(prefix):], data
