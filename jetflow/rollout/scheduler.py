"""Continuous batching over a paged KV cache: which requests run, which wait, and who gives way when
the page pool runs out (the native engine's scheduler; jetflow.rollout.engine runs the forwards).

    sched = Scheduler(pool, max_batch)
    sched.add(sequences)                  # waiting, in order
    new = sched.admit()                   # moved to running, their prompt pages held: prefill them
    preempted = sched.grow()              # a page for every running row's next position (may preempt)
    ... decode the running rows ...
    sched.retire(seq)                     # finished: its pages go back to the pool at once

Admission: a waiting sequence starts as soon as a row is free (at most `max_batch` run) and the pool
holds its prompt's pages plus room for its first decoded token, in arrival order (a preempted sequence
first); `continuous=False` admits only into an empty batch (static batches, the engine's old
behaviour, kept to compare against). Growth: a running row whose next position opens a new 64-position
block gets a page; when none is free, the youngest running sequence (the last admitted) is preempted,
its pages freed and the sequence put back at the head of the queue to be recomputed from its prompt
(vLLM's recompute preemption), never an out-of-memory error. The engine restarts a preempted
sequence's sampler, so the recomputed tokens are the same (exact numerics: a row's arithmetic does not
depend on its neighbours).

Conversations (multi-turn): a sequence whose turn ended is parked (`park`: out of the batch, its pages
held) while its observation is made, then queued again (`resume`) with `prompt_len` set to the tokens
past those its pages hold; admission gives it the pages those need. When nothing runs and the next in
line cannot get its pages, `evict_idle` frees the pages of parked and queued conversations (they are
then recomputed from their whole context), so held pages never deadlock the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jetflow.kernels.paged import PAGE
from jetflow.model.paged_cache import PagePool


def pages_for(positions: int) -> int:
    """Pages holding positions [0, positions)."""
    return -(-positions // PAGE)


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it: its prompt length, the positions it has written, its pages."""

    prompt_len: int  # tokens its next prefill writes: the prompt, or a conversation's tokens past `written`
    request: object = None  # the engine's own state for it
    pages: list[int] = field(default_factory=list)
    written: int = 0  # positions [0, written) hold K/V
    admitted_at: int = -1  # admission counter: the youngest has the largest

    @property
    def next_position(self) -> int:
        return self.written


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, continuous: bool = True):
        self.pool, self.max_batch, self.continuous = pool, max_batch, continuous
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self._admissions = 0

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if pages_for(s.prompt_len + 1) > self.pool.num_pages:
                raise ValueError(f"a {s.prompt_len}-token prompt needs {pages_for(s.prompt_len + 1)} KV pages; the pool "
                                 f"has {self.pool.num_pages} (raise the KV cache budget)")
            self.waiting.append(s)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Sequence]:
        """Move the waiting sequences that fit to running (their prompt pages allocated); returns them."""
        if not self.continuous and self.running:
            return []
        new = []
        while self.waiting and len(self.running) < self.max_batch:
            s = self.waiting[0]
            end = s.written + s.prompt_len
            if self.pool.free_pages < pages_for(end + 1) - len(s.pages):  # its prompt and its first decoded token
                break
            self.waiting.popleft()
            s.pages += self.pool.alloc(pages_for(end) - len(s.pages)) or []
            s.admitted_at, self._admissions = self._admissions, self._admissions + 1
            self.running.append(s)
            new.append(s)
        return new

    def grow(self) -> list[Sequence]:
        """Give every running row a page for its next position, preempting the youngest while the pool is
        short; returns the preempted sequences (back at the head of the queue, pages freed, written = 0)."""
        preempted = []
        for s in list(self.running):  # oldest first: they keep their place
            if s not in self.running:  # preempted below, by an older row's need
                continue
            while pages_for(s.next_position + 1) > len(s.pages):
                got = self.pool.alloc(1)
                if got is not None:
                    s.pages += got
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is s:
                    break
        return preempted

    def retire(self, s: Sequence) -> None:
        """A finished sequence leaves the batch (or its parked place); its pages return to the pool."""
        if s in self.running:
            self.running.remove(s)
        self.pool.free(s.pages)
        s.pages = []

    def park(self, s: Sequence) -> None:
        """A conversation waits for its observation: out of the batch, its pages held."""
        self.running.remove(s)

    def resume(self, s: Sequence) -> None:
        """A parked conversation's observation came: queued to prefill its `prompt_len` new tokens."""
        self.waiting.append(s)

    def evict_idle(self, parked) -> None:
        """Nothing runs and the next in line cannot start: free the pages of the parked conversations and
        of those queued behind it (written = 0: each is recomputed from its whole context)."""
        for s in [*parked, *list(self.waiting)[1:]]:
            if s.pages:
                s.prompt_len += s.written
                self.drop_pages(s)

    def drop_pages(self, s: Sequence) -> None:
        """Free a sequence's pages: it will be recomputed from its first position (written = 0)."""
        self.pool.free(s.pages)
        s.pages, s.written = [], 0

    def recompute_running(self) -> list[Sequence]:
        """An in-flight weight update's re-prefill: every running sequence leaves the batch, its pages freed
        (written = 0), queued first in its admission order to be recomputed from its first position; returns them
        (the engine sets what their prefill writes)."""
        running, self.running = self.running, []
        for s in reversed(running):
            self.drop_pages(s)
            self.waiting.appendleft(s)
        return running

    def _preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        self.drop_pages(s)
        self.waiting.appendleft(s)
        self.preemptions += 1
