"""RLLoop.step with a fake rollout engine and a fake trainer: what the loop hands each side, in which
order, and what it computes from their answers (rewards, advantages, mismatch, correction, metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from jetflow.config import derive, load_config
from jetflow.rollout.types import Rollouts
from jetflow.run.loop import RLLoop, request_seed
from jetflow.sync import StaleWeightsError, WeightUpdate
from jetflow.tasks import Problem
from jetflow.tasks.base import Reward


class FakeTask:
    """Problem i asks for the letter 'a' + i % 2; a response is right when it is that letter."""
    stop = ()

    def problems(self, start: int, n: int, seed: int) -> list[Problem]:
        return [Problem(prompt=f"p{start + i}", answer="ab"[(start + i) % 2]) for i in range(n)]

    def score(self, problem: Problem, text: str) -> Reward:
        return Reward(total=float(text == problem.answer), correct=text == problem.answer, format_ok=True)

    def score_batch(self, problems: list[Problem], texts: list[str]) -> list[Reward]:
        return [self.score(p, t) for p, t in zip(problems, texts)]

    def held_out_problems(self, n: int, seed: int) -> list[Problem]:
        """Five held-out problems q0..q4 whatever n asks (a small problem space); all want 'a'."""
        return [Problem(prompt=f"q{i}", answer="a") for i in range(5)]


class FakeEngine:
    """Samples 'a' for even requests and 'b' for odd ones, two tokens each, at log-prob -1.0 per token."""

    def __init__(self, stale: bool = False):
        self.weight_version, self.stale = -1, stale
        self.calls: list[tuple] = []

    def load_weights(self, update: WeightUpdate) -> None:
        self.calls.append(("load_weights", update.version))
        self.weight_version = update.version

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> Rollouts:
        self.calls.append(("generate", [list(p) for p in prompts], list(seeds)) + (("greedy",) if greedy else ()))
        n = len(prompts)
        return Rollouts(token_ids=[[7, 8]] * n, logprobs=[[-1.0, -1.0]] * n, texts=["ab"[i % 2] for i in range(n)],
                        finish_reasons=["stop"] * n, weight_version=self.weight_version - int(self.stale))


class FakeTrainer:
    """pi_old is -1.5 on every token (0.5 nats below the rollout's); a train step bumps the version."""

    def __init__(self):
        self.version, self.calls = 0, []

    def weight_update(self, mode: str, fingerprint: str | None, kv_scales=None) -> WeightUpdate:
        self.calls.append(("weight_update", mode, fingerprint))
        return WeightUpdate(self.version, mode, fingerprint, tensors={"w": torch.zeros(3)})

    def compute_logprobs(self, exp, temperature: float = 1.0) -> torch.Tensor:
        self.calls.append(("compute_logprobs", temperature))
        return torch.full(exp.response_ids.shape, -1.5) * exp.response_mask

    def train_step(self, exp, temperature: float = 1.0) -> dict[str, float]:
        self.calls.append(("train_step", exp))
        self.version += 1
        return {"loss/policy": 0.25}

    def train_step_on_policy(self, exp, temperature, correction, correction_params):
        self.calls.append(("train_step_on_policy", correction))
        self.version += 1
        return {"loss/policy": 0.5}, self.compute_logprobs(exp, temperature)


def make_loop(mode: str = "unified", *overrides: str, stale: bool = False):
    cfg = load_config("configs/tiny.yaml", [f"precision.mode={mode}", "train.prompts_per_step=2",
                                            "rollout.group_size=2", "rollout.temperature=0.7", *overrides])
    engine, trainer = FakeEngine(stale), FakeTrainer()
    loop = RLLoop(cfg, derive(cfg), trainer, engine, FakeTask(), lambda p: [ord(c) for c in p.prompt], pad_id=0)
    return cfg, loop, engine, trainer


def test_one_step_hands_weights_then_samples_then_trains_on_the_trainers_logprobs():
    cfg, loop, engine, trainer = make_loop("unified", "algo.old_logprobs=recompute")
    m = loop.step(3)

    # the engine got the trainer's version 0 first, then every prompt group_size times with its seed
    fingerprint = cfg.precision.recipe().fingerprint()
    assert engine.calls[0] == ("load_weights", 0) and trainer.calls[0] == ("weight_update", "unified", fingerprint)
    _, prompts, seeds = engine.calls[1]
    assert prompts == [[ord("p"), ord("6")]] * 2 + [[ord("p"), ord("7")]] * 2  # step 3 x 2 prompts: p6, p7
    assert seeds == [request_seed(cfg.run.seed, 3, i) for i in range(4)]

    # pi_old from the trainer at the rollout temperature, then one update on it
    assert ("compute_logprobs", 0.7) in trainer.calls
    (exp,) = [c[1] for c in trainer.calls if c[0] == "train_step"]
    assert torch.equal(exp.old_logprobs, torch.full((4, 2), -1.5))
    assert torch.equal(exp.rollout_logprobs, torch.full((4, 2), -1.0))
    # texts a, b, a, b against answers b, b... : p6 wants 'a', p7 wants 'b' -> rewards 1, 0, 0, 1
    assert exp.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    # GRPO: each group (1, 0) and (0, 1) normalised by its mean and std
    assert exp.advantages[0] > 0 > exp.advantages[1] and exp.advantages[3] > 0 > exp.advantages[2]
    assert exp.is_weights is None or torch.all(exp.is_weights == 1)  # unified: no correction

    assert m["reward/mean"] == 0.5 and m["reward/accuracy"] == 0.5
    assert m["response/length_mean"] == 2.0 and m["response/truncated_frac"] == 0.0
    assert m["loss/policy"] == 0.25 and m["weight_version"] == 1.0 and trainer.version == 1
    # every token 0.5 nats apart: k1 = E[log p_rollout - log p_train] = 0.5, k3 = e^-0.5 - 1 + 0.5
    assert m["mismatch/kl_k1"] == pytest.approx(0.5)
    assert m["mismatch/kl_k3"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert m["mismatch/equal_frac"] == 0.0
    assert m["policy/rollout_log_ppl"] == pytest.approx(1.0)
    # every token at rollout p = e^-1 = 0.37: none below 0.1; all 0.5 nats apart
    assert m["policy/low_prob_frac"] == 0.0 and m["mismatch/kl_k3/low_prob"] == 0.0
    assert m["mismatch/kl_k3/high_prob"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert m["sync/bytes"] == 12.0 and m["time/step"] >= m["time/rollout"] >= 0


def test_the_next_step_syncs_the_new_version_and_an_unchanged_version_is_not_resent():
    _, loop, engine, trainer = make_loop("unified", "algo.old_logprobs=recompute")
    loop.step(0)
    loop.step(1)
    assert [c for c in engine.calls if c[0] == "load_weights"] == [("load_weights", 0), ("load_weights", 1)]
    trainer.version -= 1  # a skipped step: the trainer stays at the version the engine has
    assert loop.sync() == {"time/sync": 0.0, "sync/bytes": 0.0}


def test_mixed_corrects_with_token_tis_inside_the_training_forward():
    _, loop, engine, trainer = make_loop("mixed")
    m = loop.step(0)
    assert ("train_step_on_policy", "token_tis") in trainer.calls
    # no separate no-grad forward: pi_old comes out of the training step (the fake's own call inside it)
    assert [c[0] for c in trainer.calls] == ["weight_update", "train_step_on_policy", "compute_logprobs"]
    assert m["time/old_logprobs"] == 0.0 and m["loss/policy"] == 0.5
    # token TIS weight = min(exp(old - rollout), cap) = exp(-0.5) on every token
    assert torch.allclose(loop.last_experience.is_weights, torch.full((4, 2), math.exp(-0.5)))


def test_a_rollout_sampled_with_other_weights_is_refused():
    _, loop, _, _ = make_loop("unified", stale=True)
    with pytest.raises(StaleWeightsError, match=r"rollout used weight version -1, expected 0 \(the trainer is at 0\)"):
        loop.step(0)


def test_evaluation_decodes_the_held_out_problems_greedily_with_the_current_weights():
    _, loop, engine, trainer = make_loop("unified")
    trainer.version = 3
    m = loop.evaluate()
    assert engine.calls[0] == ("load_weights", 3)  # the trainer's current weights first
    _, prompts, _, mode = engine.calls[1]
    assert mode == "greedy" and prompts == [[ord("q"), ord(str(i))] for i in range(5)]
    # the fake answers a, b, a, b, a and every held-out problem wants 'a': 3 of 5
    assert m["eval/pass@1"] == 0.6 and m["eval/reward"] == 0.6 and m["eval/num_prompts"] == 5.0
    loop.evaluate()
    assert [c[0] for c in engine.calls] == ["load_weights", "generate", "generate"]  # weights unchanged: not resent


def test_evaluation_shares_the_prompts_unevenly_over_ranks_and_sums():
    """5 held-out prompts over 2 ranks: rank 0 decodes 2, rank 1 three; the counts are summed."""
    from jetflow.distributed import DataParallel

    class TwoRanks(DataParallel):
        def __init__(self, rank):
            super().__init__(rank=rank, world_size=2)

        def sum_dict(self, values):
            self.seen = values
            return {k: v * 2 for k, v in values.items()}  # as if the other rank had the same counts

    for rank, expected in ((0, [0, 1]), (1, [2, 3, 4])):
        _, loop, engine, _ = make_loop("unified")
        loop.dp = TwoRanks(rank)
        m = loop.evaluate()
        assert engine.calls[1][1] == [[ord("q"), ord(str(i))] for i in expected]
        assert loop.dp.seen["correct"] == sum(i % 2 == 0 for i in range(len(expected)))
        assert m["eval/pass@1"] == 2 * loop.dp.seen["correct"] / 5


def test_a_step_after_an_evaluation_reports_the_weight_update_the_evaluation_made():
    _, loop, engine, _ = make_loop("unified", "algo.old_logprobs=recompute")
    loop.evaluate()  # sends version 0
    m = loop.step(0)  # finds version 0 in place, but reports its sending
    assert [c for c in engine.calls if c[0] == "load_weights"] == [("load_weights", 0)]
    assert m["sync/bytes"] == 12.0
    assert loop.step(1)["sync/bytes"] == 12.0  # its own update (version 1)


class RefillTask(FakeTask):
    """The run's own problem stream asks even problems for 'x', which no sample says (a group of equal
    rewards); the refill streams (other seeds) ask every problem for 'a'."""

    def __init__(self, run_seed: int):
        self.run_seed = run_seed

    def problems(self, start: int, n: int, seed: int) -> list[Problem]:
        if seed != self.run_seed:
            return [Problem(prompt=f"r{start + i}", answer="a") for i in range(n)]
        return [Problem(prompt=f"p{start + i}", answer="x" if (start + i) % 2 == 0 else "a") for i in range(n)]


def _dynamic_loop(*overrides: str):
    cfg, _, engine, trainer = make_loop("unified", "algo.old_logprobs=recompute", "algo.dynamic_sampling=true",
                                        *overrides)
    loop = RLLoop(cfg, derive(cfg), trainer, engine, RefillTask(cfg.run.seed), lambda p: [ord(c) for c in p.prompt],
                  pad_id=0)
    return cfg, loop, engine, trainer


def test_dynamic_sampling_drops_equal_reward_groups_and_refills_them_with_new_problems():
    cfg, loop, engine, trainer = _dynamic_loop()
    m = loop.step(1)  # problems p2 (wants 'x': rewards 0, 0 -> dropped) and p3 (wants 'a': 1, 0 -> kept)
    generates = [c for c in engine.calls if c[0] == "generate"]
    assert len(generates) == 2  # one refill round filled the batch
    _, prompts, seeds = generates[1]
    assert prompts[0] == [ord("r"), ord("2")]  # the refill stream, at this step's position
    assert seeds == [request_seed(cfg.run.seed, 1, 4 + i) for i in range(4)]  # after round 0's 4 requests
    (exp,) = [c[1] for c in trainer.calls if c[0] == "train_step"]
    assert exp.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # p3's group, then r2's
    assert exp.input_ids[0, -4:-2].tolist() == [ord("p"), ord("3")] and exp.input_ids[2, -4:-2].tolist() == [ord("r"), ord("2")]
    # 3 of the 4 generated groups had unequal rewards; two rounds; a full batch
    assert m["sampling/kept_group_frac"] == 0.75 and m["sampling/rounds"] == 2.0
    assert m["sampling/batch_groups_frac"] == 1.0
    assert m["reward/mean"] == 0.25  # the first round's samples: the policy's own reward


def test_dynamic_sampling_stops_at_its_round_cap_and_trains_on_the_groups_it_has():
    _, loop, engine, trainer = _dynamic_loop("algo.dynamic_sampling_max_rounds=0")
    m = loop.step(1)
    assert len([c for c in engine.calls if c[0] == "generate"]) == 1
    (exp,) = [c[1] for c in trainer.calls if c[0] == "train_step"]
    assert exp.rewards.tolist() == [1.0, 0.0]
    assert m["sampling/kept_group_frac"] == 0.5 and m["sampling/batch_groups_frac"] == 0.5


class ReferenceTrainer(FakeTrainer):
    """A FakeTrainer with a reference policy at log-prob -2.0 on every token (0.5 below pi_old)."""

    def compute_logprobs(self, exp, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        if not reference:
            return super().compute_logprobs(exp, temperature)
        self.calls.append(("reference_logprobs", temperature))
        return torch.full(exp.response_ids.shape, -2.0) * exp.response_mask

    def reference_bytes(self) -> int:
        return 36


def _reference_loop(*overrides: str):
    cfg = load_config("configs/tiny.yaml", ["train.prompts_per_step=2", "rollout.group_size=2",
                                            "rollout.temperature=0.7", *overrides])
    engine, trainer = FakeEngine(), ReferenceTrainer()
    loop = RLLoop(cfg, derive(cfg), trainer, engine, FakeTask(), lambda p: [ord(c) for c in p.prompt], pad_id=0)
    return loop, trainer


def test_the_reference_log_probs_reach_the_update_and_the_kl_to_the_reference_is_logged():
    loop, trainer = _reference_loop("algo.kl_coef=0.05", "algo.kl_estimator=k1")
    m = loop.step(0)
    assert ("reference_logprobs", 0.7) in trainer.calls
    assert m["kl/ref"] == pytest.approx(0.5)  # k1: pi_old -1.5 against pi_ref -2.0
    assert m["ref/bytes"] == 36.0 and m["time/ref_logprobs"] >= 0
    assert "kl/reward_penalty" not in m  # kl_in=loss: the trainer adds it to the loss


def test_kl_in_the_reward_lowers_each_reward_by_its_summed_estimator_before_the_advantages():
    loop, trainer = _reference_loop("algo.kl_coef=0.1", "algo.kl_estimator=k1", "algo.kl_in=reward")
    m = loop.step(0)
    (exp,) = [c[1] for c in trainer.calls if c[0] == "train_step"]  # pi_old by a separate forward first
    # k1 = 0.5 on each of 2 tokens: each reward loses 0.1 * 1.0
    assert exp.rewards.tolist() == pytest.approx([0.9, -0.1, -0.1, 0.9])
    assert m["kl/reward_penalty"] == pytest.approx(0.1) and m["reward/mean"] == 0.5  # the task's reward
    assert exp.advantages[0] > 0 > exp.advantages[1]


def test_the_overlong_punishment_lowers_the_rewards_of_long_responses():
    # max_new_tokens 3, buffer 2: free up to 1 token; each response has 2, so -1 * (2 - 1) / 2 = -0.5
    cfg, loop, engine, trainer = make_loop("unified", "algo.old_logprobs=recompute", "rollout.max_new_tokens=3",
                                           "algo.overlong_buffer=2")
    m = loop.step(3)
    (exp,) = [c[1] for c in trainer.calls if c[0] == "train_step"]
    assert exp.rewards.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert m["reward/overlong_penalty"] == -0.5 and m["reward/mean"] == 0.5  # the task's own reward
