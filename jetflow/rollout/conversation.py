"""Multi-turn rollouts: the conversations above the engine (the native engine runs them in its scheduler,
vLLM turn by turn through jetflow.rollout.turn_loop; Ray placement refuses multi-turn in jetflow.run.validate).

    driver = conversation_driver(cfg, task, tokenizer)   # None when rollout.max_turns == 1
    convs = driver.start(problems)                       # one Conversation per request (an env from its row)
    future = driver.after_turn(i, turn_ids, reason)      # the engine's hand-over at each turn's end
    ...                                                  # -> the ids of the next observation, or None: over

After each model turn the driver reads the turn's text: with tools, the calls in it (the run's tool format)
run in a thread pool, each at most tool_timeout_s, and their results become the next observation; a turn
without a call is the final answer. With an environment, its `step(text)` gives the observation, a reward
and whether the conversation is over. The observation's token ids are rendered by the TurnRenderer
(token in, token out) and appended by the engine to the same sequence. A conversation ends after
max_turns model turns, when the model answers without a call, when the environment says done, or when it
runs out of tokens (the engine's "length").

A tool's failure (an exception, a timeout, malformed JSON, an unknown name, arguments that do not fit) is
an error text the model reads, counted in `tool_errors`; an environment's is an EnvError that ends the run.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from jetflow.config import Config
from jetflow.rollout.tool_format import ToolFormat, tool_format
from jetflow.rollout.turns import TurnRenderer, retokenized_differs
from jetflow.rollout.types import Rollouts
from jetflow.tasks import Problem, Task
from jetflow.tasks.environment import Environment
from jetflow.tasks.tools import Tool, ToolResult


@dataclass
class Conversation:
    """One conversation: its prompt, its environment, and what happened in it."""

    index: int
    prompt: str | list[dict]  # as the task gives it (text or messages)
    env: Environment | None = None
    messages: list[dict] = field(default_factory=list)  # after the prompt: assistant, tool and user messages
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0  # the environment's rewards, summed over the turns


class ConversationDriver:
    """The turns of a batch of conversations: tools or an environment, rendered as token ids."""

    def __init__(self, renderer: TurnRenderer, tools: list[Tool], env_spec: str | None, env_class: type | None,
                 fmt: ToolFormat, max_turns: int, tool_timeout_s: float,
                 row_of: Callable[[Problem], tuple[dict, str]], workers: int = 8):
        self.renderer, self.fmt, self.row_of = renderer, fmt, row_of
        self.tools = {t.name: t for t in tools}
        self.env_spec, self.env_class = env_spec, env_class
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
        self.workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # observations are made here
        self._tool_pool: concurrent.futures.ThreadPoolExecutor | None = None  # the tools run here, with a timeout
        self.conversations: list[Conversation] = []

    @property
    def stop(self) -> tuple[str, ...]:
        """The strings that end a turn besides EOS (a tool call's close)."""
        return self.fmt.stops if self.tools else ()

    def start(self, problems: list[Problem]) -> list[Conversation]:
        """A conversation per request (an environment built from its problem's data row)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="jetflow-turn")
            self._tool_pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="jetflow-tool")
        self.conversations = [
            Conversation(i, p.prompt, Environment(str(self.env_spec), self.env_class, *self.row_of(p))
                         if self.env_class else None)
            for i, p in enumerate(problems)]
        return self.conversations

    def after_turn(self, index: int, turn_ids: list[int], reason: str) -> Future | None:
        """Conversation `index`'s model turn ended (EOS or a stop string): a Future of the next observation's
        ids (None when the conversation is over), or None when it is over now."""
        conv = self.conversations[index]
        text = self.renderer.tok.decode(turn_ids, skip_special_tokens=True)
        conv.messages.append({"role": "assistant", "content": text})
        conv.turns += 1
        ended_with_eos = reason == "eos"
        last = conv.turns >= self.max_turns
        assert self._pool is not None
        if conv.env is not None:  # stepped on every turn (the last one too: its reward counts)
            return self._pool.submit(self._env_observation, conv, text, ended_with_eos, last)
        if last or not self.tools:
            return None
        calls = self.fmt.parse(text)
        if not calls:
            return None  # the final answer
        return self._pool.submit(self._tool_observation, conv, calls, ended_with_eos)

    def _env_observation(self, conv: Conversation, text: str, ended_with_eos: bool, last: bool) -> list[int] | None:
        assert conv.env is not None
        observation, reward, done = conv.env.step(text)
        conv.env_reward += reward
        if done or last or observation is None:
            return None
        messages = self.renderer.observation_messages("env", [observation])
        conv.messages += messages
        return self.renderer.observation_ids(messages, ended_with_eos)

    def _tool_observation(self, conv: Conversation, calls, ended_with_eos: bool) -> list[int]:
        results = [self._call(c) for c in calls]
        conv.tool_calls += len(calls)
        conv.tool_errors += sum(r.error for r in results)
        messages = self.renderer.observation_messages("tool", [r.content for r in results])
        conv.messages += messages
        return self.renderer.observation_ids(messages, ended_with_eos)

    def _call(self, call) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.error, True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}", True)
        assert self._tool_pool is not None
        return tool.call(call.arguments, self.tool_timeout_s, self._tool_pool)

    def completions(self) -> list[str | list[dict]]:
        """What the reward functions get as each completion (TRL's convention): the conversation's messages
        after the prompt for a chat prompt, its text for a raw-text one."""
        return [c.messages if self.renderer.chat else "".join(m["content"] for m in c.messages)
                for c in self.conversations]

    def rollouts(self, prompts_ids: list[list[int]], token_ids: list[list[int]], logprobs: list[list[float]],
                 masks: list[list[int]], texts: list[str], reasons: list[str], version: int,
                 eos_ids: frozenset[int]) -> Rollouts:
        """The engine's conversations as the loop takes them: the tokens after each prompt with their mask, and
        what the driver holds (the reward functions' completions, the environment's rewards, the turn stats).
        The messages follow the ids: a last turn that ran out of tokens (never handed to the driver) joins
        them, an observation that did not fit in max_total_tokens (not appended to the ids) leaves them."""
        for conv, tokens, mask in zip(self.conversations, token_ids, masks):
            starts = [j for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1])]
            if len(starts) > sum(m["role"] == "assistant" for m in conv.messages):
                cut = tokens[starts[-1]:]
                conv.messages.append({"role": "assistant", "content": self.renderer.tok.decode(cut, skip_special_tokens=True)})
            while mask and mask[-1] and conv.messages[-1]["role"] != "assistant":
                conv.messages.pop()
        return Rollouts(token_ids=token_ids, logprobs=logprobs, texts=texts, finish_reasons=reasons,
                        weight_version=version, token_masks=masks, completions=self.completions(),
                        env_rewards=[c.env_reward for c in self.conversations],
                        turn_stats=self.turn_stats(prompts_ids, token_ids, eos_ids))

    def turn_stats(self, prompts_ids: list[list[int]], responses: list[list[int]],
                   eos_ids: frozenset[int]) -> list[dict[str, float]]:
        """Per conversation: its model turns (the last one too when it ran out of tokens), tool calls and
        errors, and whether message mode's re-tokenization of it differs from the ids trained on
        (`multiturn_metrics` averages them over a batch)."""
        return [{"turns": float(sum(m["role"] == "assistant" for m in c.messages)), "tool_calls": float(c.tool_calls),
                 "tool_errors": float(c.tool_errors),
                 "retokenize_differs": float(retokenized_differs(p + r, self.renderer.message_mode_ids(c.prompt, c.messages),
                                                                 self.renderer.chat, eos_ids))}
                for c, p, r in zip(self.conversations, prompts_ids, responses)]

    def close(self) -> None:
        for pool in (self._pool, self._tool_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._tool_pool = None


def multiturn_metrics(turn_stats: list[dict[str, float]], masks: list[list[int]]) -> dict[str, float]:
    """multiturn/*: turns and tool calls per conversation, the tool errors of the batch, the observations'
    share of the response tokens, and the share of conversations whose message-mode re-tokenization
    (re-rendering the messages, tokenizing again) differs from the ids trained on."""
    n, tokens = max(len(turn_stats), 1), max(sum(len(m) for m in masks), 1)
    mean = lambda key: sum(s[key] for s in turn_stats) / n  # noqa: E731
    return {"multiturn/turns_mean": mean("turns"), "multiturn/tool_calls_mean": mean("tool_calls"),
            "multiturn/tool_errors": float(sum(s["tool_errors"] for s in turn_stats)),
            "multiturn/observation_tokens_frac": sum(len(m) - sum(m) for m in masks) / tokens,
            "multiturn/retokenize_mismatch_frac": mean("retokenize_differs")}


def turn_renderer(cfg: Config, task: Task, tokenizer) -> TurnRenderer:
    """The run's renderer of prompts (with the task's tools, where it has any) and observations."""
    tools = [t.schema for t in getattr(task, "tools", [])]
    return TurnRenderer(tokenizer, task.uses_chat(cfg.model.chat_template), tools,
                        tool_format(cfg.rollout.tool_format) if tools else None)


def conversation_driver(cfg: Config, task: Task, tokenizer) -> ConversationDriver | None:
    """The multi-turn driver of a run with rollout.max_turns > 1 (a custom task with tools or an environment;
    jetflow.run.validate checks it), else None: one turn, as ever."""
    if cfg.rollout.max_turns <= 1:
        return None
    r = cfg.rollout
    return ConversationDriver(turn_renderer(cfg, task, tokenizer), getattr(task, "tools", []), getattr(task, "env", None),
                              getattr(task, "env_class", None), tool_format(r.tool_format), r.max_turns, r.tool_timeout_s,
                              row_of=task.row_of)
