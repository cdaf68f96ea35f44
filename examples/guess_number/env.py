"""The environment of examples/guess_number: the model guesses a secret number from 1 to 8 and is told
"higher" or "lower" after each wrong guess (README: "Tools and environments").

jetflow builds one GuessNumber per conversation with its data row, and calls `step` with each model turn's
text; `step` returns (observation, reward, done): the observation is appended to the conversation as raw
text (no chat template here), the rewards of a conversation's turns are summed into its reward.
"""


class GuessNumber:
    def __init__(self, row: dict):
        self.secret = int(row["secret"])

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        guess = completion.strip()
        if not guess.isdigit():
            return "a number\n", 0.0, False
        if int(guess) == self.secret:
            return None, 1.0, True
        return ("higher\n" if int(guess) < self.secret else "lower\n"), 0.0, False
