"""Writes examples/tool_use/multiply.jsonl: 2000 products of two 3-digit numbers.

Each row: the prompt ("123*456="), the product, and `answer`, the supervised warm-up's target: in 30% of
the rows the whole conversation with the tool as text (the model's tool call, the tool's result as the run
renders it without a chat template, the final answer), in the others the product written at once, as a model
answering alone would. The warm-up teaches both ways and the format of the call, and leaves the model
answering alone most of the time, which the tiny model cannot do (it does not learn to multiply); RL teaches
it to rely on the tool.

    python examples/tool_use/make_data.py
"""

import json
import random
from pathlib import Path

TOOL_SHARE = 0.3  # of the warm-up's answers that call the tool
rng = random.Random(0)
rows = []
for _ in range(2000):
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    answer = f"<tool_call>{call}</tool_call><tool_response>\n{a * b}\n</tool_response>{a * b}"
    if rng.random() >= TOOL_SHARE:
        answer = str(a * b)
    rows.append({"prompt": f"{a}*{b}=", "answer": answer, "product": a * b})
Path(__file__).with_name("multiply.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
