"""The in-process placement: the trainer and its rollout engine in this process. Under torchrun
(WORLD_SIZE > 1) every rank holds one of each and runs its share of each step's prompts
(jetflow.distributed); rank 0 alone writes logs, checkpoints and the summary."""

from __future__ import annotations

from pathlib import Path

from jetflow.config import Config, Derived
from jetflow.distributed import DataParallel
from jetflow.run.build import RunInputs
from jetflow.run.loop import RLLoop
from jetflow.run.sides import TrainerSide


class LocalPlacement:
    def __init__(self, cfg: Config, derived: Derived, inputs: RunInputs, dp: DataParallel, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.side = TrainerSide(cfg, derived, inputs, dp)
        self.dp = self.side.dp  # the data-parallel view (Megatron tensor parallelism splits the world further)
        self.is_main, self.data_parallel_size = self.dp.is_main, self.dp.world_size
        self.loop: RLLoop | None = None

    def __enter__(self) -> "LocalPlacement":
        return self

    def __exit__(self, *exc) -> None:
        close = getattr(self.loop.rollout if self.loop is not None else None, "close", None)
        if close is not None:  # an engine in a process of its own (rollout.max_staleness > 0)
            close()

    def describe(self) -> str:
        model = self.side.model  # with LoRA its frozen FP8 linears hold bytes, not parameters: the architecture's count
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora = f", LoRA rank {self.cfg.model.lora.rank}: {trained / 1e6:.2f}M trained" if self.cfg.model.lora.rank else ""
        if lora and self.cfg.train.backend == "fsdp":  # nothing sharded (jetflow.run.megatron_side.build_trainer_model)
            lora += ", base and adapters replicated on every rank"
        return (f"model={self.cfg.model.path} ({model.config.num_parameters() / 1e6:.1f}M params{lora})  "
                f"data-parallel ranks={self.dp.world_size}")

    def restore(self, checkpoint: Path) -> dict:
        return self.side.restore(checkpoint)

    def warmup_step(self, step: int) -> dict:
        return self.side.warmup_step(step)

    def save(self, step: int, sft_done: bool, warmup_step: int | None = None) -> None:
        ahead = self.loop.ahead if self.loop is not None else None  # rollout.max_staleness > 0
        if self.loop is not None:
            self.loop.sync_paused()  # in-flight updates: the paused batch takes its update first
        self.side.save(self.run_dir, step, sft_done, warmup_step, ahead.in_flight(step) if ahead else None)

    def build_loop(self) -> RLLoop:
        self.loop = self.side.rl_loop(self.run_dir)
        return self.loop

    def step_metrics(self, metrics: dict) -> dict:
        return metrics

    def skipped_steps(self) -> int:
        return self.side.trainer.skipped_steps

    def barrier(self) -> None:
        self.dp.barrier()

    def any_rank(self, flag: bool) -> bool:
        return self.dp.sum(float(flag)) > 0  # a single process: its own flag
