"""Every metric a run logs, with its meaning: the one list of them. A row of metrics.jsonl
(jetflow.metrics_log) is `{"step": N, "phase": P, key: value, ...}`; each key is documented here as a `Metric`,
for the phases that log it (`sft`: a supervised warm-up step, `rl`: an RL step, `eval`: a held-out evaluation).

A family of keys is one entry with placeholders (`PLACEHOLDERS`): `mismatch/{stat}/pos_{i}of{n}`,
`reward/fn/{name}`. `MetricsLogger.log` checks every key it writes against the registry and warns once per key
that it does not document (the run goes on: a metric is never lost); tests/unit/test_metrics_registry.py runs
short runs and fails on any undocumented key. The metrics reference of the docs site (docs: reference/metrics.md)
is generated from this list by scripts/gen_docs.py.

A new metric: add its `Metric` below, in its family, with what it measures, its unit and when it is logged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

PHASES = ("sft", "rl", "eval")
ROW_FIELDS = {
    "step": "the step the row belongs to: the warm-up step (sft), the RL step (rl), or the RL step an evaluation ran "
            "before (eval; the last one: train.steps, after the last step)",
    "phase": "sft | rl | eval: which of a run's phases wrote the row",
}

# what {stat} stands for: the whole-batch statistics of jetflow.rl.mismatch (mismatch/<stat>)
MISMATCH_STATS = ("kl_k1", "kl_k3", "chi2", "ess", "abs_delta_mean", "abs_delta_max", "exp_abs_delta_mean",
                  "ratio_outside_frac", "equal_frac", "num_tokens")
PLACEHOLDERS = {  # placeholder -> (the text it matches, a regular expression; what it stands for)
    "i": (r"\d+", "a whole number: the position bin, from 0"),
    "n": (r"\d+", "a whole number: how many position bins"),
    "stat": ("|".join(MISMATCH_STATS), "one of the mismatch statistics: " + ", ".join(MISMATCH_STATS)),
    "name": (r"[^/]+", "a reward function's name (task.params.reward)"),
}

FAMILIES = {  # the part of a key before its first slash -> what the family is about (the reference's sections)
    "time": "Wall-clock seconds of a step's parts, measured on the main process.",
    "throughput": "Tokens per second.",
    "sync": "The weight update the trainer hands to the rollout engine.",
    "async": "Asynchronous rollouts (rollout.max_staleness > 0): how old a step's samples are and who waited.",
    "reward": "The rewards of the step's samples: the policy's own, the first rollout round (dynamic sampling's "
              "refills aside), as the task scored them.",
    "sampling": "DAPO's dynamic sampling (algo.dynamic_sampling).",
    "response": "The lengths of the step's responses (first rollout round), in tokens.",
    "policy": "The policy's own distribution over what it sampled.",
    "mismatch": "Rollout against trainer: delta = log pi_train - log pi_rollout of each sampled response token, the "
                "trainer's log-prob under the weights pi_old (the version that sampled, or under "
                "rollout.max_staleness > 0 the trainer's current one), r = exp(delta). Unified FP8 with exact "
                "numerics: 0 (ess 1, equal_frac 1) unless the samples are stale.",
    "correction": "The rollout correction (algo.correction): the per-token weight of the policy loss, taken on "
                  "pi_old / pi_rollout.",
    "loss": "The loss terms of the step's update, each aggregated as algo.loss_agg says and summed over "
            "micro-batches and data-parallel ranks (the last epoch's under algo.ppo_epochs > 1).",
    "kl": "The KL to the frozen reference policy (algo.kl_coef, algo.log_ref_kl).",
    "ref": "The frozen reference policy.",
    "train": "The optimizer step.",
    "moe": "Mixture-of-experts models.",
    "multiturn": "Multi-turn rollouts (rollout.max_turns > 1): conversations with tools or an environment.",
    "rollout": "The rollout engines of a Ray run (run.orchestrator=ray).",
    "eval": "Held-out evaluation (eval.num_prompts > 0): greedy decoding of the held-out problems, before the "
            "first RL step, every eval.every steps and after the last.",
    "": "Keys outside the families.",
}


@dataclass(frozen=True)
class Metric:
    key: str
    """The key as a row holds it, or a pattern of keys with {placeholders} (PLACEHOLDERS)."""
    meaning: str
    """What it measures, in one line, with its unit."""
    phases: tuple[str, ...] = ("rl",)
    """The phases whose rows hold it."""
    when: str = ""
    """The condition under which it is logged ("" : every row of its phases)."""

    @property
    def family(self) -> str:
        return self.key.split("/", 1)[0] if "/" in self.key else ""

    @property
    def is_pattern(self) -> bool:
        return "{" in self.key


RL, SFT_RL, EVAL = ("rl",), ("sft", "rl"), ("eval",)
REF = "algo.kl_coef > 0 or algo.log_ref_kl"
ASYNC = "rollout.max_staleness > 0"
INFLIGHT = "rollout.inflight_updates != off (with rollout.max_staleness > 0)"
INFLIGHT_K1 = "rollout.inflight_updates != off with rollout.max_staleness = 1, on steps whose batch spans its update"
SPLIT = "rollout.split_mismatch with rollout.max_staleness > 0, on the batches whose version's weights the trainer kept"
DYNAMIC = "algo.dynamic_sampling"
MULTITURN = "rollout.max_turns > 1"
RAY = "run.orchestrator=ray"

METRICS: tuple[Metric, ...] = (
    # time/
    Metric("time/step", "seconds of the whole RL step: weight sync, rollout, scoring, log-probs and update"),
    Metric("time/sync", "seconds handing the trainer's weights to the rollout engine (0 when it had them already)"),
    Metric("time/rollout", "seconds generating the step's samples, scoring aside; under rollout.max_staleness > 0 the "
                           "engine's seconds generating the batch (in its own process, while the trainer trained)"),
    Metric("time/reward", "seconds the task's scoring took (its reward functions, a reward model's forward passes)"),
    Metric("time/old_logprobs", "seconds of the trainer's no-grad forward that gives pi_old (0 when pi_old came with "
                                "the training forward, algo.old_logprobs=auto)"),
    Metric("time/ref_logprobs", "seconds of the reference policy's forward over the step's samples", when=REF),
    Metric("time/train", "seconds of the optimizer step(s): forward, backward, gradient reduction and update",
           SFT_RL),
    Metric("time/eval", "seconds of the held-out evaluation (weight sync, greedy decoding, scoring)", EVAL),
    # throughput/
    Metric("throughput/tokens_per_s", "tokens of the trained batch (prompts and responses) per second of the whole "
                                      "step, summed over data-parallel ranks"),
    Metric("throughput/rollout_tokens_per_s", "tokens generated per second of rollout time (every rollout round), "
                                              "summed over data-parallel ranks"),
    # sync/, ref/
    Metric("sync/bytes", "bytes of the weight update sent to the rollout engine this step (0: none was needed)"),
    Metric("ref/bytes", "bytes the trainer's copy of the frozen reference policy takes", when=REF),
    # async/
    Metric("async/staleness_mean", "weight versions between the trainer and the version that sampled each of the "
                                   "step's generated tokens (0 for the first steps), mean over the tokens", when=ASYNC),
    Metric("async/staleness_max", "the same, the batch's largest", when=ASYNC),
    Metric("async/stale_frac", "share of the step's generated tokens sampled under an older weight version than the "
                               "trainer's", when=ASYNC),
    Metric("async/swapped_frac", "share of the step's generated tokens sampled after the batch's in-flight weight "
                                 "update (jetflow.run.inflight)", when=INFLIGHT),
    Metric("async/swapped_kl_k3", "KL k3 of the behaviour log-probs against the trainer's over the tokens sampled after "
                                  "the in-flight update under the trainer's current weights: 0 under reprefill and "
                                  "exact numerics, the kept pages' gap under keep_kv", when=INFLIGHT_K1),
    Metric("async/swapped_abs_dlogp_max", "the same tokens' largest |log-prob difference|", when=INFLIGHT_K1),
    Metric("async/trainer_idle_s", "seconds the trainer waited for the step's batch", when=ASYNC),
    Metric("async/engine_idle_s", "seconds the rollout engine's process sat waiting for the trainer's calls since the "
                                  "last step",
           when=ASYNC),
    # reward/
    Metric("reward/mean", "mean reward of the step's samples (the task's weighted total, before the overlong and KL "
                          "penalties)"),
    Metric("reward/accuracy", "share of the step's samples the task counts as correct"),
    Metric("reward/format", "share of the step's samples in the format the task asks for"),
    Metric("reward/fn/{name}", "a custom task's reward function `name`: its mean before weighting, over the "
                               "completions it scored (a None leaves one out)", when="task.name=custom"),
    Metric("reward/overlong_penalty", "mean reward the soft overlong punishment added to the samples (0 or below)",
           when="algo.overlong_buffer > 0"),
    # sampling/
    Metric("sampling/kept_group_frac", "share of the generated prompt groups whose rewards differ (kept for "
                                       "training)", when=DYNAMIC),
    Metric("sampling/rounds", "rollout rounds the step ran (1: no refill)", when=DYNAMIC),
    Metric("sampling/batch_groups_frac", "prompt groups trained on, as a share of train.prompts_per_step (below 1: "
                                         "the step ran out of refill rounds)", when=DYNAMIC),
    # response/
    Metric("response/length_mean", "mean response length in generated tokens (a conversation's: the model's tokens "
                                   "of every turn)"),
    Metric("response/length_max", "longest response of the step, in generated tokens"),
    Metric("response/truncated_frac", "share of responses that ran into rollout.max_new_tokens (no EOS or stop)"),
    # policy/
    Metric("policy/rollout_log_ppl", "the rollout's log-perplexity of what it sampled: mean -log pi_rollout per "
                                     "response token (nats)"),
    Metric("policy/entropy", "the trainer's entropy of the policy per response token (nats), from the training "
                             "forward"),
    Metric("policy/low_prob_frac", "share of sampled response tokens the rollout gave a probability below 0.1"),
    # mismatch/
    Metric("mismatch/kl_k1", "mean -delta over the response tokens: the k1 estimate of KL(pi_rollout || pi_train)"),
    Metric("mismatch/kl_k3", "mean r - 1 - delta: the k3 estimate of KL(pi_rollout || pi_train), never below 0"),
    Metric("mismatch/chi2", "mean r^2 - 1: the chi-square divergence estimate"),
    Metric("mismatch/ess", "effective sample size of the weights r as a share of the tokens, (sum r)^2 / (n sum r^2)"
                           ": 1 when rollout and trainer agree"),
    Metric("mismatch/abs_delta_mean", "mean |delta| (nats)"),
    Metric("mismatch/abs_delta_max", "largest |delta| (nats)"),
    Metric("mismatch/exp_abs_delta_mean", "mean exp(|delta|): the mean factor between the two probabilities"),
    Metric("mismatch/ratio_outside_frac", "share of tokens whose ratio r lies outside [0.5, 2]"),
    Metric("mismatch/equal_frac", "share of tokens whose two log-probs are bit for bit equal"),
    Metric("mismatch/num_tokens", "response tokens the statistics are over"),
    Metric("mismatch/{stat}/pos_{i}of{n}", "mismatch/<stat> over the tokens of the i-th of n equal-width bins of the "
                                           "response position (i from 0: the start of the responses)"),
    Metric("mismatch/kl_k3/low_prob", "mismatch/kl_k3 over the sampled tokens the rollout gave a probability below "
                                      "0.1 (0 when there were none)"),
    Metric("mismatch/kl_k3/high_prob", "mismatch/kl_k3 over the other sampled tokens"),
    Metric("mismatch/numerics_kl_k3", "the k3 estimate of KL(pi_behaviour || pi_train at the sampling version): the "
                                      "numerics part of a stale batch's mismatch (0 under exact numerics)", when=SPLIT),
    Metric("mismatch/numerics_kl_k1", "the same, k1 (numerics_kl_k1 + staleness_kl_k1 = mismatch/kl_k1)", when=SPLIT),
    Metric("mismatch/numerics_equal_frac", "share of tokens whose behaviour log-prob equals the trainer's at the "
                                           "sampling version bit for bit", when=SPLIT),
    Metric("mismatch/staleness_kl_k3", "the k3 estimate of KL(pi_train at the sampling version || pi_train now): the "
                                       "staleness part of the mismatch (0 on a batch of the current version)",
           when=SPLIT),
    Metric("mismatch/staleness_kl_k1", "the same, k1", when=SPLIT),
    # correction/
    Metric("correction/weight_mean", "mean rollout-correction weight of the response tokens (1: no correction)"),
    Metric("correction/weight_max", "largest rollout-correction weight of a response token"),
    Metric("correction/truncated_frac", "share of response tokens whose ratio pi_old / pi_rollout exceeded the cap "
                                        "(truncated to it)", when="algo.correction=token_tis"),
    Metric("correction/masked_frac", "share of response tokens with weight 0 (masked out of the loss)",
           when="algo.correction=token_mis or seq_mis"),
    Metric("correction/seq_truncated_frac", "share of the non-empty responses whose sequence ratio exceeded the cap",
           when="algo.correction=seq_tis"),
    Metric("correction/seq_masked_frac", "share of the non-empty responses masked out (sequence ratio outside "
                                         "[lo, hi])", when="algo.correction=seq_mis"),
    Metric("correction/ais_lambda", "adaptive IS: the batch's mixing weight lambda between the uncorrected weight 1 "
                                    "(0) and the truncated ratio (1)", when="algo.correction=ais"),
    Metric("correction/ais_ess", "adaptive IS: effective sample size share of the token ratios",
           when="algo.correction=ais"),
    Metric("correction/ais_kl", "adaptive IS: k3 KL estimate of the token ratios", when="algo.correction=ais"),
    Metric("correction/ais_chi2", "adaptive IS: chi-square estimate of the token ratios",
           when="algo.correction=ais"),
    # loss/
    Metric("loss/policy", "the clipped policy-gradient loss (rollout-correction weights applied)"),
    Metric("loss/clip_frac", "share of response tokens where the clipped branch of the PPO objective was taken"),
    Metric("loss/ratio_mean", "mean importance ratio pi / pi_old over the response tokens"),
    Metric("loss/kl", "the KL penalty term (algo.kl_estimator against the reference), before algo.kl_coef",
           when="algo.kl_coef > 0 and algo.kl_in=loss"),
    Metric("loss/router_aux", "MoE router load-balancing loss, before algo.router_aux_loss_coef",
           when="algo.router_aux_loss_coef > 0 (MoE models)"),
    Metric("loss/sft", "the warm-up's mean negative log-likelihood per response token (nats)", ("sft",)),
    # kl/
    Metric("kl/ref", "mean per-token KL estimate (algo.kl_estimator) of pi_old against the reference policy",
           when=REF),
    Metric("kl/reward_penalty", "mean penalty taken from each response's reward: algo.kl_coef times its summed KL "
                                "estimate", when="algo.kl_coef > 0 and algo.kl_in=reward"),
    # train/
    Metric("train/loss", "the loss the optimizer step minimised (rl: policy loss plus the KL and router terms; sft: "
                         "loss/sft); null on a skipped step", SFT_RL),
    Metric("train/grad_norm", "the gradient's global norm before clipping (train.grad_clip)", SFT_RL),
    Metric("train/lr", "the learning rate of the step", SFT_RL),
    Metric("train/skipped", "1 when the step was skipped (a NaN or Inf loss or gradient), else 0", SFT_RL),
    Metric("train/skipped_total", "steps skipped so far in the phase (train.max_bad_steps in a row stop the run)",
           SFT_RL),
    Metric("weight_version", "the trainer's weight version after the step: optimizer steps applied so far"),
    # moe/
    Metric("moe/router_flip_frac", "routing replay: share of tokens the trainer's router alone would send to other "
                                   "experts than the rollout chose", when="algo.routing_replay (MoE models)"),
    # multiturn/
    Metric("multiturn/turns_mean", "model turns per conversation, mean", when=MULTITURN),
    Metric("multiturn/tool_calls_mean", "tool calls per conversation, mean", when=MULTITURN),
    Metric("multiturn/tool_errors", "tool calls of the batch that failed (the error went back to the model)",
           when=MULTITURN),
    Metric("multiturn/observation_tokens_frac", "share of the response tokens that are observations (tool or "
                                                "environment output, not trained on)", when=MULTITURN),
    Metric("multiturn/retokenize_mismatch_frac", "share of conversations whose re-tokenization from the messages "
                                                 "differs from the token ids trained on", when=MULTITURN),
    # rollout/
    Metric("rollout/actor_restarts_total", "rollout actors restarted so far (a dead actor is replaced)", when=RAY),
    Metric("rollout/reissued_requests_total", "generation requests sent again so far (an actor died with them)",
           when=RAY),
    # eval/
    Metric("eval/pass@1", "share of the held-out problems the greedy completion solves", EVAL),
    Metric("eval/reward", "mean reward of the greedy completions of the held-out problems", EVAL),
    Metric("eval/num_prompts", "held-out problems evaluated", EVAL),
)


def _regex(key: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", key)  # literal, placeholder, literal, ...
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p][0]})"
                              for i, p in enumerate(parts)))


_EXACT = {m.key: m for m in METRICS if not m.is_pattern}
_PATTERNS = [(_regex(m.key), m) for m in METRICS if m.is_pattern]


@lru_cache(maxsize=4096)
def lookup(key: str) -> Metric | None:
    """The registry's entry for a logged key (its own, or the pattern it is one of), else None."""
    if key in _EXACT:
        return _EXACT[key]
    return next((m for rx, m in _PATTERNS if rx.fullmatch(key)), None)


def undocumented(key: str, phase: str) -> str | None:
    """Why a key a row of `phase` holds is not documented (None: it is)."""
    metric = lookup(key)
    if metric is None:
        return "not in the registry"
    if phase not in metric.phases:
        return f"documented for phase {'/'.join(metric.phases)}, logged in phase {phase}"
    return None


def undocumented_keys(rows: Iterable[dict]) -> dict[str, str]:
    """{key: why} of every key of the metrics rows `rows` (metrics.jsonl's) that the registry does not document
    for the row's phase (the row fields aside)."""
    out: dict[str, str] = {}
    for row in rows:
        for key in row:
            if key not in ROW_FIELDS and key not in out and (why := undocumented(key, row.get("phase", "rl"))):
                out[key] = why
    return out
