"""The reward of examples/tool_use: the final answer (the text after the last tool result) is the product."""


def correct_product(prompts, completions, product, **kwargs):
    """1 when the conversation's last words are the product, else 0."""
    scores = []
    for c, p in zip(completions, product):
        text = c if isinstance(c, str) else c[-1]["content"]  # raw text, or a chat conversation's messages
        answer = text.rsplit("</tool_response>", 1)[-1].strip()
        scores.append(1.0 if answer == str(p) else 0.0)
    return scores
