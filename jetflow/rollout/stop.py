"""Stop strings: the one rule both rollout engines follow (the native engine, jetflow.rollout.engine,
and the vLLM adapter, jetflow.rollout.vllm.adapter).

A request stops on a stop string once the text of its new tokens contains one, the text as the
engines report it: decoded with special tokens skipped. Only the tail that the newest token may have
completed is decoded, so the check costs the same at every step. The reported text is cut before the
first stop string it holds.
"""

from __future__ import annotations


def stop_window(stop: tuple[str, ...]) -> int:
    """How many trailing tokens to decode to see any stop string that the newest token may have
    completed: a text token decodes to at least one character, plus slack for tokens that only
    complete a multi-byte character. 0 without stop strings."""
    return max(len(s) for s in stop) + 2 if stop else 0


def hits_stop(tokenizer, tokens: list[int], stop: tuple[str, ...], window: int) -> bool:
    """Whether the newest of `tokens` completed one of the stop strings (window: `stop_window(stop)`)."""
    tail = tokenizer.decode(tokens[-window:], skip_special_tokens=True)
    return any(s in tail for s in stop)


def final_text(tokenizer, tokens: list[int], stop: tuple[str, ...], stopped: bool) -> str:
    """The text of a request's new tokens, special tokens skipped; cut before the first stop string
    when the request stopped on one (finish reason "stop")."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if stopped:
        text = text[:min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))]
    return text
