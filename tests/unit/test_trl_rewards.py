"""TRL's reward-function conventions through the custom task and `jetflow train`: TRL's own documented
example functions, unchanged (copied below as data, from TRL's docs/source/grpo_trainer.md, "Using a custom
reward function", Examples 1.1-5, at huggingface/trl commit 010dd23f), a function's None per completion left
out of the weighted sum and of its logged mean (TRL's nansum / nanmean), a completion no function scores
an error naming its row."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.tasks import RewardError, make_task, reward_part_means

REPO = Path(__file__).resolve().parents[2]

# TRL docs, Example 1.1 (unchanged)
EXAMPLE_1_1 = '''
def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]
'''
# TRL docs, Example 2 (unchanged): conversational completions
EXAMPLE_2 = '''
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
'''
# TRL docs, Example 3 (unchanged)
EXAMPLE_3 = r'''
import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
'''
# TRL docs, Example 4 (the two functions unchanged; the docs leave check_math_solution and
# test_code_solution to the user: here, checks of the tiny task's answers, text or messages)
EXAMPLE_4 = '''
def _text(x):  # standard (text) or conversational (messages) data
    return x if isinstance(x, str) else x[-1]["content"]

def check_math_solution(prompt, completion):
    return _text(completion).strip() == str(eval(_text(prompt).removeprefix("What is ").removesuffix("?")))

def test_code_solution(prompt, completion):
    return "return" in _text(completion)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards
'''
# TRL docs, Example 5 (unchanged)
EXAMPLE_5 = '''
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
'''

# the multi-task rows of Example 4 (its "coding" spelling: the docs' own dataset says "code", which neither
# function scores: under jetflow such a row is an error naming it, tested below), with a ground truth column
ROWS = [{"prompt": f"What is {a}+{b}?", "task": "math", "ground_truth": str(a + b)} for a in range(1, 6) for b in range(1, 5)]
ROWS += [{"prompt": f"Write a function that returns the sum of {n} numbers.", "task": "coding", "ground_truth": ""}
         for n in range(2, 22)]


@pytest.fixture
def trl_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name, text in [("ex1_1", EXAMPLE_1_1), ("ex2", EXAMPLE_2), ("ex3", EXAMPLE_3), ("ex4", EXAMPLE_4),
                       ("ex5", EXAMPLE_5)]:
        (tmp_path / f"{name}.py").write_text(text)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in ROWS]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    return tmp_path


def test_none_is_left_out_of_the_weighted_sum_and_of_the_functions_mean(trl_dir):
    task = make_task("custom", path="data.jsonl", reward=["ex4.py:math_reward_func", "ex4.py:coding_reward_func",
                                                          "ex3.py:reward_func"], reward_weights=[2.0, 3.0, 0.5])
    rows = {n: p for n, p in task.all_rows}
    math_row, code_row = rows[1], rows[21]  # "What is 1+1?" and a coding prompt
    scores = task.score_batch([math_row, math_row, code_row], ["2", "3", "return a + b"])
    # hand-computed: math 2 x (+1 | -1) + 0.5 x boxed (no box: "" against "2", 0); coding 3 x (+1) + 0.5 x
    # boxed ("" against its empty ground truth: 1); the Nones left out
    assert [s.total for s in scores] == [2.0, -2.0, 3.5]
    assert scores[0].parts == {"math_reward_func": 1.0, "reward_func": 0.0}
    assert scores[2].parts == {"coding_reward_func": 1.0, "reward_func": 1.0}
    # TRL's nanmean: each function's mean over the completions it scored
    assert reward_part_means(scores) == {"reward/fn/math_reward_func": 0.0, "reward/fn/reward_func": 1 / 3,
                                         "reward/fn/coding_reward_func": 1.0}


def test_a_completion_that_no_function_scores_names_its_row(trl_dir):
    (trl_dir / "code.jsonl").write_text(json.dumps({"prompt": "Write a function.", "task": "code"}) + "\n")
    task = make_task("custom", path="code.jsonl", reward=["ex4.py:math_reward_func", "ex4.py:coding_reward_func"])
    with pytest.raises(RewardError, match=r"^every reward returned None for the completion of row 1 of code.jsonl "
                                          r"\(ex4.py:math_reward_func, ex4.py:coding_reward_func\)"):
        task.score_batch([task.all_rows[0][1]], ["def f(): return 1"])


def test_a_value_that_is_neither_a_number_nor_none_is_still_refused(trl_dir):
    (trl_dir / "bad.py").write_text("def f(prompts, completions, **kw):\n    return ['1.0'] * len(completions)\n")
    task = make_task("custom", path="data.jsonl", reward=["bad.py:f"])
    with pytest.raises(RewardError, match=r"returned '1.0' for the completion of row 1 of data.jsonl; every value "
                                          r"must be a finite number \(or None"):
        task.score_batch([task.all_rows[0][1]], ["2"])


QUICK = ["train.steps=2", "train.sft_warmup_steps=0", "train.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "eval.num_prompts=0", "run.progress=false", "run.tensorboard=false",
         "run.num_threads=1", "task.params.answer_key=null"]


@pytest.mark.parametrize("data,rewards,weights", [
    ("data.jsonl", ["ex1_1.py:reward_func", "ex3.py:reward_func", "ex4.py:math_reward_func",
                    "ex4.py:coding_reward_func", "ex5.py:async_reward_func"], [0.1, 1.0, 1.0, 1.0, 0.5]),
    ("chat.jsonl", ["ex2.py:format_reward_func", "ex4.py:math_reward_func", "ex4.py:coding_reward_func",
                    "ex5.py:async_reward_func"], [1.0, 1.0, 1.0, 0.5]),
], ids=["standard", "conversational"])
def test_trls_documented_reward_functions_train_unchanged(trl_dir, data, rewards, weights):
    """Examples 1.1 to 5 of TRL's docs through `jetflow train` on the tiny model, standard and conversational
    prompts, the Nones of Example 4 included: the run completes and logs each function's own mean."""
    args = ["train", "--no-report", "--config", str(REPO / "examples/own_task/config.yaml"),
            f"task.params.path={data}", f"task.params.reward=[{','.join(rewards)}]",
            f"task.params.reward_weights=[{','.join(map(str, weights))}]", f"run.out_dir={trl_dir}", "run.name=trl",
            *QUICK]
    assert main(args) == 0
    rl = [json.loads(line) for line in (trl_dir / "trl" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert math.isfinite(r["reward/mean"])
        assert {k for k in r if k.startswith("reward/fn/")} <= {f"reward/fn/{s.rpartition(':')[2]}" for s in rewards} \
            | {f"reward/fn/{s}" for s in rewards}
        assert r["reward/fn/async_reward_func"] in (0.0, 1.0) or 0.0 < r["reward/fn/async_reward_func"] < 1.0


def test_gspo_with_the_loss_aggregation_unset_takes_the_sequence_mean_and_says_so(trl_dir, capsys):
    """algo.ratio_level=sequence with algo.loss_agg unset (auto) trains as the explicit seq_mean_token_mean
    does, to the bit, and the header says which aggregation it took; token_mean with it stays refused."""
    base = ["train", "--no-report", "--config", str(REPO / "examples/own_task/config.yaml"), "task.params.path=data.jsonl",
            "task.params.reward=[ex3.py:reward_func]", "task.params.reward_weights=[1.0]", f"run.out_dir={trl_dir}",
            "algo.ratio_level=sequence", *QUICK]
    assert main([*base, "run.name=auto"]) == 0
    assert "algo.loss_agg=seq_mean_token_mean (GSPO's, as algo.ratio_level=sequence defines it)" in capsys.readouterr().err
    assert main([*base, "run.name=explicit", "algo.loss_agg=seq_mean_token_mean"]) == 0
    assert "GSPO's" not in capsys.readouterr().err

    def losses(name):
        rows = [json.loads(line) for line in (trl_dir / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["loss/policy"], r["train/grad_norm"]) for r in rows if r["phase"] == "rl"]
    assert losses("auto") == losses("explicit")
    assert main([*base, "run.name=token", "algo.loss_agg=token_mean"]) == 2
