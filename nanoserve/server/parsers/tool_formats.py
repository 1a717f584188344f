"""Tool-call formats: how each model family writes its calls, read back and constrained.

Owns: one `ToolFormat` per family, by vLLM's `--tool-call-parser` names: `hermes`
(`<tool_call>{"name", "arguments"}</tool_call>`), `llama3_json` (a reply that is
`{"name", "parameters"}`, optionally after `<|python_tag|>`, calls joined by "; "), `mistral`
(`[TOOL_CALLS]` then a JSON array of {"name", "arguments"}, or the newer
`[TOOL_CALLS]name[ARGS]{...}`), `qwen3_coder` (`<tool_call><function=NAME><parameter=P>value
</parameter></function></tool_call>`, each value typed by the tool's schema), `deepseek_v3`
(`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a
```json block) and `deepseek_v31` (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`);
`detect_format`, the family a chat template writes (as llama.cpp's common/chat.cpp tells it:
by the markers in the template's text); and `resolve_format`, the served model's format with
its markers spelled in its vocabulary.
Each format answers one interface: where the calls open in a reply (`find_opening`, and how
much of a streamed tail to hold back because the opening may be starting there), the calls in
the text from there (`scan`: the finished ones, a None for each that does not parse), and the
lazy grammar of `tool_choice: "auto"`: free text until the opening marker, then only calls to
the listed tools whose arguments follow their schemas (`auto_grammar`, llguidance's Lark: a
lazy lexeme ends the free text at the marker's first occurrence, or the marker is one added
token, which no free text can hold).
Refuses: the request's fields (`tool_calls` reads them) and compiling grammars
(`nanoserve.engine.structured`); a schema a format cannot enforce is a ValueError naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from nanoserve.engine.structured import JSON_OPTIONS

if TYPE_CHECKING:
    from nanoserve.tokenizer import Tokenizer

Schemas = Mapping[str, Mapping[str, Any]]  # each tool's name -> its parameters' JSON schema
_SPACE = re.compile(r"\s*")
_JSON = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class RawCall:
    """A call read from a reply: a name and its arguments as a JSON object."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The served model's added tokens by their text. llguidance keeps every added token apart
    from text, so a marker that is one is written in a grammar as that token; one that is also
    special only shows in the detokenized reply when special tokens are not skipped."""

    token_ids: Mapping[str, int] = field(default_factory=dict)
    special: frozenset[str] = frozenset()
    eos_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        added = tokenizer.backend.get_added_tokens_decoder()
        return cls({token.content: token_id for token_id, token in added.items()},
                   frozenset(token.content for token in added.values() if token.special),
                   frozenset(tokenizer.eos_token_ids))

    def free_tokens(self, markers: tuple[str, ...]) -> str:
        """The Lark item of the added tokens free text may hold (a think tag, a turn marker):
        all but the format's markers and EOS (which ends the reply); "" when there are none."""
        ids = sorted(i for text, i in self.token_ids.items() if text not in markers and i not in self.eos_ids)
        return f"<[{','.join(map(str, ids))}]>" if ids else ""

    def lark(self, marker: str) -> str:
        """The marker as a Lark item: its token, or its text."""
        token_id = self.token_ids.get(marker)
        return f"<[{token_id}]>" if token_id is not None else _lark_string(marker)


class ToolFormat:
    """One family's way of writing calls; an instance is bound to the served model's vocabulary."""

    name: ClassVar[str]
    opening: ClassVar[str]  # the marker that opens the calls
    markers: ClassVar[tuple[str, ...]]  # every marker the format writes

    def __init__(self, vocabulary: Vocabulary | None = None) -> None:
        self.vocabulary = vocabulary or Vocabulary()

    @property
    def shows_special_tokens(self) -> bool:
        """Whether the reply must be detokenized with special tokens: some marker is one."""
        return any(marker in self.vocabulary.special for marker in self.markers)

    def find_opening(self, text: str, *, at_start: bool = True) -> int:
        """Where the calls begin in `text`, or -1; `at_start`: the text begins the reply."""
        return text.find(self.opening)

    def hold_from(self, text: str, *, at_start: bool = True) -> int:
        """From where a streamed text must be held back: its tail may begin the opening marker."""
        for size in range(min(len(text), len(self.opening) - 1), 0, -1):
            if self.opening.startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        """The calls in `text` (from the opening marker on) that are finished, in order; None
        for one that does not parse. `final`: the reply ended, so a call its end cut short of
        a closing marker is tried too."""
        raise NotImplementedError

    def auto_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        """The Lark grammar of a reply in tool_choice "auto": free text, or free text and then
        the opening marker and calls (one unless `parallel`), nothing after them."""
        # Free text may not spell the marker out, or a call could go on unconstrained; added
        # tokens (the grammar library keeps them apart from text) come between its stretches.
        others = self.vocabulary.free_tokens(self.markers)
        rules = [f"FREE: /(?s:.*)/ & ~/(?s:.*){_regex(self.opening)}(?s:.*)/",
                 f"pre: (FREE {others})*" if others else "pre: \"\"", "free: pre FREE"]
        token_id = self.vocabulary.token_ids.get(self.opening)
        if token_id is not None:  # a token: the free text ends where the model takes it
            rules.insert(0, f"start: free | free <[{token_id}]> calls")
        else:  # text: the free text ends at the marker's first occurrence (a lazy lexeme)
            rules[:0] = ["start: free | pre head calls", f"head[lazy]: /(?s:.*){_regex(self.opening)}/"]
        return "\n".join(["%llguidance {}", *rules, self.calls_grammar(schemas, parallel=parallel)])

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        """Lark rules from `calls`: what follows the opening marker."""
        raise NotImplementedError


# -- the formats --------------------------------------------------------------------------------

class Hermes(ToolFormat):
    name = "hermes"
    opening = "<tool_call>"
    closing = "</tool_call>"
    markers = (opening, closing)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        bodies = [match.group(1) for match in self._CALL.finditer(text)]
        tail = text.rsplit(self.closing, 1)[-1] if bodies else text
        if final and self.opening in tail:
            bodies.append(tail.split(self.opening, 1)[1])
        return [_named_object(_json(body.strip()), "arguments") for body in bodies]

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        m = self.vocabulary.lark
        rules = [f'calls: "\\n" call "\\n" {m(self.closing)}'
                 + (f' ("\\n" {m(self.opening)} "\\n" call "\\n" {m(self.closing)})*' if parallel else ""),
                 f"call: {_json_lark(_named_calls(schemas, 'arguments'))}"]
        return "\n".join(rules)


class Llama3Json(ToolFormat):
    """Llama 3.1-3.3's JSON calls: the reply is calls or is content, never both (vLLM's llama3_json)."""

    name = "llama3_json"
    opening = "<|python_tag|>"
    markers = (opening,)
    separator = "; "

    def find_opening(self, text: str, *, at_start: bool = True) -> int:
        return 0 if at_start and text.startswith((self.opening, "{")) else -1

    def hold_from(self, text: str, *, at_start: bool = True) -> int:
        return 0 if at_start and self.opening.startswith(text) else len(text)

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        text = text.removeprefix(self.opening)
        calls, position = [], 0
        while True:
            value, position = _decode(text, position)
            if position < 0:
                break
            calls.append(_named_object(value, "parameters", "arguments"))
            position = _SPACE.match(text, position).end()
            if not text.startswith(";", position):
                break
            position += 1
        if final and not calls and text.strip():
            return [None]
        return calls

    def auto_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        token_id = self.vocabulary.token_ids.get(self.opening)
        tag = f"<[{token_id}]>" if token_id is not None else _lark_string(self.opening)
        calls = f'call ("{self.separator}" call)*' if parallel else "call"
        others = self.vocabulary.free_tokens(self.markers)
        return "\n".join([
            "%llguidance {}",
            "start: free | calls",
            # A reply that opens with "{" or the tag is a call; added tokens may come later.
            f"free: FIRST{f' ({others} FREE)*' if others else ''}",
            f"FIRST: (/(?s:)/ | /[^{{](?s:.*)/) & ~/{_regex(self.opening)}(?s:.*)/",
            "FREE: /(?s:.*)/",
            f"calls: {tag}? {calls}",
            f"call: {_json_lark(_named_calls(schemas, 'parameters'))}"])


class Mistral(ToolFormat):
    """`[TOOL_CALLS]` then a JSON array (Mistral 7B v0.3, Nemo), or `[TOOL_CALLS]name[ARGS]{...}`
    once per call (tokenizers from v11: Mistral Small 3.2, Magistral, Devstral). Both are read;
    the grammar writes the form the chat template uses (`args_form`)."""

    name = "mistral"
    opening = "[TOOL_CALLS]"
    args = "[ARGS]"
    markers = (opening, args)

    def __init__(self, vocabulary: Vocabulary | None = None, *, args_form: bool = False) -> None:
        super().__init__(vocabulary)
        self.args_form = args_form

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        calls: list[RawCall | None] = []
        for part in text.split(self.opening)[1:]:
            stripped = part.lstrip()
            if stripped.startswith("["):
                calls += [_named_object(item, "arguments") for item in _array_items(stripped)]
            elif self.args in part:
                name, arguments = part.split(self.args, 1)
                value, end = _decode(arguments, 0)
                if end >= 0:
                    calls.append(_call(name.strip(), value))
                elif final:
                    calls.append(None)
            elif final and stripped:
                calls.append(None)
        return calls

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        m = self.vocabulary.lark
        if not self.args_form:
            items = 'call (", " call)*' if parallel else "call"
            return "\n".join([f'calls: "[" {items} "]"',
                              f"call: {_json_lark(_named_calls(schemas, 'arguments'))}"])
        rules = [f"calls: call ({m(self.opening)} call)*" if parallel else "calls: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        rules += [f"call_{i}: {_lark_string(name)} {m(self.args)} {_json_lark(schema)}"
                  for i, (name, schema) in enumerate(schemas.items())]
        return "\n".join(rules)


class Qwen3Coder(ToolFormat):
    """Qwen3-Coder's XML: each parameter's value is raw text for a string, JSON for anything
    else (vLLM's qwen3_coder reads it back by the parameter's schema type)."""

    name = "qwen3_coder"
    opening = "<tool_call>"
    closing = "</tool_call>"
    markers = (opening, closing)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        bodies = [match.group(1) for match in self._CALL.finditer(text)]
        tail = text.rsplit(self.closing, 1)[-1] if bodies else text
        if final and self.opening in tail:
            bodies.append(tail.split(self.opening, 1)[1])
        return [self._read(body, schemas) for body in bodies]

    def _read(self, body: str, schemas: Schemas) -> RawCall | None:
        function = self._FUNCTION.match(body)
        if function is None:
            return None
        name = function.group(1).strip()
        properties = schemas.get(name, {}).get("properties", {})
        arguments = {}
        for match in self._PARAMETER.finditer(function.group(2)):
            key = match.group(1).strip()
            arguments[key] = _typed(_strip_newline(match.group(2)), properties.get(key, {}))
        return RawCall(name, arguments)

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        m = self.vocabulary.lark
        block = f'"\\n" call "\\n" {m(self.closing)}'
        rules = [f"calls: {block}" + (f' ("\\n" {m(self.opening)} {block})*' if parallel else ""),
                 "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        for i, (name, schema) in enumerate(schemas.items()):
            parameters = []
            for j, (key, value_schema, required) in enumerate(_parameters(name, schema)):
                value, extra = _xml_value(f"v_{i}_{j}", value_schema, f"{name}.{key}")
                parameters.append(f'({_lark_string(f"<parameter={key}>" + chr(10))} {value})'
                                  + ("" if required else "?"))
                rules += extra
            rules.append(f'call_{i}: {_lark_string(f"<function={name}>" + chr(10))} '
                         f'{" ".join(parameters)} "</function>"')
        return "\n".join(rules)


class DeepSeekV3(ToolFormat):
    """DeepSeek V3 and R1: each call's type, its name, and its arguments in a ```json block."""

    name = "deepseek_v3"
    opening = "<｜tool▁calls▁begin｜>"
    closing = "<｜tool▁calls▁end｜>"
    call_begin, call_end, separator = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (opening, closing, call_begin, call_end, separator)
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _BODY = re.compile(r"\s*function\s*<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```\s*$", re.DOTALL)

    def scan(self, text: str, schemas: Schemas, *, final: bool) -> list[RawCall | None]:
        return [self._read(match.group(1)) for match in self._CALL.finditer(text)]

    def _read(self, body: str) -> RawCall | None:
        match = self._BODY.match(body)
        return None if match is None else _call(match.group(1).strip(), _json(match.group(2)))

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        m = self.vocabulary.lark
        calls = 'call ("\\n" call)*' if parallel else "call"
        rules = [f"calls: {calls} {m(self.closing)}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        rules += [f'call_{i}: {m(self.call_begin)} "function" {m(self.separator)} '
                  f'{_lark_string(name + chr(10) + "```json" + chr(10))} {_json_lark(schema)} '
                  f'"\\n```" {m(self.call_end)}' for i, (name, schema) in enumerate(schemas.items())]
        return "\n".join(rules)


class DeepSeekV31(DeepSeekV3):
    """DeepSeek V3.1: the V3 markers around each call's name and its bare JSON arguments."""

    name = "deepseek_v31"
    _BODY = re.compile(r"\s*([^\n<]+?)\s*<｜tool▁sep｜>(.*)$", re.DOTALL)

    def calls_grammar(self, schemas: Schemas, *, parallel: bool) -> str:
        m = self.vocabulary.lark
        rules = [f"calls: {'call+' if parallel else 'call'} {m(self.closing)}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        rules += [f"call_{i}: {m(self.call_begin)} {_lark_string(name)} {m(self.separator)} "
                  f"{_json_lark(schema)} {m(self.call_end)}"
                  for i, (name, schema) in enumerate(schemas.items())]
        return "\n".join(rules)


FORMATS: dict[str, Callable[..., ToolFormat]] = {
    "hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral, "qwen3_coder": Qwen3Coder,
    "deepseek_v3": DeepSeekV3, "deepseek_v31": DeepSeekV31}
AUTO = "auto"
PARSER_CHOICES = (AUTO, *FORMATS)


def detect_format(chat_template: str | None) -> str:
    """The family a chat template writes calls in, by its markers (llama.cpp's order: the more
    specific shapes first); hermes, the commonest, when it names none."""
    source = chat_template or ""
    if "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if DeepSeekV3.opening in source:  # V3 and R1 write the arguments in a ```json block, V3.1 bare
        return "deepseek_v3" if "```json" in source else "deepseek_v31"
    if Hermes.opening in source:
        return "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in source or Llama3Json.opening in source:
        return "llama3_json"
    if Mistral.opening in source:
        return "mistral"
    return "hermes"


def resolve_format(parser: str, tokenizer: Tokenizer, chat_template: str | None = None) -> ToolFormat:
    """The format `parser` names (auto: the chat template's, the request's own if it sent one),
    bound to the model's vocabulary."""
    template = chat_template or tokenizer.chat_template
    name = detect_format(template) if parser == AUTO else parser
    vocabulary = Vocabulary.of(tokenizer)
    if name == "mistral":
        return Mistral(vocabulary, args_form=Mistral.args in (template or ""))
    return FORMATS[name](vocabulary)


# -- reading ------------------------------------------------------------------------------------

def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _decode(text: str, position: int) -> tuple[Any, int]:
    """The JSON value at `position` (after whitespace) and where it ends; -1 if none is whole."""
    try:
        return _JSON.raw_decode(text, _SPACE.match(text, position).end())
    except ValueError:
        return None, -1


def _array_items(text: str) -> list[Any]:
    """The whole items of the JSON array `text` starts with, as far as they are written."""
    items, position = [], 1
    while True:
        item, position = _decode(text, position)
        if position < 0:
            return items
        items.append(item)
        position = _SPACE.match(text, position).end()
        if not text.startswith(",", position):
            return items
        position += 1


def _call(name: str, arguments: Any) -> RawCall | None:
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return RawCall(name, arguments) if name and isinstance(arguments, dict) else None


def _named_object(value: Any, *argument_keys: str) -> RawCall | None:
    """A call from {"name", <arguments>}, the arguments under the first key present."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    return _call(value["name"], arguments)


def _strip_newline(value: str) -> str:
    """A parameter's value: the newline after its tag and the one before the closing tag are the
    format's, not the value's."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _raw_string(schema: Mapping[str, Any]) -> bool:
    """Whether qwen3_coder writes a value of `schema` as raw text: a string, or a choice of them."""
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    return schema.get("type", "string" if choices else None) == "string" and all(
        isinstance(choice, str) for choice in choices)


def _typed(value: str, schema: Mapping[str, Any]) -> Any:
    """A qwen3_coder value by its parameter's schema: raw text for a string (or an unknown
    parameter), else its JSON (the text itself if it is not JSON, as vLLM does)."""
    if _raw_string(schema) or not schema:
        return value
    parsed = _json(value)
    return value if parsed is None and value.strip() != "null" else parsed


# -- grammars -----------------------------------------------------------------------------------

def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")


def _json_lark(schema: Mapping[str, Any]) -> str:
    """An inline JSON schema, written with the separators the other grammars use."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _named_calls(schemas: Schemas, arguments_key: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, arguments_key: schema},
                       "required": ["name", arguments_key], "additionalProperties": False}
                      for name, schema in schemas.items()]}


def _parameters(name: str, schema: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    """A tool's parameters in its schema's order: (name, schema, required)."""
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), dict):
        raise ValueError(f"qwen3_coder writes a tool's arguments as named parameters; the parameters "
                         f"of {name!r} are not an object with properties")
    required = set(schema.get("required", ()))
    properties = schema.get("properties", {})
    unreadable = [key for key in properties if not key or re.search(r"[>\n]", key)]
    if unreadable:
        raise ValueError(f"qwen3_coder cannot write a parameter named {unreadable[0]!r} (of {name!r}): "
                         "a name ends at '>' or a line's end")
    return [(key, value, key in required) for key, value in properties.items()]


STRING_KEYWORDS = {"type", "description", "title", "enum", "const", "minLength", "maxLength", "default",
                   "examples"}


def _xml_value(rule: str, schema: Mapping[str, Any], where: str) -> tuple[str, list[str]]:
    """A parameter's value and closing tag as a Lark item, and the rules it needs: raw text for
    a string, JSON for anything else."""
    closing = '"\\n</parameter>\\n"'
    if not _raw_string(schema):
        return f"{_json_lark(schema)} {closing}", []
    unknown = sorted(set(schema) - STRING_KEYWORDS)
    if unknown:
        raise ValueError(f"qwen3_coder writes {where} as raw text, where {', '.join(unknown)} cannot be "
                         "enforced")
    choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if choices is not None:
        return "(" + " | ".join(_lark_string(str(choice)) for choice in choices) + f") {closing}", []
    least, most = schema.get("minLength", 0), schema.get("maxLength", "")
    # Raw text that ends at the first closing tag (a lazy lexeme), and holds no other closing
    # tag (the reader would end the value there).
    terminal = rule.upper()
    return rule, [f"{terminal}: /(?s:.{{{least},{most}}})/ & ~/(?s:.*)<\\/parameter>(?s:.*)/",
                  f"{rule}[suffix={closing}]: {terminal}"]


def check_parser(name: str) -> None:
    """A ValueError naming the choices unless `name` is one of PARSER_CHOICES."""
    if name not in PARSER_CHOICES:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_CHOICES)}; got {name!r}")
