"""The conversations of one native-engine generate() (jetflow.rollout.engine, `on_turn_end`): a request whose
turn ended is parked, its pages held, while its observation is made, then its observation is appended and it is
queued to prefill only the new tokens."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable

from jetflow.rollout.scheduler import Scheduler, Sequence


def observation_fits(context_len: int, observation_len: int, total: int | None) -> bool:
    """Whether an observation may join a conversation of `context_len` tokens: within max_total_tokens (`total`;
    None: no budget) with room left for one more model token. The rule of every engine (jetflow.rollout.turn_loop
    too); a conversation whose observation does not fit ends "length"."""
    return total is None or context_len + observation_len + 1 <= total


class Turns:
    """The conversations of one generate(): who waits for an observation, and the appending of it."""

    def __init__(self, on_turn_end: Callable[[int, list[int], str], Future | None], total: int | None,
                 reprefill: bool = False):
        self.on_turn_end, self.total, self.reprefill = on_turn_end, total, reprefill
        self.parked: dict[Sequence, Future] = {}  # waiting for their observations, pages held

    def turn_ended(self, s: Sequence, sched: Scheduler) -> bool:
        """A turn ended on EOS or a stop string: hand it over; True when the conversation goes on (parked)."""
        r: Any = s.request  # the engine's _Request
        future = self.on_turn_end(r.index, r.tokens[r.turn_start:], r.finish_reason)
        if future is None:
            return False
        sched.park(s)
        self.parked[s] = future
        return True

    def resume_ready(self, sched: Scheduler, block: bool) -> None:
        """Append the observations that have come (waiting for one when nothing else can run); a conversation
        whose observation is None is over, one whose observation does not fit max_total_tokens ends "length"."""
        if not self.parked:
            return
        if block:
            wait(self.parked.values(), return_when=FIRST_COMPLETED)
        for s, future in [(s, f) for s, f in self.parked.items() if f.done()]:
            del self.parked[s]
            r: Any = s.request  # the engine's _Request
            ids = future.result()  # an environment's error ends the generate here
            if ids is not None and not observation_fits(r.context_len, len(ids), self.total):
                r.finish_reason, ids = "length", None  # trained on what it has
            if ids is None:
                sched.retire(s)
                continue
            r.tokens += ids
            r.logprobs += [0.0] * len(ids)
            r.mask += [0] * len(ids)
            r.turn_start, r.finish_reason = len(r.tokens), None
            if self.reprefill:  # the cost page reuse saves: the whole conversation again
                sched.drop_pages(s)
            s.prompt_len = r.context_len - s.written  # the last sampled token and the observation
            sched.resume(s)
