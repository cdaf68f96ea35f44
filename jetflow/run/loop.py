"""One RL step, backend-agnostic: sync -> rollout -> rewards -> advantages -> old log-probs ->
mismatch metrics -> rollout correction -> policy update.

The loop talks to three things: a trainer (`jetflow.train.protocol.PolicyTrainer`: the Trainer in this
process, or Ray trainer workers), a rollout side (`jetflow.rollout.types.RolloutEngineSide`: an engine
that generates with the weights it was last handed) and a task. It checks at every hand-off that the
rollout ran the weight version the trainer is at.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from jetflow.config import Config, resolve_correction
from jetflow.distributed import SINGLE, DataParallel
from jetflow.rl import apply_correction, group_advantages, low_prob_metrics, mismatch_metrics
from jetflow.rl.correction import ROW_LOCAL
from jetflow.rl.experience import Experience, pack_experience
from jetflow.rollout.types import RolloutEngineSide
from jetflow.sync import StaleWeightsError
from jetflow.tasks import Problem, Reward, RewardError, Task
from jetflow.train.protocol import KVCalibration, PolicyTrainer


def observe_kv_amax(logprobs_fn: Callable[[Experience], torch.Tensor], quantizer: KVCalibration, prompts: list[list[int]],
                    pad_id: int, device) -> None:
    """Let an FP8 KV quantizer observe K/V amax over a trainer forward of `prompts` (each prompt's
    last token stands in as the response); `quantizer.recalibrate()` then turns it into scales."""
    zeros = torch.zeros(len(prompts))
    exp = pack_experience([p[:-1] for p in prompts], [p[-1:] for p in prompts], [[0.0]] * len(prompts),
                          zeros, zeros, pad_id, device=device)
    quantizer.calibrating = True
    try:
        logprobs_fn(exp)
    finally:
        quantizer.calibrating = False


def request_seed(run_seed: int, step: int, index: int) -> int:
    """Per-request sampling seed: a run reproduces, whatever the batch composition."""
    return (run_seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


class RLLoop:
    def __init__(self, cfg: Config, trainer: PolicyTrainer, rollout: RolloutEngineSide, task: Task,
                 encode_prompt: Callable[[Problem], list[int]], pad_id: int, fingerprint: str | None,
                 kv_quantizer: KVCalibration | None = None, dp: DataParallel = SINGLE):
        self.cfg, self.trainer, self.rollout, self.task = cfg, trainer, rollout, task
        self.dp = dp  # data-parallel ranks: each runs its share of the step's prompt groups
        self.encode_prompt, self.pad_id, self.fingerprint = encode_prompt, pad_id, fingerprint
        self.kv_quantizer = kv_quantizer  # the trainer's FP8 KV quantizer (precision.kv_cache_fp8), or None
        self.correction = resolve_correction(cfg)
        # pi_old from the training forward itself: one update per rollout and per-sequence weights.
        self.old_logprobs_from_update = (cfg.algo.old_logprobs == "auto" and cfg.algo.ppo_epochs == 1
                                         and self.correction in ROW_LOCAL)
        self.last_experience: Experience | None = None
        self._eval_problems: list[Problem] | None = None  # the held-out problems, drawn once
        self._eval_sync: dict[str, float] | None = None  # an evaluation's weight update, reported by the next step

    def sync(self) -> dict[str, float]:
        """Hand the trainer's current weights to the rollout side unless it already has them (a
        skipped NaN step leaves the version unchanged)."""
        if self.rollout.weight_version == self.trainer.version:
            return {"time/sync": 0.0, "sync/bytes": 0.0}
        t0 = time.perf_counter()
        kv_scales = None
        if self.kv_quantizer is not None:  # per-step recalibration from the trainer's latest forward,
            kv_scales = self.kv_quantizer.recalibrate(self.dp)  # one scale per layer across data-parallel ranks
        update = self.trainer.weight_update(self.cfg.precision.mode, self.fingerprint, kv_scales)
        self.rollout.load_weights(update)
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(update.nbytes())}

    def _calibrate_kv(self, prompts: list[list[int]]) -> None:
        """First FP8 KV scales: a trainer forward over the prompts, before anything was generated."""
        observe_kv_amax(self.trainer.compute_logprobs, self.kv_quantizer, prompts, self.pad_id, self.cfg.model.device)

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation with the current weights: greedy pass@1 and mean reward over the
        task's held-out problems (eval.num_prompts of them; each rank decodes its share)."""
        if self._eval_problems is None:
            self._eval_problems = self.task.held_out_problems(self.cfg.eval.num_prompts, self.cfg.run.seed)
        problems, rank, ranks = self._eval_problems, self.dp.rank, self.dp.world_size
        problems_here = problems[len(problems) * rank // ranks:len(problems) * (rank + 1) // ranks]
        prompts = [self.encode_prompt(p) for p in problems_here]
        t0 = time.perf_counter()
        if self.kv_quantizer is not None and not self.kv_quantizer.calibrated:
            self._calibrate_kv(prompts)  # before the first step: scales from the evaluation's prompts
        self._eval_sync = self.sync()  # reported with the next step, which then finds the weights in place
        correct = reward = 0.0
        if prompts:
            out = self.rollout.generate(prompts, [0] * len(prompts), greedy=True)
            scores = self._score(problems_here, out.texts)
            correct, reward = float(sum(s.correct for s in scores)), float(sum(s.total for s in scores))
        totals = self.dp.sum_dict({"correct": correct, "reward": reward})
        n = max(len(problems), 1)
        return {"eval/pass@1": totals["correct"] / n, "eval/reward": totals["reward"] / n,
                "eval/num_prompts": float(len(problems)), "time/eval": time.perf_counter() - t0}

    def _score(self, problems: list[Problem], texts: list[str]) -> list[Reward]:
        """The task's rewards for one batch. A reward function's error (RewardError: one line naming the
        function and the row) ends the step on every rank alike, before the update, so the run can
        checkpoint the step's starting state (jetflow.run.sequence)."""
        error = None
        try:
            scores = self.task.score_batch(problems, texts)
        except RewardError as e:
            error = e
        if self.dp.enabled and self.dp.any_in_world(error is not None) and error is None:
            raise RewardError("a reward function failed on another data-parallel rank (its line is in that rank's "
                              "log)")
        if error is not None:
            raise error
        return scores

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        t_start = time.perf_counter()
        n, group = cfg.train.prompts_per_step, cfg.rollout.group_size
        mine = self.dp.shard(n)  # this rank's prompt groups (all of them in a single process)
        problems = self.task.problems(step * n + mine.start, len(mine), cfg.run.seed)
        prompts = [self.encode_prompt(p) for p in problems for _ in range(group)]
        if self.kv_quantizer is not None and not self.kv_quantizer.calibrated:
            self._calibrate_kv(prompts[::group])
        synced = self.sync()
        if self._eval_sync is not None and not synced["sync/bytes"]:
            synced = self._eval_sync  # this step's weights went over for the evaluation before it
        self._eval_sync = None
        metrics.update(synced)

        # Rollout: each prompt group_size times.
        first = mine.start * group  # seeds follow the global request index: any rank count samples alike
        seeds = [request_seed(cfg.run.seed, step, first + i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        out = self.rollout.generate(prompts, seeds)
        metrics["time/rollout"] = time.perf_counter() - t0
        if out.weight_version != self.trainer.version:
            raise StaleWeightsError(f"rollout used weight version {out.weight_version}, "
                                    f"trainer is at {self.trainer.version}")

        # Rewards and group advantages.
        scores = self._score([problems[i // group] for i in range(len(out.texts))], out.texts)
        rewards = torch.tensor([s.total for s in scores], dtype=torch.float32)
        advantages = group_advantages(rewards, group, cfg.algo.adv_norm)
        exp = pack_experience(prompts, out.token_ids, out.logprobs, rewards, advantages, self.pad_id,
                              device=cfg.model.device, routed_experts=out.routed_experts)

        # The trainer's log-probs of the same tokens under the same weight version (pi_old), the
        # rollout correction from them, and the update(s).
        if self.kv_quantizer is not None:
            self.kv_quantizer.calibrating = True  # the next trainer forward's K/V amax sets the next step's scales
        if self.old_logprobs_from_update:
            train_metrics, exp.old_logprobs = self.trainer.train_step_on_policy(
                exp, cfg.rollout.temperature, self.correction, cfg.algo.correction_params)
            metrics["time/old_logprobs"] = 0.0  # came with the training forward
        else:
            t0 = time.perf_counter()
            exp.old_logprobs = self.trainer.compute_logprobs(exp, cfg.rollout.temperature)
            metrics["time/old_logprobs"] = time.perf_counter() - t0
        if self.kv_quantizer is not None:
            self.kv_quantizer.calibrating = False
        metrics.update(mismatch_metrics(exp.rollout_logprobs, exp.old_logprobs, exp.response_mask))
        # the share of sampled tokens the rollout gave p < 0.1, and the mismatch on them and on the rest
        metrics.update(low_prob_metrics(exp.rollout_logprobs, exp.old_logprobs, exp.response_mask))
        correction = apply_correction(self.correction, exp.rollout_logprobs, exp.old_logprobs, exp.response_mask,
                                      **cfg.algo.correction_params)
        exp.is_weights = correction.weights
        metrics.update(correction.metrics)
        if self.old_logprobs_from_update:
            metrics.update(train_metrics)
        else:
            for _ in range(cfg.algo.ppo_epochs):
                metrics.update(self.trainer.train_step(exp, cfg.rollout.temperature))
        self.last_experience = exp

        lengths = [len(t) for t in out.token_ids]
        generated = sum(lengths)
        mask = exp.response_mask
        metrics.update({
            # the rollout's own log-perplexity of what it sampled (nats per token)
            "policy/rollout_log_ppl": float(-(exp.rollout_logprobs * mask).sum() / mask.sum().clamp(min=1)),
            "reward/mean": rewards.mean().item(),
            "reward/accuracy": sum(s.correct for s in scores) / len(scores),
            "reward/format": sum(s.format_ok for s in scores) / len(scores),
            # a custom task's reward functions, each before weighting
            **{f"reward/fn/{name}": sum(s.parts[name] for s in scores) / len(scores) for name in scores[0].parts},
            "response/length_mean": generated / len(lengths),
            "response/length_max": float(max(lengths)),
            "response/truncated_frac": sum(r == "length" for r in out.finish_reasons) / len(lengths),
            "throughput/rollout_tokens_per_s": generated / max(metrics["time/rollout"], 1e-9),
            "weight_version": float(self.trainer.version),
        })
        metrics["time/step"] = time.perf_counter() - t_start
        metrics["throughput/tokens_per_s"] = float(exp.attention_mask.sum()) / metrics["time/step"]
        if self.dp.enabled:  # rank means (train/* are global already); throughput adds up over ranks
            metrics = self.dp.mean_dict(metrics)
            for key in ("throughput/tokens_per_s", "throughput/rollout_tokens_per_s"):
                metrics[key] *= self.dp.world_size
        return metrics
