"""Reward functions for examples/own_task/words.jsonl ("reverse cat:" -> "tac").

Each takes the batch the way TRL's reward_funcs do: the prompts, the completions (generated text), and
every other column of the data file as a keyword list (here `answer` and `word`), and returns one float
per completion.
"""


def exact_match(prompts, completions, answer, **kwargs):
    """1 when the completion is the reversed word, else 0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def same_letters(prompts, completions, word, **kwargs):
    """Partial credit: the share of the word's letters the completion holds at the right count."""
    scores = []
    for c, w in zip(completions, word):
        c = c.strip()
        kept = sum(min(c.count(ch), w.count(ch)) for ch in set(w))
        scores.append(kept / max(len(w), len(c)))
    return scores
