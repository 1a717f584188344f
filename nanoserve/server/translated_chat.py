"""The chat completion body that another protocol's request becomes (Anthropic's Messages,
OpenAI's Responses), so planning, generation and the tool and reasoning readers are the chat
endpoint's own.

Owns: what every such translation writes alike: the options the request gave (a None is one it
did not give, left to the chat endpoint's default), the usage a stream's last events report
(`stream_options.include_usage`), and function tools in the chat's shape.
Refuses: reading either protocol's fields (each protocol's module does, naming its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def function_tool(name: str, parameters: dict[str, Any] | None, description: str | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def chat_body(model: str | None, messages: list[dict[str, Any]], *, stream: bool, options: dict[str, Any],
              tools: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """A chat completion request's body; `options` with None values left out, `tools` as
    `function_tool` builds them."""
    chat: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    chat.update({key: value for key, value in options.items() if value is not None})
    if stream:
        chat["stream_options"] = {"include_usage": True}
    tools = list(tools)
    if tools:
        chat["tools"] = tools
    return chat
