"""`jetflow train`: check the config, choose the placement, run the sequence.

    run.orchestrator=local   this process, or one rank of torchrun (jetflow.run.local)
    run.orchestrator=ray     trainer workers and rollout engines as Ray actors (jetflow.run.ray_placement)
"""

from __future__ import annotations

from pathlib import Path

import torch

from jetflow.config import Config, Derived
from jetflow.distributed import SINGLE, DataParallel, init_from_env, shutdown
from jetflow.run.build import RunInputs
from jetflow.run.files import run_directory
from jetflow.run.sequence import Placement, run_sequence
from jetflow.run.stop import StopRequests
from jetflow.run.validate import validate_run


def train(cfg: Config) -> Path:
    """Run (or resume) the configured RL run; returns its directory (see jetflow.run.files). Stop
    requests are caught from the start to the end, so a signal during the model load or the teardown
    also ends the run cleanly."""
    with StopRequests() as stop:
        return _train(cfg, stop)


def _train(cfg: Config, stop: StopRequests) -> Path:
    # the config's derived values (recipe, numerics, ...) and the run's inputs (task, tokenizer, ...), read once
    derived, inputs = validate_run(cfg)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    on_ray = cfg.run.orchestrator == "ray"
    dp = SINGLE if on_ray else init_from_env(cfg.model.device)  # Ray: the driver is one process
    completed = False
    try:
        # the directory's LOCK and config.yaml, then the model load
        with run_directory(cfg, dp) as run_dir, place(cfg, derived, inputs, dp, run_dir) as placement:
            stop.take_back()  # ray.init installs a SIGTERM handler of its own (sys.exit)
            run_sequence(cfg, derived, placement, run_dir, stop)
        completed = True
        return run_dir
    finally:
        if not on_ray:
            shutdown(dp, completed)


def place(cfg: Config, derived: Derived, inputs: RunInputs, dp: DataParallel, run_dir: Path) -> Placement:
    if cfg.run.orchestrator == "ray":
        from jetflow.run.ray_placement import RayPlacement
        return RayPlacement(cfg, derived, inputs, run_dir)
    from jetflow.run.local import LocalPlacement
    return LocalPlacement(cfg, derived, inputs, dp, run_dir)
