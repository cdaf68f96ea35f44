"""The reward of results/long-train/grpo-2048-reward: the fraction of a response's characters that are
the digit 7 (a score every 2048-character response gets, different from one response to the next, so
that GRPO's advantages and gradients are not zero). TRL's signature (jetflow.tasks.rewards)."""


def sevens(prompts, completions, **columns):
    return [c.count("7") / max(len(c), 1) for c in completions]
