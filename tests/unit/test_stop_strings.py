"""The stop-string rule both rollout engines share (jetflow.rollout.stop): matched in the text as the
engines report it, special tokens skipped, and the reported text cut before the stop string."""

from __future__ import annotations

from jetflow.model import CharTokenizer
from jetflow.rollout.stop import final_text, hits_stop, stop_window

TOK = CharTokenizer("abcdefgh.")  # ids: 0 <pad>, 1 <s>, 2 </s>, then a=3, b=4, ...
A, B, C, D = 3, 4, 5, 6


def test_a_stop_string_split_by_a_special_token_still_stops():
    """'ab' across a <s> token: the text the engine reports is 'ab' (the vLLM adapter's own copy decoded
    'a<s>b' and missed it)."""
    window = stop_window(("ab",))
    assert window == 4  # len('ab') + 2
    assert TOK.decode([A, 1, B]) == "a<s>b"  # what decoding without skip_special_tokens sees
    assert hits_stop(TOK, [C, A, 1, B], ("ab",), window)
    assert not hits_stop(TOK, [C, A, 1], ("ab",), window)


def test_only_the_tail_that_the_newest_token_completes_is_read():
    window = stop_window(("cd",))
    assert hits_stop(TOK, [A, B, C, D], ("cd",), window)
    assert not hits_stop(TOK, [C, D] + [A] * window, ("cd",), window)  # completed long ago: out of the tail
    assert stop_window(()) == 0


def test_final_text_skips_special_tokens_and_cuts_before_the_stop_string():
    tokens = [A, 1, B, C, D, A]  # a <s> b c d a
    assert final_text(TOK, tokens, ("cd",), stopped=True) == "ab"
    assert final_text(TOK, tokens, ("cd",), stopped=False) == "abcda"
    assert final_text(TOK, tokens, ("xy", "da"), stopped=True) == "abc"  # the first stop string in the text
