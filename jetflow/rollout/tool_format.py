"""Tool-call formats: how a model writes a call in its text, and how the tools and their results are
written back to it where the chat template has no tool support of its own. One registry
(`rollout.tool_format`); a failed lookup lists the valid names.

    fmt = tool_format("hermes")
    calls = fmt.parse(text)        # [ToolCall(name, arguments) | ToolCall(error=...)], in order
    fmt.stops                      # the strings that end a turn with a call (("</tool_call>",))

hermes (the default; vLLM's `hermes` parser, Qwen2.5 / Hermes 2 Pro templates):
``<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>``. A call whose JSON does not
parse or lacks a name is an error the model reads as the call's result, not a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    """One call parsed from a turn: a name and its arguments, or what is wrong with it."""

    name: str = ""
    arguments: Any = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ToolFormat:
    name: str
    stops: tuple[str, ...]
    """A turn that calls a tool ends at any of these (the engine stops the turn there)."""
    parse: Callable[[str], list[ToolCall]]
    system_prompt: Callable[[list[dict]], str]
    """The tools' schemas and the call syntax as a system message, for a template with no tool support."""
    result_text: Callable[[str], str]
    """A tool's result as the content of a user message, for a template with no `tool` role."""


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for closed, open_ in _HERMES.findall(text):
        body = (closed or open_).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"Error: the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(error='Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        calls.append(ToolCall(value["name"], value.get("arguments", {})))
    return calls


def hermes_system_prompt(schemas: list[dict]) -> str:
    listed = "\n".join(json.dumps(s) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


FORMATS = {
    "hermes": ToolFormat("hermes", ("</tool_call>",), parse_hermes, hermes_system_prompt,
                         lambda content: f"<tool_response>\n{content}\n</tool_response>"),
}


def tool_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"rollout.tool_format={name!r}: valid formats are {', '.join(sorted(FORMATS))}") from None
