"""Tool calling on /v1/chat/completions: the request's tools, the constraint they imply, and
the reply's tool calls, whole or streamed.

Owns: `ToolPlan.from_body` (checks `tools` and `tool_choice`, 400s naming the field; the
tools as the chat template wants them), the constraint each choice puts on the output: for
`"required"` or a named choice the schema of vLLM's shapes (a JSON array of {"name",
"parameters"}, of one item with `parallel_tool_calls: false`, or the named function's
arguments alone), for "auto" the model's format's lazy grammar (free text until the format's
opening marker, then only well-formed calls to the listed tools; `tool_formats` has them);
and `ToolCallReader`, which turns the generated text into content and `tool_calls`. In
"auto" the text before the opening marker is content and each call after it that parses and
names a listed tool is a call; a reply with no such call is all content.
Streaming: a named function streams its arguments as they come; "required" holds the array
and sends it whole when the choice ends; "auto" streams content until the opening marker
(holding a tail that may be its beginning), then sends each call once it is finished.
A reply cut by max_tokens (finish_reason "length") keeps the calls it completed: the whole
items of a "required" array, the finished calls of "auto"; the cut one is dropped.
Refuses: deprecated `functions` / `function_call` (protocol refuses them by name).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from nanoserve.sampling_params import StructuredOutputs
from nanoserve.server.errors import bad_request
from nanoserve.server.parsers.tool_formats import Hermes, RawCall, ToolFormat

CHOICES = ("none", "auto", "required")
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the body's tools ask of this request: `choice` is none, auto, required or a name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True  # OpenAI's parallel_tool_calls: false makes "required" and "auto" one call
    tool_format: ToolFormat = field(default_factory=Hermes)  # how the model writes calls in "auto"

    @classmethod
    def from_body(cls, body: Any, tool_format: ToolFormat | None = None) -> ToolPlan | None:
        if not body.tools:
            if body.tool_choice not in (None, "none", "auto"):
                raise bad_request("tool_choice needs tools to choose from", "tool_choice")
            return None
        tools = tuple(_tool(item, i) for i, item in enumerate(body.tools))
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise bad_request("each tool needs its own function name", "tools")
        parallel = getattr(body, "parallel_tool_calls", None) is not False
        return cls(tools, _choice(body.tool_choice, names), parallel, tool_format or Hermes())

    @property
    def named(self) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == self.choice), None)

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's arguments schema; one that names no type is an object's (the arguments
        are a JSON object, so "auto"'s grammar writes no other value)."""
        return {tool.name: {"type": "object", **tool.parameters} for tool in self.tools}

    @property
    def shows_special_tokens(self) -> bool:
        """Whether the reply must keep special tokens: "auto" reads markers that are special."""
        return self.choice == "auto" and self.tool_format.shows_special_tokens

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools]

    def constraint(self) -> StructuredOutputs | None:
        """What the output must follow: a named function's arguments, for "required" a
        non-empty array of calls, for "auto" the format's lazy grammar; None for "none"."""
        if self.named is not None:
            return StructuredOutputs(json=self.named.parameters, param="tool_choice")
        if self.choice == "auto":
            try:
                grammar = self.tool_format.auto_grammar(self.schemas, parallel=self.parallel)
            except ValueError as error:
                raise bad_request(f"{self.tool_format.name}: {error}", "tools") from None
            return StructuredOutputs(grammar=grammar, param="tools")
        if self.choice != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for tool in self.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=array, param="tools")

    def reader(self) -> ToolCallReader | None:
        return None if self.choice == "none" else ToolCallReader(self)


def _tool(item: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type") != "function":
        raise bad_request('each tool must be {"type": "function", "function": {...}}', f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        raise bad_request("a tool needs a function object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise bad_request("a function name is 1 to 64 letters, digits, '_', '.' or '-'",
                          f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request("a function description must be a string", f"{where}.function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad_request("function parameters must be a JSON schema object", f"{where}.function.parameters")
    return Tool(name, description, parameters)


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad_request(f"tool_choice must be one of {', '.join(CHOICES)} or a named function; "
                              f"got {value!r}", "tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools ({', '.join(names)})",
                          "tool_choice")
    return name


# -- reading the reply ---------------------------------------------------------------------------

def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(slots=True)
class ToolCallReader:
    """One choice's text into content and tool calls; `feed` for streams, `read` for the end."""

    plan: ToolPlan
    held: str = ""  # streamed text not yet sent: it may be (part of) a call
    opened: bool = False  # "auto": the stream has passed the opening marker
    sent_content: bool = False  # "auto": text went out as content (the reply's start is past)
    num_scanned: int = 0  # "auto": calls read from the held text so far, sent or not
    streamed_calls: list[dict[str, Any]] = field(default_factory=list)

    def read(self, text: str, *, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole reply; `cut`: max_tokens ended it, so the calls it
        completed count and the one it was writing does not."""
        if self.plan.named is not None:
            return None, [tool_call(self.plan.named.name, text)]
        if self.plan.choice == "required":
            calls = _complete_items(text) if cut else _json(text)
            if isinstance(calls, list):
                return None, [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                              for c in calls]
            return text, []
        start = self.plan.tool_format.find_opening(text)
        calls = self._calls(text[start:], final=not cut) if start >= 0 else []
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def _calls(self, text: str, *, final: bool) -> list[dict[str, Any]]:
        """The finished calls in `text` that name a listed tool, in the OpenAI shape."""
        scanned = self.plan.tool_format.scan(text, self.plan.schemas, final=final)
        return [_openai_call(call) for call in scanned if self._listed(call)]

    def _listed(self, call: RawCall | None) -> bool:
        return call is not None and any(tool.name == call.name for tool in self.plan.tools)

    def feed(self, delta: str, finished: bool, *, cut: bool = False) -> list[dict[str, Any]]:
        """The stream deltas for `delta`: content now, or tool-call parts (held when unsure);
        `cut` as for `read`."""
        if self.plan.named is not None:
            return self._feed_named(delta)
        if self.plan.choice == "required":
            return self._feed_required(delta, finished, cut)
        self.held += delta
        deltas = [] if self.opened else self._content_until_opening(finished)
        if self.opened:
            deltas += self._new_calls(final=finished and not cut)
        if finished and self.opened and not self.streamed_calls and self.held:
            deltas.append({"content": self.held})  # no call in it: the text was content
        return deltas

    def _content_until_opening(self, finished: bool) -> list[dict[str, Any]]:
        """Send the held text up to the opening marker (or up to a tail that may begin it)."""
        tool_format, at_start = self.plan.tool_format, not self.sent_content
        start = tool_format.find_opening(self.held, at_start=at_start)
        self.opened = start >= 0
        if not self.opened:
            start = len(self.held) if finished else tool_format.hold_from(self.held, at_start=at_start)
        content, self.held = self.held[:start], self.held[start:]
        self.sent_content = self.sent_content or bool(content)
        return [{"content": content}] if content else []

    def _new_calls(self, *, final: bool) -> list[dict[str, Any]]:
        scanned = self.plan.tool_format.scan(self.held, self.plan.schemas, final=final)
        fresh = [_openai_call(call) for call in scanned[self.num_scanned:] if self._listed(call)]
        self.num_scanned = len(scanned)
        first = len(self.streamed_calls)
        self.streamed_calls += fresh
        return [{"tool_calls": [{"index": first + i, **call}]} for i, call in enumerate(fresh)]

    def _feed_required(self, delta: str, finished: bool, cut: bool) -> list[dict[str, Any]]:
        self.held += delta
        if not finished:
            return []
        content, calls = self.read(self.held, cut=cut)
        self.streamed_calls = calls
        deltas = [{"content": content}] if content else []
        return deltas + [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]

    def _feed_named(self, delta: str) -> list[dict[str, Any]]:
        if not self.streamed_calls:
            self.streamed_calls = [tool_call(self.plan.named.name, delta)]
            return [{"tool_calls": [{"index": 0, **self.streamed_calls[0]}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else []


def _openai_call(call: RawCall) -> dict[str, Any]:
    return tool_call(call.name, json.dumps(call.arguments, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The whole items at the start of a JSON array the grammar wrote and max_tokens cut: the
    grammar fixed their shape, so each whole item is a call; the cut item is left out."""
    decoder, items = json.JSONDecoder(), []
    start = text.find("[")
    position = start + 1 if start >= 0 else len(text)
    while position < len(text):
        try:
            item, position = decoder.raw_decode(text, _SPACE.match(text, position).end())
        except ValueError:
            break
        items.append(item)
        position = _SPACE.match(text, position).end()
        if not text.startswith(",", position):
            break
        position += 1
    return items
