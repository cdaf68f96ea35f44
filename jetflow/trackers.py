"""Experiment trackers: every sink a run's metrics, config and report figures go to besides
metrics.jsonl (run.loggers). The one module that imports wandb and mlflow (lazily, with an install
hint); jetflow.metrics_log hands each metrics row to `Trackers.log`.

    tensorboard   <run>/tensorboard/ event files (torch's SummaryWriter; a core dependency)
    wandb         W&B, offline unless WANDB_MODE says otherwise: <run>/wandb/offline-run-*/run-<id>.wandb
                  (`wandb sync <run>/wandb` uploads it later)
    mlflow        MLflow's local store, no server: <run>/mlruns/mlflow.db (SQLite) with the artifacts in
                  <run>/mlruns/artifacts, or run.mlflow_tracking_uri

A resumed run continues the same W&B and MLflow runs: their ids are kept in <run>/trackers.json, which
also says where they are (and that TensorBoard is on), so the end-of-run report (jetflow.run.report)
sends its figures to every tracker the run had.
Trackers are derived from the run like metrics.jsonl: one that fails is turned off with a warning and
the run goes on (the rows of metrics.jsonl have every metric).

Metric names: a row's key, prefixed by its phase unless it is an RL row or carries the prefix already
(`loss` -> `sft/loss` for a warm-up row, `eval/pass@1` stays); each row also carries its step under
`step` / `sft/step` / `eval/step` in W&B (whose own step counts the rows). MLflow allows only
letters, digits and `_-. :/` in a name: other characters become `_` (`eval/pass@1` -> `eval/pass_1`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import logging
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Iterable

from jetflow.errors import MissingDependencyError

LOGGERS = ("tensorboard", "wandb", "mlflow")
IDS_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
INSTALL_HINT = "pip install 'jetflow[trackers]' (or bash scripts/install.sh all)"


def warn(message: str) -> None:
    print(f"[jetflow] warning: {message}", file=sys.stderr)


def unusable(names: Iterable[str]) -> str | None:
    """Why a run cannot log to trackers `names` (an unknown name, a library not installed), or None."""
    if unknown := [n for n in names if n not in LOGGERS]:
        return f"unknown logger(s) {', '.join(map(repr, unknown))}; valid loggers are {', '.join(LOGGERS)}"
    if absent := missing(names):
        return f"{', '.join(absent)} not installed: {INSTALL_HINT}"
    return None


def missing(names: Iterable[str]) -> list[str]:
    """The trackers among `names` whose library is not installed (found, not imported: importing
    wandb or mlflow takes seconds)."""
    return [n for n in names if n in ("wandb", "mlflow") and importlib.util.find_spec(n) is None]


def _library(name: str):
    """Import wandb or mlflow: the one place, with the install hint when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependencyError(f"run.loggers: {name} is not installed ({e}): {INSTALL_HINT}") from None


def tag(phase: str, key: str) -> str:
    """A metric's name in every tracker (see the module docstring)."""
    return key if phase == "rl" or key.startswith(phase + "/") else f"{phase}/{key}"


def step_key(phase: str) -> str:
    return "step" if phase == "rl" else f"{phase}/step"


def mlflow_name(name: str) -> str:
    return re.sub(r"[^\w\-. :/]", "_", name)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"train.lr": "0.001", ...}: a nested config as MLflow parameters."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


class Trackers:
    """The run's trackers, opened (or continued) together.

    run_dir: the run directory (trackers.json, tensorboard/, wandb/, mlruns/ go there).
    loggers: names from LOGGERS. config: the run's config as a dict (logged by W&B and MLflow).
    project: the W&B project and the MLflow experiment. run_name: their run's name."""

    def __init__(self, run_dir: str | Path, loggers: Iterable[str] = (), config: dict | None = None,
                 project: str = "jetflow", run_name: str | None = None, mlflow_tracking_uri: str = ""):
        self.run_dir = Path(run_dir)
        self.sinks: dict[str, _TensorBoard | _Wandb | _Mlflow] = {}
        ids = read_ids(self.run_dir)
        name = run_name or self.run_dir.name
        for logger in dict.fromkeys(loggers):
            opener = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}[logger]
            if logger in ("wandb", "mlflow"):
                _library(logger)  # a missing library is the user's to fix, not a warning
            try:
                self.sinks[logger] = opener(self.run_dir, config or {}, project, name, mlflow_tracking_uri,
                                            ids.get(logger, {}))
            except Exception as e:  # noqa: BLE001 - a tracker is derived: the run goes on without it
                warn(f"{logger} could not start ({type(e).__name__}: {e}); it is off for this run")
        ids = {**ids, **{k: s.ids for k, s in self.sinks.items() if s.ids}}
        if any(s.ids for s in self.sinks.values()):
            write_ids(self.run_dir, ids)

    def log(self, step: int, metrics: dict[str, float | None], phase: str = "rl") -> None:
        """One metrics row (None: a non-finite value, left out)."""
        named = {tag(phase, k): v for k, v in metrics.items() if v is not None}
        self._each("log", step, named, phase)

    def log_files(self, paths: Iterable[Path], folder: str = "report") -> None:
        """Files (the report's figures and its report.md) as artifacts / images of the tracker runs."""
        self._each("log_files", [Path(p) for p in paths], folder)

    def _each(self, method: str, *args) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # noqa: BLE001 - a full disk, a lost mount: metrics.jsonl has every row
                warn(f"{name} could not be written ({type(e).__name__}: {e}); it is off for the rest of this run")
                self._close(name)

    def _close(self, name: str) -> None:
        sink = self.sinks.pop(name)
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - already reported, or nothing left to lose
            pass

    def close(self) -> None:
        for name in list(self.sinks):
            self._close(name)


def read_ids(run_dir: Path) -> dict:
    """trackers.json: {"tensorboard": {"dir"}, "wandb": {"id", "project", "mode"}, "mlflow": {"run_id",
    "tracking_uri"}}
    ({} when absent or damaged: a damaged file starts new tracker runs, with a warning)."""
    path = run_dir / IDS_FILE
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text())
        if isinstance(ids, dict):
            return ids
    except (OSError, ValueError):
        pass
    warn(f"{path} is damaged; new tracker runs are started")
    return {}


def write_ids(run_dir: Path, ids: dict) -> None:
    from jetflow.writes import atomic_write_text
    atomic_write_text(run_dir / IDS_FILE, json.dumps(ids, indent=2) + "\n", "the trackers' run ids")


def publish_report(run_dir: str | Path, paths: Iterable[Path]) -> None:
    """Send the report's files to the trackers that trackers.json names (TensorBoard: its figures)."""
    ids = read_ids(Path(run_dir))
    loggers = [n for n in LOGGERS if n in ids]
    if not loggers or missing(loggers):
        return
    trackers = Trackers(run_dir, loggers, project=ids.get("wandb", {}).get("project", "jetflow"),
                        mlflow_tracking_uri=ids.get("mlflow", {}).get("tracking_uri", ""))
    try:
        trackers.log_files(paths)
    finally:
        trackers.close()


class _TensorBoard:
    def __init__(self, run_dir: Path, config, project, name, uri, ids):
        from torch.utils.tensorboard import SummaryWriter  # tensorboard is a core dependency
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))
        self.ids = {"dir": TENSORBOARD_DIR}  # in trackers.json: the report's figures come here too

    def log(self, step: int, named: dict[str, float], phase: str) -> None:
        for k, v in named.items():
            self.writer.add_scalar(k, v, step)

    def log_files(self, paths: list[Path], folder: str) -> None:
        from matplotlib.image import imread
        for p in paths:
            if p.suffix == ".png":
                self.writer.add_image(f"{folder}/{p.stem}", imread(p)[..., :3], dataformats="HWC")  # (H, W, 3)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, config: dict, project: str, name: str, uri, ids: dict):
        wandb = _library("wandb")
        mode = os.environ.get("WANDB_MODE", ids.get("mode", "offline"))
        run_id = ids.get("id") or secrets.token_hex(4)  # W&B ids: [a-z0-9]
        project = ids.get("project", project)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False, disable_git=True)
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                              settings=settings, reinit="create_new")
        if config:
            self.run.config.update(config, allow_val_change=True)
        self.ids = {"id": run_id, "project": project, "mode": mode}
        self._wandb = wandb

    def log(self, step: int, named: dict[str, float], phase: str) -> None:
        self.run.log({step_key(phase): step, **named})

    def log_files(self, paths: list[Path], folder: str) -> None:
        images = {f"{folder}/{p.stem}": self._wandb.Image(str(p)) for p in paths if p.suffix == ".png"}
        if images:
            self.run.log(images)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, config: dict, project: str, name: str, uri: str, ids: dict):
        _library("mlflow")
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its "Creating tables" lines
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        store = (run_dir / MLFLOW_DIR).resolve()
        uri = ids.get("tracking_uri") or uri
        if not uri:
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        run_id = ids.get("run_id")
        if run_id:  # a resume: the same run, running again
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                project, artifact_location=(store / "artifacts").as_uri() if store.is_dir() else None)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(k, v) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        if config:  # every session's config (a resume may change allowed keys; parameters cannot change)
            self.client.log_dict(run_id, config, "config.json")
        self.run_id, self.ids = run_id, {"run_id": run_id, "tracking_uri": uri}

    def log(self, step: int, named: dict[str, float], phase: str) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in named.items()])

    def log_files(self, paths: list[Path], folder: str) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), folder)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
