"""One RL step, backend-agnostic: sync -> rollout -> rewards (overlong shaping; dynamic sampling's
refills) -> reference log-probs -> advantages -> old log-probs -> mismatch metrics -> rollout
correction -> policy update.

The loop talks to three things: a trainer (`jetflow.train.protocol.PolicyTrainer`: the Trainer in this
process, or Ray trainer workers), a rollout side (`jetflow.rollout.types.RolloutEngineSide`: an engine
that generates with the weights it was last handed) and a task. It checks at every hand-off that the
rollout ran the weight version it was meant to: the trainer's, or under rollout.max_staleness = k > 0 the one
the trainer had k steps before (the batches are then generated ahead, in the engine's own process:
jetflow.run.ahead).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from jetflow.config import Config, Derived, RunConfig
from jetflow.distributed import SINGLE, DataParallel
from jetflow.rl import apply_correction, group_advantages, low_prob_metrics, mismatch_metrics
from jetflow.rl.correction import ROW_LOCAL
from jetflow.rl.experience import Experience, pack_experience
from jetflow.rl.kl import kl_estimate
from jetflow.rl.shaping import informative_groups, overlong_penalty
from jetflow.rollout.conversation import multiturn_metrics
from jetflow.rollout.types import RolloutEngineSide, Rollouts
from jetflow.run.ahead import Batch, Requests, RolloutsAhead
from jetflow.run.inflight import staleness_metrics, swap_gap_metrics
from jetflow.run.staleness_split import MismatchSplit
from jetflow.sync import StaleWeightsError
from jetflow.tasks import Problem, Reward, RewardError, Task, reward_part_means
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


def rl_seed(run: RunConfig) -> int:
    """The seed of the RL phase's draws (sampling, training and held-out problems): run.rl_seed, else run.seed."""
    return run.seed if run.rl_seed is None else run.rl_seed


def request_seed(run_seed: int, step: int, index: int) -> int:
    """Per-request sampling seed: a run reproduces, whatever the batch composition."""
    return (run_seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


def refill_seed(run_seed: int, round_: int) -> int:
    """The problem stream of dynamic sampling's refill round `round_` >= 1: a function of the run seed and
    the round alone, so a resumed run draws the same refills (no position counter to save)."""
    return (run_seed + round_ * 1_000_033) % (2**31 - 1)


class Sampled:
    """Rollouts of whole prompt groups with their scores and (shaped) rewards, in request order."""

    def __init__(self, prompts: list[list[int]], out: Rollouts, scores: list[Reward], rewards: torch.Tensor):
        self.prompts, self.out, self.scores, self.rewards = prompts, out, scores, rewards  # rewards (N,)

    def groups(self, keep: list[int], group: int) -> "Sampled":
        """The samples of groups `keep` (indices into this batch's groups), in that order."""
        rows = [g * group + j for g in keep for j in range(group)]
        return Sampled([self.prompts[i] for i in rows], self.out.select(rows), [self.scores[i] for i in rows],
                       self.rewards[rows])

    @staticmethod
    def concat(parts: list["Sampled"]) -> "Sampled":
        return Sampled([p for s in parts for p in s.prompts], Rollouts.concat([p.out for p in parts]),
                       [x for s in parts for x in s.scores], torch.cat([s.rewards for s in parts]))


def sampled_counts(out: Rollouts) -> list[int]:
    """Tokens the model sampled in each response (a conversation's observations left out)."""
    if out.token_masks is None:
        return [len(t) for t in out.token_ids]
    return [sum(m) for m in out.token_masks]


class RLLoop:
    def __init__(self, cfg: Config, derived: Derived, trainer: PolicyTrainer, rollout: RolloutEngineSide, task: Task,
                 encode_prompt: Callable[[Problem], list[int]], pad_id: int,
                 kv_quantizer: KVCalibration | None = None, dp: DataParallel = SINGLE,
                 ahead: RolloutsAhead | None = None):
        self.cfg, self.trainer, self.rollout, self.task = cfg, trainer, rollout, task
        self.seed = rl_seed(cfg.run)
        self.dp = dp  # data-parallel ranks: each runs its share of the step's prompt groups
        self.encode_prompt, self.pad_id, self.precision = encode_prompt, pad_id, derived.precision
        self.kv_quantizer = kv_quantizer  # the trainer's FP8 KV quantizer (precision.kv_cache_fp8), or None
        self.correction = derived.correction  # `auto` resolved by jetflow.config.derive
        # pi_old from the training forward itself: one update per rollout and per-sequence weights.
        # (a KL penalty in the reward needs pi_old before the advantages: a separate forward)
        self.kl_in_reward = cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "reward"
        self.reward_seconds = 0.0  # the current step's scoring time (time/reward)
        self.old_logprobs_from_update = (cfg.algo.old_logprobs == "auto" and cfg.algo.ppo_epochs == 1
                                         and self.correction in ROW_LOCAL and not self.kl_in_reward)
        self.with_reference = bool(cfg.algo.kl_coef or cfg.algo.log_ref_kl)
        self._reference_bytes: float | None = None
        self.last_experience: Experience | None = None
        self._eval_problems: list[Problem] | None = None  # the held-out problems, drawn once
        self._eval_sync: dict[str, float] | None = None  # an evaluation's weight update, reported by the next step
        self.ahead = ahead  # rollout.max_staleness > 0: the batches generated ahead (jetflow.run.ahead)
        self.batch: Batch | None = None  # the step's batch from `ahead`
        # rollout.split_mismatch: the copies of the updates sent that score stale batches (mismatch/numerics_*, staleness_*)
        self.split = MismatchSplit(cfg, derived, trainer) if ahead is not None and cfg.rollout.split_mismatch else None

    def sync(self) -> dict[str, float]:
        """Hand the trainer's current weights to the rollout side unless it already has them (a
        skipped NaN step leaves the version unchanged)."""
        if self.rollout.weight_version == self.trainer.version:
            return {"time/sync": 0.0, "sync/bytes": 0.0}
        t0 = time.perf_counter()
        kv_scales = None
        if self.kv_quantizer is not None:  # per-step recalibration from the trainer's latest forward,
            kv_scales = self.kv_quantizer.recalibrate(self.dp)  # one scale per layer across data-parallel ranks
        update = self.trainer.weight_update(self.precision.mode.value, self.precision.fingerprint, kv_scales)
        if self.split is not None:
            self.split.keep(update)
        self.rollout.load_weights(update)
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(update.nbytes())}

    def _calibrate_kv(self, prompts: list[list[int]]) -> None:
        """First FP8 KV scales: a trainer forward over the prompts, before anything was generated."""
        observe_kv_amax(self.trainer.compute_logprobs, self.kv_quantizer, prompts, self.pad_id, self.cfg.model.device)

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation with the current weights: greedy pass@1 and mean reward over the
        task's held-out problems (eval.num_prompts of them; each rank decodes its share)."""
        if self._eval_problems is None:
            self._eval_problems = self.task.held_out_problems(self.cfg.eval.num_prompts, self.seed)
        problems, rank, ranks = self._eval_problems, self.dp.rank, self.dp.world_size
        problems_here = problems[len(problems) * rank // ranks:len(problems) * (rank + 1) // ranks]
        prompts = [self.encode_prompt(p) for p in problems_here]
        t0 = time.perf_counter()
        if self.kv_quantizer is not None and not self.kv_quantizer.calibrated:
            self._calibrate_kv(prompts)  # before the first step: scales from the evaluation's prompts
        self._keep_sync(self.sync())  # reported with the next step, which then finds the weights in place
        correct = reward = 0.0
        if prompts:
            out = self.rollout.generate(prompts, [0] * len(prompts), greedy=True,
                                        **self._conversations(problems_here))
            scores = self._score(problems_here, out)
            correct, reward = float(sum(s.correct for s in scores)), float(sum(s.total for s in scores))
        totals = self.dp.sum_dict({"correct": correct, "reward": reward})
        n = max(len(problems), 1)
        return {"eval/pass@1": totals["correct"] / n, "eval/reward": totals["reward"] / n,
                "eval/num_prompts": float(len(problems)), "time/eval": time.perf_counter() - t0}

    def _conversations(self, problems: list[Problem]) -> dict:
        """generate()'s keyword for a multi-turn run: the problems whose conversations the engine drives."""
        return {"problems": problems} if self.cfg.rollout.max_turns > 1 else {}

    def _score(self, problems: list[Problem], out: Rollouts) -> list[Reward]:
        """The task's rewards for one batch (a conversation's: its messages, plus its environment's rewards).
        A reward function's error (RewardError: one line naming the function and the row) ends the step on
        every rank alike, before the update, so the run can checkpoint the step's starting state
        (jetflow.run.sequence)."""
        error, t0 = None, time.perf_counter()
        try:
            if out.completions is None:
                scores = self.task.score_batch(problems, out.texts)
            else:
                scores = self.task.score_batch(problems, out.completions, env_rewards=out.env_rewards)
        except RewardError as e:
            error = e
        self.reward_seconds += time.perf_counter() - t0
        if self.dp.enabled and self.dp.any_in_world(error is not None) and error is None:
            raise RewardError("a reward function failed on another data-parallel rank (its line is in that rank's "
                              "log)")
        if error is not None:
            raise error
        return scores

    def _step_problems(self, step: int) -> tuple[list[Problem], list[list[int]], int]:
        """This rank's problems of step `step`, their prompts (each group_size times) and the global index of the
        first request (seeds follow it: any rank count samples alike)."""
        n, group = self.cfg.train.prompts_per_step, self.cfg.rollout.group_size
        mine = self.dp.shard(n)  # this rank's prompt groups (all of them in a single process)
        problems = self.task.problems(step * n + mine.start, len(mine), self.seed)
        return problems, [self.encode_prompt(p) for p in problems for _ in range(group)], mine.start * group

    def _seeds(self, step: int, first: int, n: int, round_: int) -> list[int]:
        """The sampling seeds of n requests from global index `first`; round r's after the step's earlier rounds'."""
        offset = round_ * self.cfg.train.prompts_per_step * self.cfg.rollout.group_size
        return [request_seed(self.seed, step, offset + first + i) for i in range(n)]

    def _requests_of_step(self, step: int) -> Requests:
        """Step `step`'s round-0 requests, for the engine to generate ahead (jetflow.run.ahead)."""
        problems, prompts, first = self._step_problems(step)
        per_prompt = [problems[i // self.cfg.rollout.group_size] for i in range(len(prompts))]
        return Requests(prompts, self._seeds(step, first, len(prompts), 0),
                        self._conversations(per_prompt).get("problems"))

    def _sample(self, step: int, problems: list[Problem], prompts: list[list[int]], first: int,
                round_: int) -> Sampled:
        """Each prompt once (prompts: each problem's group_size times), scored; rewards with the overlong
        punishment. Under rollout.max_staleness > 0, round 0's batch was generated ahead (jetflow.run.ahead)."""
        cfg, group = self.cfg, self.cfg.rollout.group_size
        requests = [problems[i // group] for i in range(len(prompts))]
        if self.ahead is not None and round_ == 0:
            self.batch = self.ahead.take(step)
            out, expected = self.batch.out, self.batch.expected_version
        else:
            out = self.rollout.generate(prompts, self._seeds(step, first, len(prompts), round_),
                                        **self._conversations(requests))
            expected = self.trainer.version
        if out.weight_version != expected:
            raise StaleWeightsError(f"rollout used weight version {out.weight_version}, expected {expected} "
                                    f"(the trainer is at {self.trainer.version})")
        scores = self._score(requests, out)
        rewards = torch.tensor([s.total for s in scores], dtype=torch.float32)  # (N,)
        if cfg.algo.overlong_buffer:  # DAPO's soft overlong punishment
            lengths = torch.tensor(sampled_counts(out))
            rewards = rewards + overlong_penalty(lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer,
                                                 cfg.algo.overlong_penalty)
        return Sampled(prompts, out, scores, rewards)

    def _gather(self, step: int, problems: list[Problem], prompts: list[list[int]], first: int,
                metrics: dict[str, float]) -> tuple[Sampled, Sampled, int]:
        """This step's training samples: the first round's, or under algo.dynamic_sampling its groups with
        unequal rewards, refilled by rounds of new problems (at most dynamic_sampling_max_rounds more)
        until there are as many groups as problems; a step still short trains on the groups it has (on the
        first round's when none). Returns (the training samples, the first round's, tokens generated)."""
        cfg, group = self.cfg, self.cfg.rollout.group_size
        first_round = self._sample(step, problems, prompts, first, 0)
        generated = sum(sampled_counts(first_round.out))
        if cfg.algo.overlong_buffer:  # the mean reward the punishment took from the policy's own samples
            task_rewards = torch.tensor([s.total for s in first_round.scores], dtype=torch.float32)
            metrics["reward/overlong_penalty"] = float((first_round.rewards - task_rewards).mean())
        if not cfg.algo.dynamic_sampling:
            return first_round, first_round, generated
        kept: list[Sampled] = []
        wanted, n_kept, n_generated, round_, batch = len(problems), 0, 0, 0, first_round
        while True:
            keep = informative_groups(batch.rewards, group).nonzero().flatten().tolist()
            n_generated += len(problems)
            n_kept += len(keep)
            kept.append(batch.groups(keep[:wanted - sum(len(k.prompts) for k in kept) // group], group))
            round_ += 1
            if sum(len(k.prompts) for k in kept) // group >= wanted or round_ > cfg.algo.dynamic_sampling_max_rounds:
                break
            problems = self.task.problems(step * cfg.train.prompts_per_step + first // group, len(problems),
                                          refill_seed(self.seed, round_))
            batch = self._sample(step, problems, [self.encode_prompt(p) for p in problems for _ in range(group)],
                                 first, round_)
            generated += sum(sampled_counts(batch.out))
        sampled = Sampled.concat(kept)
        groups = len(sampled.prompts) // group
        metrics.update({"sampling/kept_group_frac": n_kept / n_generated, "sampling/rounds": float(round_),
                        "sampling/batch_groups_frac": groups / wanted})
        return (sampled if groups else first_round), first_round, generated

    def _kl_into_rewards(self, exp: Experience) -> dict[str, float]:
        """algo.kl_in=reward: each response's reward less kl_coef times its KL estimator summed over its
        tokens (pi_old against the reference, as verl's apply_kl_penalty), then the group advantages again."""
        cfg = self.cfg
        kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, cfg.algo.kl_estimator) * exp.response_mask  # (B, R)
        penalty = cfg.algo.kl_coef * kl.sum(dim=-1)  # (B,)
        exp.rewards = exp.rewards - penalty
        exp.advantages = group_advantages(exp.rewards.cpu(), cfg.rollout.group_size, cfg.algo.adv_norm).to(
            exp.rewards.device)
        return {"kl/reward_penalty": float(penalty.mean())}

    def step(self, step: int) -> dict[str, float]:
        """One RL step: sync, rollout, pi_old and the update(s); returns its metrics."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        t_start = time.perf_counter()
        problems, prompts, first = self._step_problems(step)
        if self.kv_quantizer is not None and not self.kv_quantizer.calibrated:
            self._calibrate_kv(prompts[::cfg.rollout.group_size])
        metrics.update(self._step_sync())
        if self.ahead is not None:  # the batch of step + max_staleness, under the weights just sent
            self.ahead.submit_through(step, self._requests_of_step)

        # Rollout: each prompt group_size times (and dynamic sampling's refills).
        t0, self.reward_seconds = time.perf_counter(), 0.0
        sampled, first_round, generated = self._gather(step, problems, prompts, first, metrics)
        metrics["time/reward"] = self.reward_seconds  # the task's scoring (a reward model's forward passes)
        metrics["time/rollout"] = time.perf_counter() - t0 - self.reward_seconds
        if self.ahead is not None:
            metrics.update(self._staleness_metrics(first_round.out))
        exp = self._experience(sampled, metrics)
        self._update(exp, metrics)
        self.last_experience = exp
        self._sample_metrics(exp, first_round, generated, metrics)
        metrics["time/step"] = time.perf_counter() - t_start
        metrics["throughput/tokens_per_s"] = float(exp.attention_mask.sum()) / metrics["time/step"]
        if self.dp.enabled:  # rank means (train/* are global already); throughput adds up over ranks
            metrics = self.dp.mean_dict(metrics)
            for key in ("throughput/tokens_per_s", "throughput/rollout_tokens_per_s"):
                metrics[key] *= self.dp.world_size
        return metrics

    def _staleness_metrics(self, out: Rollouts) -> dict[str, float]:
        """Under rollout.max_staleness > 0: how many versions old the step's sampled tokens are (jetflow.run.inflight),
        and how long each side waited for the other. time/rollout becomes the engine's time generating the batch
        (its wait is this process's idle time)."""
        assert self.ahead is not None and self.batch is not None
        inflight = self.cfg.rollout.inflight_updates != "off"
        return {**staleness_metrics(self.trainer.version, out, inflight), "async/trainer_idle_s": self.batch.wait_s,
                "async/engine_idle_s": self.ahead.engine.take_idle(), "time/rollout": self.batch.engine_s}

    def _keep_sync(self, synced: dict[str, float]) -> None:
        """A sync made before the step it belongs to (an evaluation's, a checkpoint's), for the step to report."""
        if synced["sync/bytes"] or self._eval_sync is None:
            self._eval_sync = synced

    def sync_paused(self) -> None:
        """Before a checkpoint: a batch paused for the next weight update (rollout.inflight_updates) gets it now, the
        update the next step's sync would send (the same bytes), so that the batches the checkpoint keeps are those
        the run trains on whether it stops there or not (jetflow.run.inflight); the next step reports the sync."""
        if self.ahead is not None and self.ahead.engine.paused:
            self._keep_sync(self.sync())

    def _step_sync(self) -> dict[str, float]:
        """The step's weight update (or the one an evaluation just before it sent)."""
        synced = self.sync()
        if self._eval_sync is not None and not synced["sync/bytes"]:
            synced = self._eval_sync  # this step's weights went over for the evaluation before it
        self._eval_sync = None
        return synced

    def _experience(self, sampled: Sampled, metrics: dict[str, float]) -> Experience:
        """The step's samples packed for the trainer, with the reference's log-probs where a KL needs them."""
        cfg = self.cfg
        exp = pack_experience(sampled.prompts, sampled.out.token_ids, sampled.out.logprobs, sampled.rewards,
                              group_advantages(sampled.rewards, cfg.rollout.group_size, cfg.algo.adv_norm), self.pad_id,
                              device=cfg.model.device, routed_experts=sampled.out.routed_experts,
                              token_masks=sampled.out.token_masks)
        if self.with_reference:  # log pi_ref of the same tokens (the frozen reference policy)
            t0 = time.perf_counter()
            exp.ref_logprobs = self.trainer.compute_logprobs(exp, cfg.rollout.temperature, reference=True)
            metrics["time/ref_logprobs"] = time.perf_counter() - t0
            if self._reference_bytes is None:
                self._reference_bytes = float(self.trainer.reference_bytes())
            metrics["ref/bytes"] = self._reference_bytes
        return exp

    def _update(self, exp: Experience, metrics: dict[str, float]) -> None:
        """The trainer's log-probs of the same tokens under the same weight version (pi_old), the rollout
        correction from them, and the update(s); their metrics into `metrics`."""
        cfg, current = self.cfg, self.trainer.version  # the version pi_old is computed under
        if self.kv_quantizer is not None:
            self.kv_quantizer.calibrating = True  # the next trainer forward's K/V amax sets the next step's scales
        train_metrics: dict[str, float] = {}
        if self.kl_in_reward:  # pi_old first, then the rewards less the KL, then the advantages
            t0 = time.perf_counter()
            exp.old_logprobs = self.trainer.compute_logprobs(exp, cfg.rollout.temperature)
            metrics["time/old_logprobs"] = time.perf_counter() - t0
            metrics.update(self._kl_into_rewards(exp))
        elif self.old_logprobs_from_update:
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
        if self.cfg.rollout.inflight_updates != "off" and self.batch is not None:  # the post-swap tokens' gap
            metrics.update(swap_gap_metrics(self.batch.out, exp.rollout_logprobs, exp.old_logprobs, exp.response_mask,
                                            current))
        if self.split is not None and self.batch is not None:  # a stale batch's numerics and staleness
            metrics.update(self.split.metrics(exp, self.batch.out.weight_version, current))
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
        if exp.ref_logprobs is not None:  # the policy that sampled (pi_old) against the reference
            kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, cfg.algo.kl_estimator)  # (B, R)
            metrics["kl/ref"] = float((kl * exp.response_mask).sum() / exp.response_mask.sum().clamp(min=1))

    def _sample_metrics(self, exp: Experience, first_round: Sampled, generated: int, metrics: dict[str, float]) -> None:
        """Rewards, lengths and throughput of the policy's own samples (the first round: no refills)."""
        out, scores = first_round.out, first_round.scores
        lengths = sampled_counts(out)
        if out.turn_stats is not None:  # multi-turn: turns, tool calls, observations, re-tokenization drift
            metrics.update(multiturn_metrics(out.turn_stats, out.token_masks))
        mask = exp.response_mask
        metrics.update({
            # the rollout's own log-perplexity of what it sampled (nats per token)
            "policy/rollout_log_ppl": float(-(exp.rollout_logprobs * mask).sum() / mask.sum().clamp(min=1)),
            "reward/mean": sum(s.total for s in scores) / len(scores),
            "reward/accuracy": sum(s.correct for s in scores) / len(scores),
            "reward/format": sum(s.format_ok for s in scores) / len(scores),
            # a custom task's reward functions, each before weighting
            **reward_part_means(scores),
            "response/length_mean": sum(lengths) / len(lengths),
            "response/length_max": float(max(lengths)),
            "response/truncated_frac": sum(r == "length" for r in out.finish_reasons) / len(lengths),
            "throughput/rollout_tokens_per_s": generated / max(metrics["time/rollout"], 1e-9),
            "weight_version": float(self.trainer.version),
        })
