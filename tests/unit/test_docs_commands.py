"""A newcomer's path, run (issue 76): every shell block of README.md, docs/quickstart.md and docs/own-task.md,
line by line in one bash session per document, from a fresh clone of this repository in a temporary folder.
Every line runs, also after one failed (a run's output ends the failure message); the test fails when one did.

    python -m pytest -m long -p no:xdist tests/unit/test_docs_commands.py     # about half an hour on 2 busy cores

Marked `long`: the default run (pyproject's addopts, -m 'not long') leaves it out. A command runs as written,
except where its line is a pattern rather than a command (FILLED: the placeholder filled in, e.g. `DIR` with a
folder of the test's) or one this test does not run (SKIPPED, with the reason). A shell line the test does
not know and that holds a placeholder (`...`, `[`, `<`, ` | `, DIR) fails it: a new pattern in the docs needs
a line here.

The set-up commands (`bash scripts/install.sh`, `bash scripts/train.sh`) run as written over a .venv that
the test makes in each clone beforehand: a venv whose site-packages reaches this checkout's
.venv's packages and holds the clone's jetflow (editable, with its `jetflow` command), stamped as installed
for the clone's install.sh. install.sh then takes its second-run path (a second), so no download is
repeated; what the downloads install is what this checkout's .venv already holds.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
DOCS = os.environ.get("JETFLOW_DOCS", "README.md docs/quickstart.md docs/own-task.md").split()
"""The documents run, in this order (JETFLOW_DOCS=README.md: one of them)."""
PLACEHOLDER = re.compile(r"\.\.\.|\[|<|\s\|\s|\bDIR\b")
FILLED = {  # a docs line that is a pattern -> the command this test runs for it
    "git clone <this repository> jetflow && cd jetflow": "git clone -q {root} jetflow && cd jetflow && prepare_venv",
    "jetflow bench mismatch [--config F] [key=value ...]": "jetflow bench mismatch --config configs/tiny.yaml",
    "jetflow estimate-memory --config F [key=value ...]": "jetflow estimate-memory --config configs/tiny.yaml",
    "jetflow convert --out DIR": "jetflow convert --out {tmp}/hf",
    "jetflow export --model DIR --out DIR": "jetflow export --model {tmp}/hf --out {tmp}/fp8",
    'jetflow generate --model DIR "What is 2 + 3?"': 'jetflow generate --model {tmp}/fp8 "What is 2 + 3?"',
    # the grid's 14 cells of 200 steps are an hour and more: its cells and overrides, resolved and validated
    "jetflow ablate configs/ablations/precision.yaml": "jetflow ablate configs/ablations/precision.yaml --dry-run",
}
SKIPPED = {  # a docs line this test does not run -> why
    "bash scripts/test.sh": "the whole suite (an hour and more), this test among it",
    "jetflow train ... run.name=r1 run.resume=true": "a pattern (`...`: a run's own arguments); the resume tests run it",
    "jetflow train --no-report ...": "a pattern (`...`: a run's own arguments)",
    "jetflow train ... run.resume=true run.allow_changes=[train.steps]": "a pattern (`...`: a run's own arguments)",
    "jetflow bench gemm | linear | rollout": "three benchmarks named as alternatives (test_bench_suite.py runs them small)",
    "jetflow bench train-step | rl-step | sync | suite": "four benchmarks named as alternatives (test_bench_suite.py)",
}
PREPARE_VENV = r"""
prepare_venv() {  # the module docstring: a .venv over this checkout's packages, install.sh's stamp set
  "$BASE_PYTHON" -m venv --without-pip .venv  # pip and setuptools come from the shared packages
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$SHARED_SITE" > "$site/jetflow-test-shared.pth"
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . >/dev/null
  touch ".venv/.installed-run-$(cat pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)"
}
"""


def shell_lines(doc: Path) -> list[str]:
    """The command lines of a document's ```bash / ```sh / ```shell blocks, comments dropped, continuations joined."""
    lines = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", doc.read_text(), re.S | re.M):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def plan(doc: str, ran: set[str]) -> list[tuple[str, str | None, str | None]]:
    """(line as written, the command run or None, why not run or None) for each line of `doc`."""
    out: list[tuple[str, str | None, str | None]] = []
    for line in shell_lines(ROOT / doc):
        if line.startswith("git clone"):
            ran.clear()  # a fresh clone: nothing ran in it yet
        if line in SKIPPED:
            out.append((line, None, SKIPPED[line]))
        elif line in ran:
            out.append((line, None, "ran above, in this clone"))
        elif line in FILLED:
            out.append((line, FILLED[line], None))
        elif PLACEHOLDER.search(line):
            raise AssertionError(f"{doc}: `{line}` holds a placeholder this test does not know: add it to FILLED or SKIPPED")
        else:
            out.append((line, line, None))
        if out[-1][1] is not None and not line.startswith(("git clone", ".", "cd ")):
            ran.add(line)
            if line == "bash scripts/train.sh":
                ran.add("jetflow train")  # what train.sh runs after install.sh
    return out


def test_every_docs_line_is_planned() -> None:
    """Quick and not long in effect: each shell line of the docs is run, filled in or skipped with a reason."""
    ran: set[str] = set()
    for doc in DOCS:
        assert plan(doc, ran), f"{doc} has no shell block"


def test_the_docs_commands_run_from_a_fresh_clone(tmp_path: Path) -> None:
    shared = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SHARED_SITE=shared, MPLBACKEND="Agg",
               BASE_PYTHON=os.path.realpath(sys.executable),
               PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix)))
    subprocess.run(["git", "clone", "-q", str(ROOT), "jetflow"], cwd=tmp_path, check=True)
    subprocess.run(["bash", "-c", PREPARE_VENV + "prepare_venv"], cwd=tmp_path / "jetflow", env=env, check=True)
    ran: set[str] = set()
    report, failed = [], []
    for doc in DOCS:
        steps = plan(doc, ran)
        home = tmp_path / doc.replace("/", "-").removesuffix(".md")  # own-task.md clones its own copy here
        home.mkdir()
        script = ["set -uo pipefail", "failed=0", PREPARE_VENV, f"cd {shlex.quote(str(tmp_path / 'jetflow'))}"
                  if not any(line.startswith("git clone") for line, _, _ in steps) else f"cd {shlex.quote(str(home))}"]
        for line, command, why in steps:
            if command is None:
                report.append(f"{doc}: skipped `{line}`: {why}")
                continue
            command = command.format(root=shlex.quote(str(ROOT)), tmp=shlex.quote(str(home)))
            said = shlex.quote(line)
            script += [f"echo {shlex.quote('+ ' + command)}", "SECONDS=0",
                       f"if {command}; then echo \"[docs] {doc}: ran $SECONDS s: \"{said}; "
                       f"else echo \"[docs] {doc}: FAILED (exit $?) after $SECONDS s: \"{said}; failed=1; fi"]
        script.append("exit $failed")
        done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=home, env=env, capture_output=True, text=True)
        report += [r for r in done.stdout.splitlines() if r.startswith("[docs]")]
        if done.returncode:
            failed.append(f"{doc} (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    print("\n".join(report))
    assert not failed, "\n\n".join(failed)
