"""Countdown: combine the given numbers with + - * / and parentheses to hit a target.

Generation guarantees a solution: the target is the value of a random expression that uses every
given number once (positive integers at every step, exact divisions only); that expression is kept
in ``meta["solution"]``.

Verification. The expression is the content of the last ``<answer>...</answer>`` if there is one
(``format_ok``), else the last non-empty line. If it contains ``=``, only the left side is read, so
``(50 - 25) * 7 + 6 = 181`` works. It must be built from integer literals, binary ``+ - * /`` and
parentheses only (no unary minus: the numbers are used as given); ``×`` and ``÷`` are read as
``*`` and ``/``. It is parsed with ``ast`` into a syntax tree that is walked by hand, never
executed. ``correct`` when each number is used at most as often as it is given and the exact
(fraction) value equals the target.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from jetflow.tasks.base import Problem, Reward, Task, register_task, rng_for

MAX_EXPRESSION_CHARS = 256
_ALLOWED_CHARS = re.compile(r"[\d\s+\-*/()]*")
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fractions: exact; ZeroDivisionError is caught by the caller
}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TRIES = 100


class _Invalid(Exception):
    pass


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left, used), _walk(node.right, used)
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise _Invalid(type(node).__name__)


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression and the integer literals it uses, or None if invalid.

    Safe on any input: a character whitelist runs first, then ``ast.parse`` (which only parses),
    then a walk that accepts integer constants and binary + - * / nodes only.
    """
    text = text.replace("×", "*").replace("÷", "/").split("=", 1)[0].strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
        used: list[int] = []
        value = _walk(tree.body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError, ZeroDivisionError, _Invalid):
        return None
    return value, used


def extract_expression(completion: str) -> tuple[str, bool]:
    """(expression text, whether it came from answer tags)."""
    tagged = _ANSWER.findall(completion)
    if tagged:
        return tagged[-1], True
    lines = [line for line in completion.splitlines() if line.strip()]
    return (lines[-1] if lines else ""), False


@register_task
class CountdownTask(Task):
    """Seeded, always-solvable Countdown problems.

    count: how many numbers are given (>= 2).
    max_value: the numbers are drawn from 1..max_value.
    max_target: targets lie in 1..max_target; if 100 random expressions miss that range, the sum of
        the numbers is the target (a tight max_target is a soft cap, never an unsolvable problem).
    """

    name = "countdown"

    def __init__(
        self,
        count: int = 4,
        max_value: int = 100,
        max_target: int = 1000,
        seed: int = 0,
        format_weight: float = 0.0,
    ):
        super().__init__(seed=seed, format_weight=format_weight)
        if not isinstance(count, int) or count < 2:
            raise ValueError(f"countdown: count must be an int >= 2, got {count!r}")
        if not isinstance(max_value, int) or max_value < 1:
            raise ValueError(f"countdown: max_value must be an int >= 1, got {max_value!r}")
        if not isinstance(max_target, int) or max_target < 1:
            raise ValueError(f"countdown: max_target must be an int >= 1, got {max_target!r}")
        self.count = count
        self.max_value = max_value
        self.max_target = max_target

    def _random_expression(self, rng, numbers: list[int]) -> tuple[int, str]:
        """Combine random pairs until one (value, text) remains; values stay positive ints."""
        items = [(x, str(x)) for x in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (a, ea), (b, eb) = sorted([items[i], items[j]], key=lambda t: -t[0])  # a >= b
            choices = ["+", "*"]
            choices += ["-"] if a > b else []
            choices += ["/"] if b > 1 and a % b == 0 else []
            op = rng.choice(choices)
            value = {"+": a + b, "*": a * b, "-": a - b, "/": a // b}[op]  # b >= 1 always
            rest = [t for k, t in enumerate(items) if k not in (i, j)]
            items = rest + [(value, f"({ea} {op} {eb})")]
        value, text = items[0]
        return value, text[1:-1]  # drop the outermost parentheses

    def _problem(self, index: int, seed: int) -> Problem:
        rng = rng_for(self.name, seed, index)
        numbers = [rng.randint(1, self.max_value) for _ in range(self.count)]
        for _ in range(_TRIES):
            target, solution = self._random_expression(rng, numbers)
            if 1 <= target <= self.max_target and target not in numbers:
                break
        else:
            target, solution = sum(numbers), " + ".join(map(str, numbers))
        listed = ", ".join(map(str, numbers))
        prompt = (
            f"Using the numbers [{listed}], write an arithmetic expression that equals {target}. "
            "You may use +, -, *, / and parentheses, and each number at most once. "
            "Show your work, then give the final expression in <answer> </answer> tags, "
            "for example <answer>(1 + 2) / 3</answer>."
        )
        meta = {"numbers": numbers, "target": target, "solution": solution,
                "index": index, "seed": seed}
        return Problem(prompt=prompt, answer=solution, meta=meta)

    def score(self, problem: Problem, completion: str) -> Reward:
        expression, tagged = extract_expression(completion)
        parsed = evaluate_expression(expression)
        correct = False
        if parsed is not None:
            value, used = parsed
            fits = Counter(used) <= Counter(problem.meta["numbers"])
            correct = fits and value == problem.meta["target"]
        return self.reward(correct, tagged)
