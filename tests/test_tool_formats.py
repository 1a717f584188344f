"""Tool-call formats (nanoserve/server/parsers/tool_formats.py) read on literal model texts, whole
and streamed, their detection from chat templates, and their "auto" grammars walked at random
on the tiny tokenizer: every call a walk writes parses and validates against its tool's schema.

The texts follow each family's documented output: Hermes 2 Pro / Qwen 2.5, Llama 3.1's JSON
calls, Mistral's two forms (v0.3 array and v11 `[ARGS]`), Qwen3-Coder's XML, DeepSeek V3's
markers (as vLLM's tool parsers of the same names read them)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
from typer.testing import CliRunner

from nanoserve.server.parsers.tool_calls import ToolPlan
from nanoserve.server.parsers.tool_formats import (
    FORMATS,
    Mistral,
    ToolFormat,
    Vocabulary,
    check_parser,
    detect_format,
)
from nanoserve.tokenizer import Tokenizer
from nanoserve_cli.main import app

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}
PLACE = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                              "items": {"type": "string"}},
                                          "near": {"type": "object"}, "open": {"type": "boolean"}},
         "required": ["name"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "find_place", "parameters": PLACE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "find_place": PLACE}
ROME = {"city": "Rome", "unit": "c"}

# (format, model text, content, [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>', None,
     [("get_time", {"zone": 2})]),
    ("hermes", 'Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n'
               '</tool_call>',
     "Let me look.", [("get_time", {"zone": 1}), ("get_weather", ROME)]),
    ("hermes", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": 3}}', None,
     [("get_time", {"zone": 3})]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": 3}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', None,
     [("get_time", {"zone": 3}), ("get_weather", ROME)]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", 'It is {"zone": 3}.', 'It is {"zone": 3}.', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 3}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]', None,
     [("get_time", {"zone": 3}), ("get_weather", ROME)]),
    ("mistral", 'Checking.[TOOL_CALLS]get_time[ARGS]{"zone": -4}[TOOL_CALLS]get_weather[ARGS]'
                '{"city": "Rome", "unit": "c"}', "Checking.",
     [("get_time", {"zone": -4}), ("get_weather", ROME)]),
    ("mistral", "[TOOL_CALLS]nothing here", "[TOOL_CALLS]nothing here", []),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
                    "</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
     "I will check.", [("get_weather", {"city": "New York", "unit": "c"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\n-3\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=find_place>\n<parameter=name>\n42\n</parameter>\n"
                    '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=near>\n{"x": 1}\n</parameter>\n'
                    "<parameter=open>\ntrue\n</parameter>\n</function>\n</tool_call>", None,
     [("get_time", {"zone": -3}),
      ("find_place", {"name": "42", "tags": ["a", "b"], "near": {"x": 1}, "open": True})]),
    ("qwen3_coder", "<tool_call>\n<function=launch>\n</function>\n</tool_call>",
     "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                    '```json\n{"zone": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                    '<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome", "unit": "c"}\n```'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None,
     [("get_time", {"zone": 3}), ("get_weather", ROME)]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": 3}"
                     "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Rome", "unit": "c"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_time", {"zone": 3}), ("get_weather", ROME)]),
    ("deepseek_v31", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": x}"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": x}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    ("deepseek_v3", "Sure. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                    '```json\n{"zone": 0}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure.",
     [("get_time", {"zone": 0})]),
]


def reader(parser: str, choice: str = "auto"):
    body = SimpleNamespace(tools=TOOLS, tool_choice=choice)
    return ToolPlan.from_body(body, FORMATS[parser]()).reader()


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_format_reads_its_calls_and_leaves_other_text_as_content(parser, text, content, calls) -> None:
    got_content, got_calls = reader(parser).read(text)
    assert got_content == content
    assert named(got_calls) == calls


def streamed(parser: str, text: str, size: int) -> tuple[str, list[dict], list[int]]:
    """The text fed in pieces of `size` characters: the content joined, the calls joined from
    their deltas, and how many pieces had been fed when each call arrived."""
    stream, content, calls, arrivals = reader(parser), "", {}, []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for n, piece in enumerate(pieces, 1):
        for delta in stream.feed(piece, finished=n == len(pieces)):
            content += delta.get("content", "")
            for part in delta.get("tool_calls", []):
                assert part["index"] == len(calls)  # whole calls, in order
                calls[part["index"]] = part
                arrivals.append(n)
    return content, list(calls.values()), arrivals


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_streamed_reply_carries_the_same_content_and_calls_as_the_whole(
        parser, text, content, calls, size) -> None:
    got_content, got_calls, _ = streamed(parser, text, size)
    assert (got_content.strip() or None) == content
    assert named(got_calls) == calls


TWO_CALLS = {parser: (text, calls) for parser, text, _, calls in CASES if len(calls) == 2}


@pytest.mark.parametrize("parser", ["hermes", "mistral", "qwen3_coder", "deepseek_v3", "deepseek_v31"])
def test_a_call_streams_as_soon_as_it_is_finished(parser) -> None:
    text = TWO_CALLS[parser][0]
    *_, arrivals = streamed(parser, text, 1)
    assert len(arrivals) == 2 and arrivals[0] < len(text)  # the first came before the reply ended


def test_llama_json_opens_only_at_the_start_of_a_stream() -> None:
    stream = reader("llama3_json")
    assert stream.feed("It is ", finished=False) == [{"content": "It is "}]
    assert stream.feed('{"name": "get_time", "parameters": {"zone": 3}}', finished=True) == [
        {"content": '{"name": "get_time", "parameters": {"zone": 3}}'}]


def test_content_streams_up_to_a_possible_opening_marker() -> None:
    stream = reader("hermes")
    assert stream.feed("Sure", finished=False) == [{"content": "Sure"}]
    assert stream.feed(". <tool", finished=False) == [{"content": ". "}]  # "<tool" may open a call
    assert stream.feed("s are", finished=False) == [{"content": "<tools are"}]
    assert stream.feed(" <tool_call>\n{", finished=False) == [{"content": " "}]
    parts = stream.feed('"name": "get_time", "arguments": {"zone": 0}}\n</tool_call>', finished=True)
    assert [p["tool_calls"][0]["function"]["name"] for p in parts] == ["get_time"]


@pytest.mark.parametrize("parser", sorted(TWO_CALLS))
def test_a_cut_reply_keeps_the_calls_it_finished(parser) -> None:
    text, (first, (second, _)) = TWO_CALLS[parser]
    cut = text[:text.rindex(second) + len(second) + 3]  # in the second call, past its name
    _, calls = reader(parser).read(cut, cut=True)
    assert named(calls) == [first]


TEMPLATES = {
    "qwen3_coder": "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n<function=example>\n"
                   "<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
                   "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'}}",
    "deepseek_v31": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
                    "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
                    "'<｜tool▁call▁end｜>'}}",
    "hermes": "<|im_start|>system\n<tools></tools> Return <tool_call>{...}</tool_call><|im_end|>",
    "llama3_json": "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>",
    "mistral": "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' + calls|tojson }}",
}


@pytest.mark.parametrize(("parser", "template"), [*TEMPLATES.items(), (None, None), (None, "{{ messages }}")])
def test_the_format_is_read_from_the_chat_templates_markers(parser, template) -> None:
    assert detect_format(template) == (parser or "hermes")


def test_an_unknown_parser_exits_2_naming_the_option_and_the_choices(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--tool-call-parser must be one of auto, hermes, llama3_json, "
                                         r"mistral, qwen3_coder, deepseek_v3, deepseek_v31; got 'nope'"):
        check_parser("nope")
    # The model path does not exist: reaching it would fail naming --model instead.
    missing = str(tmp_path / "missing")
    result = CliRunner().invoke(app, ["serve", "--model", missing, "--tool-call-parser", "nope"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert ("--tool-call-parser must be one of auto, hermes, llama3_json, mistral, qwen3_coder, "
            "deepseek_v3, deepseek_v31; got 'nope'") in said


@pytest.mark.parametrize(("properties", "says"), [
    ({"code": {"type": "string", "pattern": "^[A-Z]+$"}}, r"f\.code.*pattern"),
    ({"a>b": {"type": "integer"}}, r"parameter named 'a>b'")])
def test_what_qwen3_coder_cannot_write_or_enforce_is_refused_naming_it(properties, says) -> None:
    with pytest.raises(ValueError, match=says):
        FORMATS["qwen3_coder"]().auto_grammar({"f": {"properties": properties}}, parallel=True)


def test_arguments_with_no_schema_type_are_an_object_in_auto() -> None:
    body = SimpleNamespace(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                           tool_choice="auto")
    assert ToolPlan.from_body(body).schemas == {"f": {"type": "object"}}


def tokenizers(model_dir) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = sorted(tokenizer.eos_token_ids)
    lltokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(),
                                         n_vocab=tokenizer.vocab_size, eos_token=eos)
    return tokenizer, lltokenizer


def walk(tokenizer: Tokenizer, matcher: llguidance.LLMatcher, prefix: str, seed: int, steps: int) -> str:
    """Random tokens among those the grammar allows, after `prefix`; the text written."""
    rng, ids = random.Random(seed), tokenizer.encode(prefix, add_bos=False)
    for token in ids:
        assert matcher.consume_token(token), matcher.get_error()
    bitmask = np.zeros((1, -(-tokenizer.vocab_size // 32)), dtype=np.int32)
    for _ in range(steps):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
        allowed = np.flatnonzero(bits)
        token = int(rng.choice(allowed))
        if token in tokenizer.eos_token_ids:
            break
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
        if matcher.is_stopped():
            break
    return tokenizer.decode(ids)


@pytest.mark.parametrize("tool_format", [*(make() for make in FORMATS.values()), Mistral(args_form=True)],
                         ids=[*FORMATS, "mistral_args"])
def test_every_call_an_auto_grammar_lets_through_parses_and_validates(tiny_model_dir,
                                                                      tool_format: ToolFormat) -> None:
    tokenizer, lltokenizer = tokenizers(tiny_model_dir)
    # Bounded arguments only: a uniform walk through an unbounded string would not end.
    bounded = {"get_weather": WEATHER, "get_time": TIME}
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_format.auto_grammar(bounded, parallel=False))
    prefix = "{" if tool_format.name == "llama3_json" else f"Ok. {tool_format.opening}"
    for seed in range(6):
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        text = walk(tokenizer, matcher, prefix, seed, steps=400)
        assert matcher.is_stopped(), text  # one call (parallel false), and nothing after it
        start = tool_format.find_opening(text)
        (call,) = tool_format.scan(text[start:], bounded, final=True)
        jsonschema.validate(call.arguments, bounded[call.name])


def test_free_text_may_not_spell_the_opening_marker_and_go_on_freely(tiny_model_dir) -> None:
    tokenizer, lltokenizer = tokenizers(tiny_model_dir)
    grammar = llguidance.LLMatcher.grammar_from_lark(FORMATS["hermes"]().auto_grammar(SCHEMAS, parallel=True))
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    for token in tokenizer.encode("Hi <tools> <tool_call>\n", add_bos=False):
        assert matcher.consume_token(token), matcher.get_error()
    assert not all(matcher.consume_token(t) for t in tokenizer.encode("I changed my mind", add_bos=False))


def test_free_text_may_hold_added_tokens_but_not_the_markers(tiny_model_dir) -> None:
    tokenizer, lltokenizer = tokenizers(tiny_model_dir)
    vocabulary = Vocabulary.of(tokenizer)
    start = vocabulary.token_ids["<|im_start|>"]
    tool_format = FORMATS["hermes"](vocabulary)
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_format.auto_grammar(SCHEMAS, parallel=False))
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    for token in [*tokenizer.encode("Hi", add_bos=False), start, *tokenizer.encode(text, add_bos=False)]:
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_stopped()


def test_llama_json_free_text_may_not_open_like_a_call(tiny_model_dir) -> None:
    tokenizer, lltokenizer = tokenizers(tiny_model_dir)
    lark = FORMATS["llama3_json"]().auto_grammar(SCHEMAS, parallel=False)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    for opening in ("<|python_tag|>{", "{"):
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        for token in tokenizer.encode(opening, add_bos=False):
            assert matcher.consume_token(token), matcher.get_error()
        assert not all(matcher.consume_token(t) for t in tokenizer.encode('"answer": 42}', add_bos=False))
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    for token in tokenizer.encode('It is {"answer": 42}.', add_bos=False):
        assert matcher.consume_token(token), matcher.get_error()
