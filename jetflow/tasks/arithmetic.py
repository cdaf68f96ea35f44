"""Multi-digit integer arithmetic with an exact verifier.

Problem: ``num_operands`` integers of ``digits`` digits joined by operators drawn from ``ops``,
evaluated with the usual precedence (``*`` before ``+`` and ``-``). Results may be negative.

Two prompt styles:

- ``plain`` for tiny character-level models trained from scratch. Prompt ``"12+34*5="``; the
  completion is the answer then a newline (``task.stop == ("\\n",)``): ``"182\\n"``. Only text
  before the first newline counts. Every character is in ``PLAIN_ALPHABET``.
- ``chat`` for instruct models: ``"What is 12 + 34 * 5? Answer with just the number."``.

``show_work`` makes the required answer grow linearly with ``num_operands``: the answer is the
chain of prefix values ``v1 v2 ... vn``, where ``vk`` is the value of the expression made of the
first k operands (for sums, the running sums). Plain: ``"12+34+5="`` -> ``"12 46 51\\n"``. Chat: the
prompt names the prefixes and asks for their values, comma-separated, on the last line:
``"12, 46, 51"``.

``modulus`` m takes every value the verifier expects (each prefix value, or the result) modulo m.
With ``show_work``, single-digit sums and m = 10 the chain is the running sum's last digit,
``"3+4+1+5="`` -> ``"3 7 8 3"``: every step is one digit plus one digit mod 10 and every answer
number one character, so the answer's length grows with ``num_operands`` while each step stays
as hard as the first (without it the prefix sums grow to two and three digits and each step's
operand sits at a moving distance from it). The prompt is the same with or without it.

Verifier. Numbers are extracted as ``-?digits`` with an optional decimal part (``46.0`` equals 46;
thousands separators are not understood: ``1,234`` reads as 1 and 234). ``correct``:

- without show_work: the last number in the answer region equals the result;
- with show_work: the last ``num_operands`` numbers of the answer region equal the whole chain.

The answer region is the text before the first newline (plain), the last non-empty line (chat with
show_work), or the whole completion (chat). ``format_ok``: the answer region is exactly the
requested shape (a bare integer, or the chain with the right separator and length; chat allows
surrounding spaces and a final period).
"""

from __future__ import annotations

import re
from fractions import Fraction

from jetflow.tasks.base import Problem, Reward, Task, register_task, rng_for

OPS = ("+", "-", "*")
STYLES = ("plain", "chat")
PLAIN_ALPHABET = "0123456789+-*= \n"
"""Every character a plain-style prompt or reference completion can contain."""

# A number not glued to a preceding digit or point, so "12-34" reads as 12 and 34, "= -22" as -22.
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of ``o0 op0 o1 op1 o2 ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            term *= x
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def extract_numbers(text: str) -> list[Fraction]:
    """All numbers in ``text``, in order (see the module docstring for what counts)."""
    return [Fraction(m) for m in _NUMBER.findall(text)]


def _join(operands: list[int], ops: list[str], spaced: bool) -> str:
    sep = " " if spaced else ""
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:]):
        parts.append(f"{sep}{op}{sep}{x}")
    return "".join(parts)


@register_task
class ArithmeticTask(Task):
    """Seeded integer arithmetic; see the module docstring for formats and verification.

    digits: digits per operand (1 means 0..9, d > 1 means 10**(d-1) .. 10**d - 1).
    num_operands: operands per problem (>= 2).
    ops: the operators to draw from, a subset of "+-*" given as a string or a list.
    style: "plain" (raw character-level prompt) or "chat" (instruct-model question).
    show_work: require the chain of prefix values, not only the result.
    modulus: if set (an int >= 2), every expected value is taken modulo it (see the module docstring).
    The defaults (single-digit sums, chat) give a ~135M instruct model a mix of right and wrong
    answers.
    """

    name = "arithmetic"

    def __init__(
        self,
        digits: int = 1,
        num_operands: int = 2,
        ops: str | list[str] = "+",
        style: str = "chat",
        show_work: bool = False,
        seed: int = 0,
        format_weight: float = 0.0,
        modulus: int | None = None,
    ):
        super().__init__(seed=seed, format_weight=format_weight)
        if not isinstance(digits, int) or digits < 1:
            raise ValueError(f"arithmetic: digits must be an int >= 1, got {digits!r}")
        if not isinstance(num_operands, int) or num_operands < 2:
            raise ValueError(f"arithmetic: num_operands must be an int >= 2, got {num_operands!r}")
        op_tuple = tuple(ops)
        if not op_tuple or any(op not in OPS for op in op_tuple):
            raise ValueError(f"arithmetic: ops must be a non-empty subset of {OPS}, got {op_tuple!r}")
        if style not in STYLES:
            raise ValueError(f"arithmetic: style must be one of {STYLES}, got {style!r}")
        if modulus is not None and (not isinstance(modulus, int) or modulus < 2):
            raise ValueError(f"arithmetic: modulus must be an int >= 2 or null, got {modulus!r}")
        self.digits = digits
        self.modulus = modulus
        self.num_operands = num_operands
        self.ops = tuple(dict.fromkeys(op_tuple))  # dedupe, keep order: draws stay uniform over ops
        self.style = style
        self.show_work = bool(show_work)
        self.chat = style == "chat"
        self.stop = () if self.chat else ("\n",)

    def _problem(self, index: int, seed: int) -> Problem:
        rng = rng_for(self.name, seed, index)
        lo, hi = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10**self.digits - 1
        operands = [rng.randint(lo, hi) for _ in range(self.num_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
        chain = [evaluate(operands[: k + 1], ops[:k]) for k in range(self.num_operands)]
        if self.modulus is not None:
            chain = [v % self.modulus for v in chain]
        result = chain[-1]

        if self.style == "plain":
            prompt = _join(operands, ops, spaced=False) + "="
            answer = " ".join(map(str, chain)) if self.show_work else str(result)
        else:
            expr = _join(operands, ops, spaced=True)
            if self.show_work:
                prefixes = ", ".join(
                    _join(operands[: k + 1], ops[:k], spaced=True) for k in range(self.num_operands)
                )
                prompt = (
                    f"What is {expr}? Show your work: on the last line, write the values of "
                    f"{prefixes} in this order, separated by commas."
                )
                answer = ", ".join(map(str, chain))
            else:
                prompt = f"What is {expr}? Answer with just the number."
                answer = str(result)

        meta = {"operands": operands, "ops": ops, "chain": chain, "result": result,
                "index": index, "seed": seed}
        return Problem(prompt=prompt, answer=answer, meta=meta)

    def _answer_region(self, completion: str) -> str:
        if self.style == "plain":
            return completion.split("\n", 1)[0]
        if self.show_work:
            lines = [line for line in completion.splitlines() if line.strip()]
            return lines[-1] if lines else ""
        return completion

    def _format_ok(self, region: str) -> bool:
        n = self.num_operands if self.show_work else 1
        if self.style == "plain":
            shape = r"-?\d+(?: -?\d+)*"
            return re.fullmatch(shape, region) is not None and region.count(" ") == n - 1
        shape = r"\s*-?\d+(?:, -?\d+)*\s*\.?\s*"
        return re.fullmatch(shape, region) is not None and region.count(",") == n - 1

    def score(self, problem: Problem, completion: str) -> Reward:
        region = self._answer_region(completion)
        numbers = extract_numbers(region)
        chain = problem.meta["chain"]
        if self.show_work:
            correct = len(numbers) >= len(chain) and numbers[-len(chain):] == chain
        else:
            correct = bool(numbers) and numbers[-1] == problem.meta["result"]
        return self.reward(correct, self._format_ok(region))
