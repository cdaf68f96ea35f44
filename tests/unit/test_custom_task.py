"""task.name=custom: a researcher's data file (jsonl, parquet, a datasets directory; text or chat
prompts) and reward functions (a module, a file path, async, weighted), each error one line naming the
function and the row; and `jetflow train` on examples/own_task end to end."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from jetflow.cli import main
from jetflow.config import ConfigError, derive, load_config
from jetflow.model.tokenizer import CharTokenizer, render_prompt
from jetflow.tasks import CustomTask, DataError, RewardError, make_task
from jetflow.tasks.base import held_out_bucket

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"reverse w{i}:", "answer": f"{i}w", "n": i} for i in range(1, 31)]

MODULE = """
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]
"""
FILE = """
import asyncio

def longer(prompts, completions, n, answer):
    return [len(c) / 10 + 0 * k for c, k in zip(completions, n)]

async def slow_exact(prompts, completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]

def row17(prompts, completions, n, **kwargs):
    if 17 in n:
        raise KeyError("no such word")
    return [0.0] * len(completions)

def short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def nan_at_17(prompts, completions, n, **kwargs):
    return [float("nan") if k == 17 else 0.0 for k in n]

def one_arg(prompts):
    return [0.0] * len(prompts)

def seen(prompts, completions, **columns):
    SEEN.append((prompts, completions, columns))
    return [0.0] * len(completions)

SEEN = []
"""


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A directory holding the data (jsonl and parquet), a reward module (my_rewards.py, imported by
    module name from the current directory) and a reward file (lib/more_rewards.py, by path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "data.parquet")
    (tmp_path / "my_rewards.py").write_text(MODULE)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "more_rewards.py").write_text(FILE)
    return tmp_path


def custom(path="data.jsonl", reward=("my_rewards:exact",), **kw) -> CustomTask:
    return make_task("custom", path=str(path), reward=list(reward), answer_key="answer", **kw)


def by_row(task, *numbers):
    problems = {n: p for n, p in task.all_rows}
    return [problems[n] for n in numbers]


# ---- data files and rewards -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["data.jsonl", "data.parquet"])
def test_two_weighted_rewards_one_by_module_one_by_file(workdir, path):
    task = custom(path, ["my_rewards:exact", "lib/more_rewards.py:longer"], reward_weights=[1.0, 0.5])
    assert task.columns == ["answer", "n"] and len(task.all_rows) == 30
    p3, p17 = by_row(task, 3, 17)
    assert p3.prompt == "reverse w3:" and p3.answer == "3w"
    rewards = task.score_batch([p3, p17, p17], ["3w", "17w", "nope"])
    # hand-computed: exact 1/0, longer len/10, total = 1 * exact + 0.5 * longer
    assert [r.parts for r in rewards] == [{"exact": 1.0, "longer": 0.2}, {"exact": 1.0, "longer": 0.3},
                                          {"exact": 0.0, "longer": 0.4}]
    assert [r.total for r in rewards] == pytest.approx([1.1, 1.15, 0.2])
    assert [r.correct for r in rewards] == [True, True, False]  # pass_threshold 1.0
    assert task.score(p3, "3w").total == pytest.approx(1.1)


def test_parquet_and_a_datasets_directory_read_the_same_rows_as_jsonl(workdir):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(workdir / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:5]),
                          "test": datasets.Dataset.from_list(ROWS[5:])}).save_to_disk(str(workdir / "dd"))
    jsonl = [(n, p.prompt, p.answer, p.meta["columns"]) for n, p in custom("data.jsonl").all_rows]
    for path in ("data.parquet", "ds"):
        assert [(n, p.prompt, p.answer, p.meta["columns"]) for n, p in custom(path).all_rows] == jsonl
    assert [p.answer for p in custom("dd", split="test").dataset_problems()] == [r["answer"] for r in ROWS[5:]]
    with pytest.raises(DataError, match=r"dd: no split 'validation' \(splits: train, test\)"):
        custom("dd", split="validation")


def test_every_other_column_reaches_the_reward_batched_like_trl(workdir):
    task = custom(reward=["lib/more_rewards.py:seen"])
    seen = sys.modules[task.rewards[0].fn.__module__].SEEN
    p1, p2 = by_row(task, 1, 2)
    task.score_batch([p1, p2, p2], ["a", "b", "c"])
    assert seen == [(["reverse w1:", "reverse w2:", "reverse w2:"], ["a", "b", "c"],
                     {"answer": ["1w", "2w", "2w"], "n": [1, 2, 2]})]


def test_an_async_reward_runs(workdir):
    task = custom(reward=["lib/more_rewards.py:slow_exact", "my_rewards:exact"], reward_weights=[2.0, 1.0])
    p5, = by_row(task, 5)
    assert [r.total for r in task.score_batch([p5, p5], ["5w", "x"])] == [3.0, 0.0]


def test_chat_format_prompts_render_with_the_template_and_completions_are_messages(workdir):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {i}."}],
             "answer": str(i)} for i in range(6)]
    write_jsonl(workdir / "chat.jsonl", rows)
    task = make_task("custom", path="chat.jsonl", prompt_key="messages", reward=["lib/more_rewards.py:seen"])
    p = task.dataset_problems()[2]
    assert p.prompt == rows[2]["messages"]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    tok = CharTokenizer("".join(sorted(set("<>systemuserassistantBebrief.Say 0123456789"))), chat_template=template)
    assert render_prompt(tok, p.prompt, chat=False) == "<system>Be brief.<user>Say 2.<assistant>"  # always templated
    task.score_batch([p], ["2"])
    seen = sys.modules[task.rewards[0].fn.__module__].SEEN
    assert seen[-1][:2] == ([rows[2]["messages"]], [[{"role": "assistant", "content": "2"}]])
    assert 0 <= held_out_bucket(p.prompt) < 1
    task.set_held_out(0.5)  # the split hashes the conversation
    assert len(task.rows) + len(task.held_rows) == 6


# ---- bad rewards: one line naming the function (and the row) ------------------------------------------------

@pytest.mark.parametrize("reward, message", [
    ("no_such_module:f", r"reward no_such_module:f: importing no_such_module failed \(ModuleNotFoundError"),
    ("lib/broken.py:f", r"reward lib/broken.py:f: importing lib/broken.py failed \(SyntaxError"),
    ("lib/missing.py:f", r"reward lib/missing.py:f: no file lib/missing.py"),
    ("my_rewards:nope", r"reward my_rewards:nope: my_rewards has no function 'nope'"),
    ("my_rewards", r"expected module:function or path/to/file.py:function"),
    ("lib/more_rewards.py:one_arg", r"reward lib/more_rewards.py:one_arg: its signature one_arg\(prompts\) cannot take "
                                    r"\(prompts=, completions=, \*\*columns\).*def one_arg\(prompts, completions, "),
    ("lib/more_rewards.py:longer", None),  # takes n and answer by name: a valid signature
])
def test_a_reward_that_cannot_load_is_one_line_naming_it(workdir, reward, message):
    (workdir / "lib" / "broken.py").write_text("def f(:\n")
    if message is None:
        custom(reward=[reward])
        return
    with pytest.raises(RewardError, match=message) as err:
        custom(reward=[reward])
    assert "\n" not in str(err.value)


def test_a_signature_missing_a_column_is_refused(workdir):
    (workdir / "lib" / "narrow.py").write_text("def f(prompts, completions, answer):\n    return []\n")
    with pytest.raises(RewardError, match=r"f\(prompts, completions, answer\) cannot take .*columns \(answer, n\).*"
                                          r"unexpected keyword argument 'n'"):
        custom(reward=["lib/narrow.py:f"])


@pytest.mark.parametrize("fn, message", [
    ("row17", r"reward lib/more_rewards.py:row17 raised KeyError: 'no such word' on row 17 of data.jsonl"),
    ("nan_at_17", r"reward lib/more_rewards.py:nan_at_17 returned nan for the completion of row 17 of data.jsonl"),
    ("short", r"reward lib/more_rewards.py:short returned 3 values for 4 completions \(the batch of row 16 of "
              r"data.jsonl, row 17 of data.jsonl, row 18 of data.jsonl\)"),
])
def test_a_reward_that_fails_on_a_batch_names_the_function_and_the_row(workdir, fn, message):
    task = custom(reward=[f"lib/more_rewards.py:{fn}"])
    with pytest.raises(RewardError, match=message) as err:
        task.score_batch(by_row(task, 16, 17, 17, 18), ["a", "b", "c", "d"])
    assert "\n" not in str(err.value)


def test_reward_weights_must_match_the_functions(workdir):
    with pytest.raises(RewardError, match=r"reward_weights=\[1.0\]: give one weight per reward function \(2"):
        custom(reward=["my_rewards:exact", "lib/more_rewards.py:longer"], reward_weights=[1.0])
    with pytest.raises(RewardError, match="finite"):
        custom(reward=["my_rewards:exact"], reward_weights=[math.inf])


# ---- bad data files: one line naming file and row -----------------------------------------------------------

@pytest.mark.parametrize("bad_row, message", [
    ("{not json", r"bad.jsonl: row 3: invalid JSON"),
    ('{"answer": "1"}', r"bad.jsonl: row 3: missing field 'prompt' \(fields: answer\); .*task.params.prompt_key"),
    ('{"prompt": 7, "answer": "1"}', r"bad.jsonl: row 3: the prompt field 'prompt' holds int"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', r"bad.jsonl: row 3: the prompt field 'prompt' holds list"),
])
def test_a_malformed_data_file_names_file_and_row(workdir, bad_row, message):
    good = json.dumps({"prompt": "p", "answer": "1"})
    write_jsonl(workdir / "bad.jsonl", [good, good, bad_row, good])
    with pytest.raises(DataError, match=message) as err:
        custom("bad.jsonl")
    assert "\n" not in str(err.value)


def test_a_damaged_parquet_file_is_one_line(workdir):
    (workdir / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable parquet file"):
        custom("bad.parquet")


# ---- lengths: the row past the model's positions named, max_prompt_tokens drops rows -----------------------

def _tiny_custom_cfg(workdir, *extra):
    return load_config(str(REPO / "examples/own_task/config.yaml"),
                       [f"task.params.path={workdir / 'long.jsonl'}", "task.params.reward=[my_rewards:exact]", "task.params.reward_weights=[1.0]",
                        "task.params.max_prompt_tokens=null", "eval.num_prompts=0", f"run.out_dir={workdir}", *extra])


def test_a_row_past_the_models_positions_is_named_and_max_prompt_tokens_drops_it(workdir, capsys):
    from jetflow.run.build import build_task
    from jetflow.run.validate import check_task_and_model

    rows = [{"prompt": "reverse ab:", "answer": "ba"} for _ in range(40)]
    rows[16] = rows[30] = {"prompt": "x" * 125, "answer": "y"}  # rows 17 and 31: 125 + 8 new tokens > 128
    write_jsonl(workdir / "long.jsonl", rows)
    cfg = _tiny_custom_cfg(workdir)
    with pytest.raises(ConfigError, match=r"long.jsonl: row 17 is a prompt of 125 tokens \(and 1 more rows, the "
                                          r"longest 125 tokens\): with rollout.max_new_tokens=8 .* 128 positions; "
                                          r"drop such rows with task.params.max_prompt_tokens=120"):
        check_task_and_model(cfg, derive(cfg))

    cfg = _tiny_custom_cfg(workdir, "task.params.max_prompt_tokens=120")
    check_task_and_model(cfg, derive(cfg))
    assert "max_prompt_tokens=120: dropped 2 of 40 rows of" in capsys.readouterr().err
    task = build_task(cfg)
    assert len(task.rows) == 38 and 17 not in {n for n, _ in task.rows}
    arithmetic = load_config(str(REPO / "configs/tiny.yaml"), ["task.params.max_prompt_tokens=10"])
    with pytest.raises(ConfigError, match="generates its prompts"):
        check_task_and_model(arithmetic, derive(arithmetic))


def test_a_character_the_tiny_model_lacks_names_the_row(workdir):
    from jetflow.run.validate import check_task_and_model

    write_jsonl(workdir / "long.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": "naïve", "answer": "2"}])
    cfg = _tiny_custom_cfg(workdir)
    with pytest.raises(DataError, match=r"long.jsonl: row 2: the prompt cannot be encoded .*'ï'"):
        check_task_and_model(cfg, derive(cfg))


def test_the_warm_up_needs_an_answer_key(workdir):
    from jetflow.run.validate import check_task_and_model

    write_jsonl(workdir / "long.jsonl", [{"prompt": "ab", "answer": "1"}])
    cfg = _tiny_custom_cfg(workdir, "task.params.answer_key=null")
    with pytest.raises(ConfigError, match="set task.params.answer_key"):
        check_task_and_model(cfg, derive(cfg))


# ---- jetflow train --------------------------------------------------------------------------------------------

QUICK = ["train.steps=2", "train.sft_warmup_steps=3", "train.sft_batch_size=16", "train.prompts_per_step=4", "rollout.group_size=4",
         "eval.num_prompts=4", "eval.every=0", "run.progress=false", "run.tensorboard=false", "run.num_threads=1"]


def test_the_worked_example_trains_end_to_end_with_held_out_evaluation(tmp_path, monkeypatch, capsys):
    """README "Your own task": examples/own_task through `jetflow train` on the tiny model."""
    monkeypatch.chdir(REPO)
    assert main(["train", "--config", "examples/own_task/config.yaml", f"run.out_dir={tmp_path}", *QUICK]) == 0
    run = tmp_path / "own-task"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl, ev = [r for r in rows if r["phase"] == "rl"], [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in rl] == [0, 1] and [r["step"] for r in ev] == [0, 2]
    for r in rl:  # the weighted total of the two functions' own means
        assert r["reward/mean"] == pytest.approx(r["reward/fn/exact_match"] + 0.5 * r["reward/fn/same_letters"])
    assert all(r["eval/num_prompts"] == 4 for r in ev)
    assert (run / "COMPLETE").exists() and (run / "report" / "report.md").is_file()


def test_a_reward_that_raises_mid_run_checkpoints_then_one_line_and_the_fixed_run_resumes(workdir, capsys):
    """An exception in row 17 at RL step 1: the run keeps step 1's starting state, says which function and
    row in one line (exit 2), and the same command with the reward fixed finishes the run."""
    from jetflow.train.checkpoint import latest_checkpoint

    rows = [{"prompt": f"reverse w{i}:", "answer": f"{i}w", "n": i} for i in range(1, 41)]
    write_jsonl(workdir / "long.jsonl", rows)
    reward = workdir / "lib" / "flaky.py"
    reward.write_text("import os\ndef f(prompts, completions, n, **kw):\n"
                      "    if 17 in n and os.path.exists('armed'):\n        raise ValueError('bad row')\n"
                      "    return [0.5] * len(completions)\n")
    args = ["train", "--no-report", "--config", str(REPO / "examples/own_task/config.yaml"),
            f"task.params.path={workdir}/long.jsonl",
            "task.params.reward=[lib/flaky.py:f]", "task.params.reward_weights=[1.0]", "eval.num_prompts=0",
            f"run.out_dir={workdir}", "run.name=flaky", "run.resume=true", "train.prompts_per_step=20",
            *[a for a in QUICK if not a.startswith(("eval", "train.prompts_per_step"))]]
    (workdir / "armed").touch()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jetflow: error: RewardError: reward lib/flaky.py:f raised ValueError: bad row on row 17 "
                          "of "), err
    step = int(err.split("checkpointed at step ")[1].split(":")[0])
    assert "run.resume=true continues it" in err
    checkpoint = latest_checkpoint(workdir / "flaky")
    assert json.loads((checkpoint / "state.json").read_text())["next_step"] == step
    (workdir / "armed").unlink()
    assert main(args) == 0
    assert (workdir / "flaky" / "COMPLETE").exists()
