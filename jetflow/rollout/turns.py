"""Token-in-token-out: the ids of a multi-turn conversation, built by appending, never re-tokenized.

A conversation's ids are its prompt's ids, then each model turn's ids as the engine sampled them, then
each observation's ids (a tool's result or an environment's answer) as this module renders them, and so
on. The trainer trains on exactly these ids. Re-rendering the conversation as messages and tokenizing it
again (message mode) can give other ids: chat templates are not append-only, and a turn's text does not
always tokenize back to the ids sampled (`retokenized_differs` measures how often).

An observation's ids are the chat template's own text for it, found as a difference of two renderings:
the text the template puts after an assistant message (ChatML's "<|im_end|>\\n"; the part the model
already sampled, its EOS, left out), then the text that appending the observation's messages and the
next generation prompt adds. Without a chat template (raw-text tasks) an observation is its text.

Tools reach the model through the template (``tools=`` where the template uses them), or, where it has
none (SmolLM2's ChatML, the tiny model's), as a system message in the tool format's words; tool results
are then user messages in the format's wrapping (hermes: <tool_response> ... </tool_response>), as
Qwen2.5's template renders them. A raw-text prompt (no chat template) is the user's text as it is: no
schema is added (the prompt describes its tools itself), and a tool result is its wrapping alone.
"""

from __future__ import annotations

from jetflow.model.tokenizer import encode_prompt, render_prompt
from jetflow.rollout.tool_format import FORMATS, ToolFormat

_SENTINEL = "\x00jetflow-assistant-content\x00"
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]


class TemplateError(ValueError):
    """The chat template cannot append an observation to a conversation (it is not a prefix renderer)."""


class TurnRenderer:
    """The ids of prompts and observations for one run's tokenizer, chat setting, tools and tool format."""

    def __init__(self, tokenizer, chat: bool, tools: list[dict] | None = None, fmt: ToolFormat | None = None):
        if tools and fmt is None:
            raise ValueError("TurnRenderer: tools need a tool format")
        self.tok, self.tools = tokenizer, list(tools or [])
        self.fmt: ToolFormat = fmt or FORMATS["hermes"]  # read only where there are tools
        self.chat = bool(chat and tokenizer.chat_template)
        self.native_tools = self.chat and "tools" in tokenizer.chat_template  # the template renders tools=
        self.eos_texts = {tokenizer.decode([i]) for i in {tokenizer.eos_token_id} if i is not None}
        self._base: str | None = None  # the template's rendering of _BASE (read on first use)

    # -- the prompt ---------------------------------------------------------------------------------

    def prompt_messages(self, prompt: str | list[dict]) -> list[dict]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.tools and not self.native_tools:  # the tools as a system message (merged into one there is)
            text = self.fmt.system_prompt(self.tools)
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
            else:
                messages.insert(0, {"role": "system", "content": text})
        return messages

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.native_tools and self.tools else {}
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs)

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """The ids a conversation starts from (encode_prompt's, with the tools where the run has them)."""
        if not self.tools or not self.chat:  # a raw-text prompt is the user's text as it is (no schema added)
            return encode_prompt(self.tok, prompt, self.chat)
        return self.tok.encode(self._render(self.prompt_messages(prompt), True))

    # -- observations ---------------------------------------------------------------------------------

    def observation_messages(self, kind: str, contents: list[str]) -> list[dict]:
        """`kind` "tool": each a tool's result; "env": one environment observation (a user message)."""
        if kind == "env":
            return [{"role": "user", "content": c} for c in contents]
        if self.native_tools:
            return [{"role": "tool", "content": c} for c in contents]
        return [{"role": "user", "content": "\n".join(self.fmt.result_text(c) for c in contents)}]

    def observation_text(self, messages: list[dict], turn_ended_with_eos: bool) -> str:
        """The text appended after a model turn: the template's close of the turn (less the EOS the model
        sampled), the observation's messages and the next generation prompt."""
        if not self.chat:
            return "".join(m["content"] for m in messages)
        base = self._base_text()
        full = self._render(_BASE + messages, True)
        if not full.startswith(base):
            raise TemplateError("the chat template renders a conversation differently once an observation is appended "
                                "(it is not append-only), so an observation cannot be appended as token ids")
        suffix = base[base.index(_SENTINEL) + len(_SENTINEL):]  # the template's text after an assistant message
        if turn_ended_with_eos:
            for eos in self.eos_texts:
                if eos and suffix.startswith(eos):
                    suffix = suffix[len(eos):]
                    break
        return suffix + full[len(base):]

    def observation_ids(self, messages: list[dict], turn_ended_with_eos: bool) -> list[int]:
        return self.tok.encode(self.observation_text(messages, turn_ended_with_eos))

    def _base_text(self) -> str:
        """A user message and an assistant message, rendered once (the template does not change)."""
        if self._base is None:
            base = self._render(_BASE, False)
            if _SENTINEL not in base:
                raise TemplateError("the chat template does not render an assistant message's content")
            self._base = base
        return self._base

    # -- the diagnostic: what message mode would have trained on ---------------------------------------

    def message_mode_ids(self, prompt: str | list[dict], messages: list[dict]) -> list[int]:
        """The conversation re-rendered from its messages (the model's turns as decoded text) and tokenized
        again, as a trainer that keeps messages instead of ids would."""
        if not self.chat:
            return self.tok.encode(render_prompt(self.tok, prompt, False) + "".join(m["content"] for m in messages))
        return self.tok.encode(self._render(self.prompt_messages(prompt) + messages, False))


def retokenized_differs(trained: list[int], retokenized: list[int], chat: bool, eos_ids: frozenset[int]) -> bool:
    """Whether message mode's ids differ from the ids trained on (the response's part of them). The
    template's close after the last turn (past the trained ids) is not a difference; without a template
    the EOS ids the model sampled are not text, so they are left out of both sides."""
    if not chat:
        trained, retokenized = [t for t in trained if t not in eos_ids], [t for t in retokenized if t not in eos_ids]
    return retokenized[:len(trained)] != trained
