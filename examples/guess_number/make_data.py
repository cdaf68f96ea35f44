"""Writes examples/guess_number/games.jsonl: 2000 games, each a secret number from 1 to 8.

`answer` is the supervised warm-up's target: a game played by guessing at random among the numbers not yet
ruled out by name (a guess that was wrong is not repeated, but "higher" and "lower" are not used), written as
the conversation's text. The warm-up teaches the format and that a game ends on the secret; RL teaches the
model to use the answers (binary search finds any secret in 4 guesses).

    python examples/guess_number/make_data.py
"""

import json
import random
from pathlib import Path

rng = random.Random(0)
rows = []
for game in range(2000):
    secret = rng.randint(1, 8)
    left, text = list(range(1, 9)), ""
    while True:
        guess = rng.choice(left)
        left.remove(guess)
        text += f"{guess}\n"
        if guess == secret:
            break
        text += "higher\n" if guess < secret else "lower\n"
    rows.append({"prompt": f"game {game}: guess 1-8\n", "secret": secret, "answer": text.rstrip("\n")})
Path(__file__).with_name("games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
