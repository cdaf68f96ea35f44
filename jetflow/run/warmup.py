"""The supervised warm-up, one step at a time: a short supervised phase on the task's reference
answers before RL (for models trained from scratch). The run sequence drives it step by step, so a
stop request is answered after the current step, its rows are logged as they come, and a checkpoint
in the middle of it (its optimizer and schedule under `state_dict`) resumes it bit for bit."""

from __future__ import annotations

from dataclasses import replace

import torch

from jetflow.config import Config, MemorySavers
from jetflow.distributed import SINGLE, DataParallel
from jetflow.rl.experience import pack_experience
from jetflow.train.trainer import Trainer

SFT_INDEX_OFFSET = 10_000_000  # supervised warm-up draws problems far from the RL prompts


class Warmup:
    """train.sft_warmup_steps supervised steps with their own AdamW and schedule (lr train.sft_lr, 10%
    linear warm-up, cosine to 0.1), on the trainer's model, with the run's memory savers."""

    def __init__(self, cfg: Config, trainer_model, task, encode, tokenizer, dp: DataParallel = SINGLE,
                 savers: MemorySavers | None = None):
        n = cfg.train.sft_warmup_steps
        sft_cfg = replace(cfg.train, lr=cfg.train.sft_lr, warmup_steps=max(1, n // 10), steps=n, min_lr_ratio=0.1,
                          micro_batch_size=cfg.train.sft_batch_size)
        self.trainer = Trainer(trainer_model, sft_cfg, cfg.algo, total_steps=n, dp=dp, savers=savers)
        self.cfg, self.task, self.encode, self.tokenizer = cfg, task, encode, tokenizer
        self.mine = dp.shard(cfg.train.sft_batch_size)  # this rank's rows of each batch

    def step(self, step: int) -> dict[str, float]:
        """Warm-up step `step` (its problems follow from the index alone); returns its metrics."""
        cfg, tok, bs = self.cfg, self.tokenizer, len(self.mine)
        end = self.task.stop[0] if self.task.stop else ""
        problems = self.task.problems(SFT_INDEX_OFFSET + step * cfg.train.sft_batch_size + self.mine.start, bs,
                                      cfg.run.seed)
        prompts = [self.encode(p) for p in problems]
        answers = [tok.encode(p.answer + end) + [tok.eos_token_id] for p in problems]
        zeros = torch.zeros(bs)
        exp = pack_experience(prompts, answers, [[0.0] * len(a) for a in answers], zeros, zeros, tok.pad_token_id,
                              cfg.model.device)
        return self.trainer.sft_step(exp)

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)
