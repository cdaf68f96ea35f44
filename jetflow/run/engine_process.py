"""The rollout engine in a process of its own, beside the trainer (rollout.max_staleness > 0 under
run.orchestrator=local): the engine generates while the trainer trains, each on its share of the cores.

The child builds its engine from the run's config with the function it is given (jetflow.run.sides.
standalone_engine: its own model copy, whose weights the first sync replaces, as a Ray rollout actor's) and
serves the parent's calls in the order they were sent: `load_weights` (verified there as every sync is:
version, recipe fingerprint, checksum when sent) and `generate`. A call's tensors are copied, when it is sent,
into a shared-memory file of its own that the child maps (jetflow.run.shared_calls), and the rest of it travels
pickled over a pipe, as the replies do: a weight update is a copy of the trainer's tensors at the moment it is
sent, whatever the trainer does to its parameters afterwards. The child ignores SIGINT and SIGTERM: a stop
request is the parent's to answer (at its next step boundary), and the child ends when the parent closes the
pipe or exits.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

import torch

from jetflow.config import Config, Derived, from_dict, to_dict
from jetflow.errors import UserError
from jetflow.rollout.types import Rollouts
from jetflow.run import shared_calls
from jetflow.run.stop import RESUME_HINT
from jetflow.sync import WeightUpdate


class EngineProcessError(RuntimeError):
    """The engine's process failed (a bug there: its traceback is in the message)."""


class EngineProcessDied(UserError):
    """The engine's process ended under the run (killed, out of memory): one line; the run resumes."""


def thread_split(cfg: Config) -> tuple[int, int]:
    """(trainer threads, engine threads): rollout.engine_threads for the engine (0: half of run.num_threads, or of
    torch's default when that is 0, at least 1), the rest (at least 1) for the trainer."""
    total = cfg.run.num_threads or torch.get_num_threads()
    engine = cfg.rollout.engine_threads or max(1, total // 2)
    return max(1, total - engine), engine


def _serve(conn, build: Callable[[Config, Derived], Any], cfg_dict: dict, derived: Derived, num_threads: int) -> None:
    """The child: build the engine (`build(cfg, derived)`), then answer calls until the pipe closes. A reply is
    (ok, value, idle seconds before the call came, seconds the call took): value is the call's result, or (the
    exception, its traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    torch.set_num_threads(num_threads)
    try:
        engine = build(from_dict(cfg_dict), derived)
        conn.send_bytes(pickle.dumps((True, os.getpid(), 0.0, 0.0)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        conn.send_bytes(pickle.dumps((False, _portable(e), 0.0, 0.0)))
        return
    while True:
        t0 = time.perf_counter()
        try:
            method, args, kwargs = shared_calls.receive(conn)
        except (EOFError, OSError):  # the parent closed the pipe (or exited): a reset is a close too
            return
        t1 = time.perf_counter()
        idle = t1 - t0
        try:
            value = getattr(engine, method)(*args, **kwargs)
            reply = (True, value, idle, time.perf_counter() - t1)
        except BaseException as e:  # noqa: BLE001
            reply = (False, _portable(e), idle, time.perf_counter() - t1)
        try:
            conn.send_bytes(pickle.dumps(reply))
        except OSError:  # the parent is gone
            return


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a parent killed outright closes no pipe in time, and
    an engine in the middle of a long generation would run on for minutes)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _portable(e: BaseException) -> tuple[BaseException | None, str]:
    """An exception as the parent can get it: itself where it pickles (a UserError's one line), and its traceback."""
    text = "".join(traceback.format_exception(e))
    try:
        pickle.dumps(e)
        return e, text
    except Exception:  # noqa: BLE001
        return None, text


class EngineProcess:
    """The parent's handle on the engine's process: calls go out in order (`send` returns a ticket) and
    their replies come back in that order (`reply(ticket)` reads up to it; the replies of calls sent with
    `wanted=False`, a weight load's, are checked and dropped); `idle_s` adds up the engine's waits for its
    calls, as the replies read tell them; `close()` ends the child."""

    def __init__(self, build: Callable[[Config, Derived], Any], cfg: Config, derived: Derived, num_threads: int):
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the trainer's state or threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, build, to_dict(cfg), derived, num_threads),
                                    name="jetflow-engine", daemon=True)
        self._process.start()
        child.close()
        # calls are packed here (their tensors copied as they are now into shared memory) and written by a thread of
        # their own: a write blocks while the pipe is full, which is while the engine generates, and the trainer must
        # go on. A packed call holds its shared file's descriptor until it is written (or dropped: `close`)
        self._outbox: queue.Queue[tuple[bytes, int | None] | None] = queue.Queue()
        self._send_error: OSError | None = None
        self._sender = threading.Thread(target=self._write, name="jetflow-engine-calls", daemon=True)
        self._sender.start()
        self._sent = self._received = 0
        self._closed = False
        self._wanted: set[int] = set()
        self._held: dict[int, Any] = {}  # wanted replies read ahead of the ticket asked for
        self.idle_s = 0.0
        self.pid = self._take("starting the rollout engine")[0]
        self._received = 0  # the start's reply answers no call

    def _write(self) -> None:
        while (packed := self._outbox.get()) is not None:
            try:
                shared_calls.send(self._conn, *packed)
            except OSError as e:  # a broken pipe: the child is gone (said by the next send or reply)
                self._send_error = e
                self._drop_unsent()
                return

    def _drop_unsent(self) -> None:
        """Close the shared files of the calls not written (the child is gone, or the run ends before them)."""
        while True:
            try:
                packed = self._outbox.get_nowait()
            except queue.Empty:
                return
            if packed is not None and packed[1] is not None:
                os.close(packed[1])

    def send(self, method: str, *args, wanted: bool = True, **kwargs) -> int:
        if self._send_error is not None:
            self._died(f"sending call {self._sent + 1} ({method})")
        self._outbox.put(shared_calls.pack((method, args, kwargs)))
        self._sent += 1
        if wanted:
            self._wanted.add(self._sent)
        return self._sent

    def reply(self, ticket: int) -> tuple[Any, float]:
        """(the value call `ticket` returned, the seconds it took), the replies before it read (and their errors
        raised) first."""
        while ticket not in self._held:
            value = self._take(f"serving call {self._received + 1}")
            if self._received in self._wanted:
                self._wanted.discard(self._received)
                self._held[self._received] = value
        return self._held.pop(ticket)

    def _take(self, doing: str) -> Any:
        try:
            ok, value, idle, busy = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):  # the pipe closed or reset: the child is gone
            self._died(doing)
        self._received += 1
        self.idle_s += idle
        if not ok:
            error, text = value
            if isinstance(error, UserError):
                raise error  # bad input met in the engine: its one line
            raise EngineProcessError(f"the rollout engine's process failed while {doing}:\n{text}") from error
        return value, busy

    def _died(self, doing: str) -> NoReturn:
        self._process.join(5)
        code = self._process.exitcode
        raise EngineProcessDied(f"the rollout engine's process died while {doing} (exit code {code}"
                                f"{': killed by ' + signal.Signals(-code).name if code and code < 0 else ''}); "
                                f"from the run's newest checkpoint, {RESUME_HINT}") from None

    def close(self) -> None:
        self._outbox.put(None)
        self._sender.join(10)
        self._drop_unsent()  # after a failed write, or a sender stuck on a full pipe (the child's files go with it)
        self._outbox.put(None)  # the stop, if drained before a stuck sender read it
        if self._closed:
            return
        self._closed = True
        self._conn.close()  # the child, alive, ends on it; dead, its socket's calls in flight are freed with it
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._process.close()  # its sentinel's descriptor


class ProcessRollout:
    """The RL loop's rollout side (jetflow.rollout.types.RolloutEngineSide) when the engine has its own process.
    `build(cfg, derived)` makes the engine in the child (a module-level function: it crosses by name).
    `load_weights` returns at once (the engine loads the update after the calls before it; a failed check is
    raised with the next reply read); `submit` queues a generation and `collect` waits for it, so that the
    engine can generate while this process trains; `generate` is the two at once.

    In-flight weight updates (rollout.inflight_updates, jetflow.run.inflight): `submit(..., pause_at=n)` starts a
    batch that the engine pauses after n decode steps; the next `load_weights` sends, right behind the update, the
    call that finishes it under the new weights. A batch still paused when another is submitted or when it is
    collected (no update came) is finished under its version first. Every call still goes out, and its reply
    comes back, in order."""

    def __init__(self, build: Callable[[Config, Derived], Any], cfg: Config, derived: Derived, num_threads: int):
        self.process = EngineProcess(build, cfg, derived, num_threads)
        self.weight_version = -1  # the version of the last update sent (the engine's once it reaches it)
        self.busy_s = 0.0  # the seconds the engine took to generate the last batch collected
        self._paused: int | None = None  # the ticket of a batch started with pause_at, its finish not yet sent
        self._finish: dict[int, int] = {}  # a started batch's ticket -> its finish call's

    def load_weights(self, update: WeightUpdate) -> None:
        self.process.send("load_weights", update, wanted=False)
        self.weight_version = update.version
        self._finish_paused()  # the paused batch goes on under these weights

    def submit(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False,
               problems: list | None = None, pause_at: int | None = None) -> int:
        self._finish_paused()  # under its own version: no update came for it
        if pause_at is not None:
            self._paused = self.process.send("start", prompts, seeds, pause_at)
            return self._paused
        if problems is None:
            return self.process.send("generate", prompts, seeds, greedy)
        return self.process.send("generate", prompts, seeds, greedy, problems=problems)

    def collect(self, ticket: int) -> Rollouts:
        if ticket == self._paused:
            self._finish_paused()
        if ticket in self._finish:  # a started batch: the engine's seconds on its two parts
            _, started_s = self.process.reply(ticket)
            out, finished_s = self.process.reply(self._finish.pop(ticket))
            self.busy_s = started_s + finished_s
            return out
        out, self.busy_s = self.process.reply(ticket)
        return out

    @property
    def paused(self) -> bool:
        """Whether a batch started with pause_at waits for the next weight update."""
        return self._paused is not None

    def _finish_paused(self) -> None:
        if self._paused is not None:
            self._finish[self._paused] = self.process.send("finish")
            self._paused = None

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False,
                 problems: list | None = None) -> Rollouts:
        return self.collect(self.submit(prompts, seeds, greedy, problems))

    def take_idle(self) -> float:
        """The engine's idle seconds (waiting for this process's calls) in the replies read since the last call."""
        idle, self.process.idle_s = self.process.idle_s, 0.0
        return idle

    def close(self) -> None:
        self.process.close()
