"""The user's tools for multi-turn rollouts: plain Python functions, as TRL's ``GRPOTrainer(tools=[...])``
takes them.

    task:
      name: custom
      params:
        tools: [my_tools:multiply, tools/search.py:lookup]   # module:function or path/to/file.py:function

A tool is a function with type hints and a Google-style docstring (``Args:`` naming each parameter); its
JSON schema (transformers' ``get_json_schema``, the schema chat templates take as ``tools=``) is shown to
the model. ``async def`` tools are awaited. The model calls a tool in the run's tool-call format
(jetflow.rollout.tool_format); each call runs in a thread pool with a timeout.

What a tool does wrong at run time never ends the run (as in verl and TRL): an exception, a timeout, an
unknown name or arguments that do not fit its signature become an error text the model reads as the
tool's result, and are counted (multiturn/tool_errors). What is wrong before the run (a spec that does not
import, a function without type hints or docstring, two tools of one name) is one line (ToolError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from jetflow.errors import UserError
from jetflow.tasks.rewards import RewardError, first_line, load_function


class ToolError(UserError, ValueError):
    """A tool named in task.params.tools cannot be loaded or described to the model."""


@dataclass
class ToolResult:
    """One call's outcome: the text the model reads, and whether it is an error text."""

    content: str
    error: bool = False


@dataclass
class Tool:
    """A user's function with its schema ({"type": "function", "function": {name, description, parameters}})."""

    spec: str
    fn: Callable
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def call(self, arguments: Any, timeout_s: float, pool: concurrent.futures.Executor) -> ToolResult:
        """Run the tool on `arguments` (a dict of keyword arguments) in `pool`, at most `timeout_s` seconds;
        its result as text (str as it is, anything else as JSON), or an error text."""
        if not isinstance(arguments, dict):
            return ToolResult(f"Error: the arguments of {self.name} must be a JSON object, got "
                              f"{json.dumps(arguments)[:80]}", True)
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as e:
            return ToolResult(f"Error: {self.name}{inspect.signature(self.fn)} cannot take {json.dumps(arguments)[:120]}: "
                              f"{e}", True)
        future = pool.submit(_invoke, self.fn, arguments)
        try:
            value = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # a thread cannot be killed: a tool that hangs keeps its thread until it returns
            return ToolResult(f"Error: {self.name} timed out after {timeout_s:g} s", True)
        except Exception as e:  # the user's code: any exception is the model's to read
            return ToolResult(f"Error: {self.name} raised {first_line(e)}", True)
        return ToolResult(value if isinstance(value, str) else json.dumps(value, default=str))


def _invoke(fn: Callable, arguments: dict) -> Any:
    out = fn(**arguments)
    if inspect.isawaitable(out):
        async def wait():
            return await out
        out = asyncio.run(wait())
    return out


def tool_schema(spec: str, fn: Callable) -> dict:
    """The function's JSON schema as chat templates take it (transformers.utils.get_json_schema), or one line
    saying what the function lacks (type hints, a docstring, an ``Args:`` entry per parameter)."""
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ToolError(f"tool {spec}: its JSON schema cannot be made ({first_line(e)}); a tool needs type hints on "
                        "every parameter and a docstring with an Args: line per parameter, as TRL's tools") from None


def load_tools(specs: str | list[str] | None) -> list[Tool]:
    """task.params.tools as Tools, each imported and described; [] when none are named."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    tools = []
    for spec in specs:
        try:
            fn = load_function(str(spec), key="task.params.tools")
        except RewardError as e:
            raise ToolError(str(e).replace("reward ", "tool ", 1)) from None
        tools.append(Tool(str(spec), fn, tool_schema(str(spec), fn)))
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"task.params.tools: two tools are named {', '.join(twice)}; the model calls tools by name")
    return tools
