"""Tasks: deterministic problem streams and exact verifiers."""

import json
import threading

import pytest

from jetflow.tasks import (
    ArithmeticTask,
    CountdownTask,
    MathTask,
    Problem,
    Reward,
    make_task,
)
from jetflow.tasks.arithmetic import PLAIN_ALPHABET, evaluate
from jetflow.tasks.countdown import evaluate_expression


def arith_problem(operands, ops):
    """A hand-written arithmetic problem, built the way the generator builds one."""
    chain = [evaluate(operands[: k + 1], ops[:k]) for k in range(len(operands))]
    meta = {"operands": operands, "ops": ops, "chain": chain, "result": chain[-1]}
    return Problem(prompt="", answer=str(chain[-1]), meta=meta)


# ---------------------------------------------------------------- registry and determinism


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="arithmetic.*countdown.*math"):
        make_task("gsm9k")


def test_unknown_option_names_bad_key_and_valid_ones():
    with pytest.raises(ValueError, match="digitz") as err:
        make_task("arithmetic", digitz=3)
    assert "digits" in str(err.value) and "num_operands" in str(err.value)


def test_bad_option_values_are_errors():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="+/")
    with pytest.raises(ValueError, match="style"):
        ArithmeticTask(style="fancy")
    with pytest.raises(ValueError, match="count"):
        CountdownTask(count=1)


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_generated_tasks_are_deterministic_by_seed(name):
    a, b = make_task(name), make_task(name)
    assert a.sample(20, seed=3) == b.sample(20, seed=3)
    assert a.sample(20, seed=3) != a.sample(20, seed=4)
    # A run that resumes at position 7 sees exactly the problems it would have seen.
    assert a.problems(7, 5) == [a.problem(i) for i in range(7, 12)]
    assert a.problems(0, 12)[7:] == a.problems(7, 5)
    # The task's own seed picks the default stream.
    assert make_task(name, seed=4).problems(0, 20) == a.sample(20, seed=4)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_evaluate_uses_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([10, 3, 2], ["-", "-"]) == 5


def test_arithmetic_chat_verifier():
    task = ArithmeticTask(style="chat", format_weight=0.1)
    p = arith_problem([12, 34], ["+"])
    assert task.score(p, "46") == Reward(total=1.1, correct=True, format_ok=True)
    assert task.score(p, " 46.\n") == Reward(total=1.1, correct=True, format_ok=True)
    assert task.score(p, "12 + 34 = 46") == Reward(total=1.0, correct=True, format_ok=False)
    assert task.score(p, "The answer is 46.0").correct
    assert task.score(p, "45") == Reward(total=0.1, correct=False, format_ok=True)
    assert task.score(p, "46, no wait, 47") == Reward(total=0.0, correct=False, format_ok=False)
    assert not task.score(p, "forty-six").correct
    assert not task.score(p, "").correct


def test_arithmetic_negative_results():
    task = ArithmeticTask(style="chat", ops="-")
    p = arith_problem([12, 34], ["-"])
    assert p.meta["result"] == -22
    assert task.score(p, "12 - 34 = -22").correct
    assert task.score(p, "-22").format_ok
    assert not task.score(p, "22").correct
    assert not task.score(p, "12-34").correct  # reads as 12 and 34: the last number is 34


def test_arithmetic_plain_verifier_stops_at_newline():
    task = ArithmeticTask(style="plain")
    assert task.stop == ("\n",) and not task.chat
    p = arith_problem([7, 8], ["+"])
    assert task.score(p, "15\n") == Reward(total=1.0, correct=True, format_ok=True)
    assert task.score(p, "15\n3+4=7").correct  # text after the terminator is ignored
    assert not task.score(p, "\n15").correct
    assert not task.score(p, "1 5\n").correct


def test_arithmetic_show_work_checks_the_whole_chain():
    plain = ArithmeticTask(style="plain", show_work=True, num_operands=3)
    p = arith_problem([12, 34, 5], ["+", "+"])
    assert p.meta["chain"] == [12, 46, 51]
    assert plain.score(p, "12 46 51\n") == Reward(total=1.0, correct=True, format_ok=True)
    assert not plain.score(p, "12 45 51\n").correct  # right result, wrong partial sum
    assert not plain.score(p, "51\n").correct
    assert not plain.score(p, "12 46 51 7\n").correct

    chat = ArithmeticTask(style="chat", show_work=True, num_operands=3)
    work = "12 + 34 = 46\n46 + 5 = 51\n12, 46, 51"
    assert chat.score(p, work) == Reward(total=1.0, correct=True, format_ok=True)
    assert chat.score(p, "Values: 12, 46, 51").correct
    assert not chat.score(p, "Values: 12, 46, 51").format_ok
    assert not chat.score(p, "12, 46, 51\nSo the answer is 51").correct


def test_arithmetic_modulus_keeps_the_running_sums_last_digit():
    task = ArithmeticTask(style="plain", show_work=True, num_operands=4, modulus=10)
    p = next(p for p in task.sample(20, seed=0) if sum(p.meta["operands"]) >= 10)
    ops = p.meta["operands"]
    sums = [sum(ops[: k + 1]) for k in range(4)]
    by_hand = [v % 10 for v in sums]  # "3+4+1+5=" -> 3 7 8 3
    assert p.meta["chain"] == by_hand and p.answer == " ".join(map(str, by_hand))
    assert p.prompt == "+".join(map(str, ops)) + "="  # the prompt does not change
    assert task.score(p, p.answer + "\n") == Reward(1.0, True, True)
    assert not task.score(p, " ".join(map(str, sums)) + "\n").correct  # the unreduced chain is wrong
    wrong = by_hand[:-1] + [(by_hand[-1] + 1) % 10]
    assert not task.score(p, " ".join(map(str, wrong)) + "\n").correct
    # Every answer number is one character, whatever the chain's length.
    long = ArithmeticTask(style="plain", show_work=True, num_operands=32, modulus=10)
    assert all(len(q.answer) == 2 * 32 - 1 for q in long.sample(20, seed=0))
    with pytest.raises(ValueError, match="modulus"):
        ArithmeticTask(modulus=1)


def test_arithmetic_reference_answers_verify():
    for style in ("plain", "chat"):
        for show_work in (False, True):
            task = ArithmeticTask(
                digits=3, num_operands=4, ops="+-*", style=style, show_work=show_work
            )
            for p in task.sample(30, seed=0):
                completion = p.answer + ("\n" if style == "plain" else "")
                assert task.score(p, completion) == Reward(1.0, True, True), p


def test_arithmetic_prompt_formats():
    plain = ArithmeticTask(style="plain", digits=2, num_operands=3, ops="+-*", show_work=True)
    for p in plain.sample(50, seed=1):
        assert set(p.prompt + p.answer + "\n") <= set(PLAIN_ALPHABET)
        assert p.prompt.endswith("=")
    chat = ArithmeticTask().problem(0)
    a, b = chat.meta["operands"]
    assert chat.prompt == f"What is {a} + {b}? Answer with just the number."
    assert 0 <= a <= 9 and 0 <= b <= 9  # default: single-digit sums


def test_arithmetic_knobs_change_problem_size():
    small = ArithmeticTask(digits=1, num_operands=2).sample(50, seed=0)
    big = ArithmeticTask(digits=5, num_operands=6, ops="*").sample(50, seed=0)
    assert all(len(p.meta["operands"]) == 2 and max(p.meta["operands"]) <= 9 for p in small)
    assert all(len(p.meta["operands"]) == 6 for p in big)
    assert all(10_000 <= x <= 99_999 for p in big for x in p.meta["operands"])
    assert all(set(p.meta["ops"]) == {"*"} for p in big)
    # show_work makes the expected answer grow with num_operands.
    short = ArithmeticTask(style="plain", show_work=True, num_operands=2).problem(0)
    long = ArithmeticTask(style="plain", show_work=True, num_operands=8).problem(0)
    assert len(short.answer.split()) == 2 and len(long.answer.split()) == 8


# ---------------------------------------------------------------- countdown


def countdown_problem(numbers, target):
    return Problem(prompt="", answer="", meta={"numbers": numbers, "target": target})


def test_countdown_generated_problems_are_solvable():
    for count in (2, 3, 4, 6):
        task = CountdownTask(count=count, max_value=50)
        for p in task.sample(50, seed=count):
            numbers, target = p.meta["numbers"], p.meta["target"]
            assert len(numbers) == count and all(1 <= x <= 50 for x in numbers)
            assert target not in numbers and target >= 1
            reward = task.score(p, f"<answer>{p.meta['solution']}</answer>")
            assert reward == Reward(1.0, True, True), p.meta
            assert str(target) in p.prompt and "<answer>" in p.prompt


def test_countdown_verifier_accepts_correct_expressions():
    task = CountdownTask(format_weight=0.1)
    p = countdown_problem([25, 50, 7, 6], 181)
    assert task.score(p, "I think\n<answer>(50 - 25) * 7 + 6</answer>") == Reward(1.1, True, True)
    assert task.score(p, "<answer>(50 - 25) * 7 + 6 = 181</answer>").correct
    assert task.score(p, "work...\n(50-25)*7+6") == Reward(1.0, True, False)  # last line, no tags
    assert task.score(p, "<answer>(50 - 25) × 7 + 6</answer>").correct
    # Exact fractions: 6 / 4 * 2 = 3 exactly; a subset of the numbers is allowed.
    q = countdown_problem([6, 4, 2], 3)
    assert task.score(q, "<answer>6 / 4 * 2</answer>").correct
    assert not task.score(countdown_problem([6, 4], 1), "<answer>6 / 4</answer>").correct


def test_countdown_verifier_rejects_wrong_answers():
    task = CountdownTask()
    p = countdown_problem([25, 50, 7, 6], 181)
    assert task.score(p, "<answer>25 * 7 + 6</answer>").correct  # another solution: fine
    assert task.score(p, "<answer>50 * 7 + 6</answer>") == Reward(0.0, False, True)  # 356
    assert not task.score(p, "<answer>(50 - 25) * 7 + 7 - 1</answer>").correct  # reuses 7, adds 1
    assert not task.score(countdown_problem([5, 3], 10), "<answer>5 + 5</answer>").correct
    assert task.score(countdown_problem([5, 5, 3], 10), "<answer>5 + 5</answer>").correct
    assert not task.score(p, "<answer>181</answer>").correct
    assert not task.score(countdown_problem([3, 7], 4), "<answer>-3 + 7</answer>").correct
    assert not task.score(countdown_problem([3, 7], 4), "<answer>7 - 3 / 0</answer>").correct
    assert not task.score(p, "").correct


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('touch /tmp/jetflow_pwned')",
        "(lambda: 1)()",
        "[x for x in (1, 2)]",
        "9 ** 9 ** 9 ** 9",
        "2.5 * 2",
        "0x10",
        "1_0",
        "(" * 300 + "1" + ")" * 300,
        "1; 2",
    ],
)
def test_countdown_parser_rejects_non_arithmetic(text):
    assert evaluate_expression(text) is None
    task = CountdownTask()
    p = countdown_problem([1, 2, 9, 10, 16], 16)
    assert not task.score(p, f"<answer>{text}</answer>").correct


def test_countdown_parser_does_not_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    assert evaluate_expression(f"open({str(marker)!r}, 'w')") is None
    assert evaluate_expression(f"__import__('pathlib').Path({str(marker)!r}).touch()") is None
    assert not marker.exists()


def test_countdown_knobs():
    task = CountdownTask(count=3, max_value=9, max_target=50)
    for p in task.sample(50, seed=0):
        assert len(p.meta["numbers"]) == 3 and max(p.meta["numbers"]) <= 9
        assert p.meta["target"] <= 50 or p.meta["target"] == sum(p.meta["numbers"])


# ---------------------------------------------------------------- math


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_math_scores_with_math_verify(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": "What is 6 * 7?", "answer": "42"}])
    task = make_task("math", path=str(path), format_weight=0.1)
    p = task.problem(0)
    assert p.prompt.startswith("What is 6 * 7?\n") and "\\boxed{}" in p.prompt
    assert p.answer == "42" and p.meta["row"] == 1
    assert task.score(p, "The answer is \\boxed{42}") == Reward(1.1, True, True)
    assert task.score(p, "The answer is \\boxed{41}") == Reward(0.1, False, True)
    assert task.score(p, "41") == Reward(0.0, False, False)


def test_math_fields_and_gsm8k_extraction(tmp_path):
    rows = [
        {"problem": "Half of 3?", "solution": "\\frac{3}{2}"},
        {"problem": "Big?", "solution": "Lots of steps\n#### 1,000"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plain = MathTask(str(path), question_field="problem", answer_field="solution", instruction="")
    frac = next(p for p in plain.sample(2, seed=0) if p.meta["row"] == 1)
    assert frac.prompt == "Half of 3?"
    assert plain.score(frac, "so it is $\\boxed{1.5}$").correct
    path2 = write_jsonl(tmp_path / "g.jsonl", rows[1:])
    gsm = MathTask(str(path2), question_field="problem", answer_field="solution",
                   answer_extract="gsm8k")
    p = gsm.problem(0)
    assert p.answer == "1000"
    assert gsm.score(p, "\\boxed{1000}").correct and not gsm.score(p, "\\boxed{100}").correct


def test_math_bare_latex_gold_and_scoring_off_the_main_thread(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Expand.", "answer": "x^2+1"}])
    task = MathTask(str(path))
    p = task.problem(0)
    results = []
    # math-verify's SIGALRM timeouts fail outside the main thread; the task turns them off there.
    worker = threading.Thread(target=lambda: results.append(task.score(p, "\\boxed{1 + x^2}")))
    worker.start()
    worker.join()
    assert results == [Reward(1.0, True, True)]
    assert not task.score(p, "\\boxed{x^2 - 1}").correct


def test_math_order_is_a_seeded_permutation_per_epoch(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    task = MathTask(str(write_jsonl(tmp_path / "d.jsonl", rows)), instruction="")
    epoch0 = [p.meta["row"] for p in task.problems(0, 10)]
    epoch1 = [p.meta["row"] for p in task.problems(10, 10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(1, 11))
    assert epoch0 != epoch1 and epoch0 != list(range(1, 11))
    assert task.problems(0, 25) == task.problems(0, 25)
    assert task.problems(13, 4) == task.problems(0, 17)[13:]
    assert task.sample(10, seed=1) != task.sample(10, seed=2)


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ("{not json", "invalid JSON"),
        ('{"question": "q"}', "missing field 'answer'"),
        ('{"question": "q", "answer": "  "}', "empty answer"),
        ('{"question": "q", "answer": null}', "empty answer"),
        ('{"question": null, "answer": "1"}', "empty question"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_math_malformed_row_names_file_and_row(tmp_path, bad_row, message):
    good = json.dumps({"question": "q", "answer": "1"})
    path = write_jsonl(tmp_path / "broken.jsonl", [good, good, bad_row, good])
    with pytest.raises(ValueError) as err:
        MathTask(str(path))
    assert f"{path}: row 3" in str(err.value) and message in str(err.value)


def test_math_gsm8k_answer_without_marker_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(ValueError, match="row 1: empty answer"):
        MathTask(str(path), answer_extract="gsm8k")


def test_math_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        make_task("math", path=str(missing))


def test_math_parquet_without_pyarrow_says_what_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("pyarrow") or importlib.util.find_spec("pandas"):
        pytest.skip("a parquet reader is installed; this checks the message when none is")
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        MathTask(str(path))


# ---- held-out split -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params", [("arithmetic", {"digits": 2}), ("countdown", {})])
def test_training_never_draws_a_held_out_problem_and_the_split_is_the_same_for_every_seed(name, params):
    from jetflow.tasks.base import held_out_bucket

    task, plain = make_task(name, seed=3, **params), make_task(name, seed=3, **params)
    task.set_held_out(0.2)
    trained = task.problems(0, 400)
    assert not any(held_out_bucket(p.prompt) < 0.2 for p in trained)
    # a draw that was not held out is the same problem as without the split (the stream only skips)
    unsplit = plain.problems(0, 400)
    kept = [i for i, p in enumerate(unsplit) if held_out_bucket(p.prompt) >= 0.2]
    assert len(kept) < 400 and all(trained[i] == unsplit[i] for i in kept)

    held = task.held_out_problems(30)
    assert len(held) == 30 == len({p.prompt for p in held})
    assert all(held_out_bucket(p.prompt) < 0.2 for p in held)
    other_seed = make_task(name, seed=4, **params)
    other_seed.set_held_out(0.2)
    assert all(other_seed.is_held_out(p) for p in held)  # by prompt text: no seed trains on them


def test_held_out_problems_are_fewer_when_the_space_is_small():
    task = make_task("arithmetic", digits=1, num_operands=2, ops="+", style="plain")  # 100 problems in all
    task.set_held_out(0.1)
    held = task.held_out_problems(64)
    assert 0 < len(held) < 30 and all(task.is_held_out(p) for p in held)


def test_math_splits_its_rows_once(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(200)]
    task = MathTask(str(write_jsonl(tmp_path / "d.jsonl", rows)), instruction="")
    task.set_held_out(0.25)
    held = task.held_out_problems(1000)
    trained = {p.prompt for p in task.problems(0, len(task.rows))}  # one epoch: every training row once
    assert 20 < len(held) < 80 and len(trained) + len(held) == 200
    assert not trained & {p.prompt for p in held}
    assert [p.meta["row"] for p in held] == sorted(p.meta["row"] for p in held)  # file order
    with pytest.raises(ValueError, match="held-out fraction"):
        task.set_held_out(1.0)
