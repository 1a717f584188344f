"""Each tool-call format end to end: a tiny model per family, its chat template in that family's
shape and the family's markers in its vocabulary (special tokens where the family's are:
Mistral's and Llama's), served with the format found from the template.

Two properties per family: a reply forced (by a grammar) into the family's literal call text
comes back as content and calls, whole and streamed, and the random-weight model in
tool_choice "auto", its opening marker made likely by a logit bias, writes only calls that
parse and validate (the lazy grammar), the streamed replies the same as the whole ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import pytest
from test_server_api import assert_error, chunks_of, serving, tiny_engine
from test_tool_formats import TIME, TOOLS, TWO_CALLS, WEATHER
from tiny_model import tiny_tokenizer, write_tiny_llama
from tokenizers import AddedToken, Tokenizer

from nanoserve.server.app import ServerLimits
from nanoserve.server.parsers.tool_formats import DeepSeekV3
from nanoserve.tokenizer import Tokenizer as NanoserveTokenizer

BOUNDED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                 {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
BOUNDED = {"get_weather": WEATHER, "get_time": TIME}
HI = [{"role": "user", "content": "weather?"}]
SEEDS = 20


@dataclass(frozen=True)
class Family:
    template: str
    tokens: tuple[tuple[str, bool], ...]  # the family's markers: (text, special)
    opening: str  # the marker the logit bias makes likely
    bias: float = 3.0  # enough for calls on most seeds, after some free text on some


# Minimal templates in each family's shape: the tools where the family puts them (their names
# alone: the tiny model's context is short), an assistant's calls written as the family writes
# them, and the generation prompt.
CALLS = "{% for c in m.tool_calls or [] %}{}{% endfor %}"
NAMES = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
FAMILIES = {
    "hermes": Family(
        "<|im_start|>system\n<tools>" + NAMES + "</tools>\nCall as <tool_call>{\"name\": ..., \"arguments\": "
        "...}</tool_call><|im_end|>\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
        + CALLS.replace("{}", "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} "
                              "| tojson }}\n</tool_call>")
        + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        (("<tool_call>", False), ("</tool_call>", False)), "<tool_call>"),
    "llama3_json": Family(
        "Tools: " + NAMES + "{% for m in messages %}<|start_header_id|>"
        "{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
        "{% if m.tool_calls %}<|python_tag|>"
        + CALLS.replace("{}", "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}")
        + "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        (("<|python_tag|>", True),), "<|python_tag|>", bias=6.0),  # its one chance: the first token
    "mistral": Family(
        "[AVAILABLE_TOOLS]" + NAMES + "[/AVAILABLE_TOOLS]{% for m in messages %}{% if m.role == 'user' %}"
        "[INST]{{ m.content }}[/INST]{% else %}{{ m.content or '' }}"
        + CALLS.replace("{}", "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}")
        + "{% endif %}{% endfor %}",
        (("[TOOL_CALLS]", True), ("[ARGS]", True)), "[TOOL_CALLS]"),
    "qwen3_coder": Family(
        "<|im_start|>system\n<tools>" + NAMES + "</tools><|im_end|>\n{% for m in messages %}<|im_start|>"
        "{{ m.role }}\n{{ m.content or '' }}"
        + CALLS.replace("{}", "<tool_call>\n<function={{ c.function.name }}>\n"
                              "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n"
                              "</parameter>\n{% endfor %}</function>\n</tool_call>")
        + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        (("<tool_call>", False), ("</tool_call>", False)), "<tool_call>"),
    "deepseek_v3": Family(
        NAMES + "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}"
        "<｜Assistant｜>{{ m.content or '' }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
        + CALLS.replace("{}", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
                              "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>")
        + "<｜tool▁calls▁end｜>{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        tuple((marker, False) for marker in DeepSeekV3.markers),
        "<｜tool▁calls▁begin｜>"),
    "deepseek_v31": Family(
        NAMES + "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}"
        "<｜Assistant｜>{{ m.content or '' }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
        + CALLS.replace("{}", "<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>"
                              "{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>")
        + "<｜tool▁calls▁end｜>{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        tuple((marker, False) for marker in DeepSeekV3.markers),
        "<｜tool▁calls▁begin｜>"),
}
# A reply in each family's own words, forced; and what reading it gives. Llama's tag is a
# special token here, so its text is the tagged one.
FORCED = {**{family: TWO_CALLS[family] for family in ("hermes", "mistral", "deepseek_v3", "deepseek_v31",
                                                      "qwen3_coder")},
          "llama3_json": (
              '<|python_tag|>{"name": "get_time", "parameters": {"zone": 3}}; '
              '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
              [("get_time", {"zone": 3}), ("get_weather", {"city": "Rome", "unit": "c"})])}


def write_family_model(path: Path, family: Family) -> Path:
    """The tiny llama with the family's markers added to its vocabulary and its chat template."""
    own = tiny_tokenizer().get_vocab_size(with_added_tokens=True)
    write_tiny_llama(path, vocab_size=own + len(family.tokens))
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text, special in family.tokens:
        token = AddedToken(text, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": family.template}))
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tmp_path_factory) -> Iterator[tuple[str, Path, httpx.Client]]:
    name = request.param
    model_dir = write_family_model(tmp_path_factory.mktemp(name), FAMILIES[name])
    limits = ServerLimits(max_n=SEEDS)
    with serving(lambda: tiny_engine(model_dir, max_num_seqs=SEEDS, num_kv_blocks=24 * SEEDS),
                 limits=limits) as served, httpx.Client(base_url=served.base_url, timeout=300) as client:
        yield name, model_dir, client


def forcing_grammar(text: str, tokenizer: NanoserveTokenizer) -> str:
    """A Lark grammar whose one sentence is `text`, its added tokens written as tokens (the
    grammar library keeps them apart from text)."""
    special = {token.content: i for i, token in tokenizer.backend.get_added_tokens_decoder().items()
               if token.content in text}
    pieces = [text]
    for marker, token_id in special.items():
        pieces = [part for piece in pieces for part in _split_keeping(piece, marker, f"<[{token_id}]>")]
    return "start: " + " ".join(p if p.startswith("<[") else json.dumps(p, ensure_ascii=False)
                                for p in pieces if p)


def _split_keeping(text: str, marker: str, replacement: str) -> list[str]:
    if text.startswith("<["):
        return [text]
    parts = text.split(marker)
    return [item for i, part in enumerate(parts) for item in ([replacement, part] if i else [part])]


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def choices_of(chunks: list[dict]) -> dict[int, dict]:
    """Each streamed choice's content, calls (joined from their deltas) and finish_reason."""
    joined: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            entry = joined.setdefault(choice["index"], {"content": "", "calls": {}, "finish_reason": None})
            entry["content"] += choice["delta"].get("content") or ""
            for part in choice["delta"].get("tool_calls", []):
                call = entry["calls"].setdefault(part["index"], {"function": {"name": "", "arguments": ""}})
                call["function"]["name"] += part.get("function", {}).get("name", "")
                call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
            entry["finish_reason"] = choice["finish_reason"] or entry["finish_reason"]
    return joined


def test_a_reply_in_the_familys_words_comes_back_as_content_and_calls(family_server) -> None:
    name, model_dir, client = family_server
    text, calls = FORCED[name]
    opening = FAMILIES[name].opening
    content = text[:text.index(opening)].strip() or None if opening in text else None
    grammar = forcing_grammar(text, NanoserveTokenizer.from_dir(model_dir))
    request = {"messages": HI, "tools": TOOLS, "max_tokens": 300, "structured_outputs": {"grammar": grammar}}
    whole = client.post("/v1/chat/completions", json=request)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] == content
    assert named(choice["message"]["tool_calls"]) == calls
    streamed = choices_of(chunks_of(client.post("/v1/chat/completions", json={**request, "stream": True})))[0]
    assert (streamed["content"].strip() or None) == content
    assert named(streamed["calls"].values()) == calls
    assert streamed["finish_reason"] == "tool_calls"


def test_auto_on_random_weights_writes_only_calls_that_validate(family_server) -> None:
    name, model_dir, client = family_server
    tokenizer = NanoserveTokenizer.from_dir(model_dir)
    opening = tokenizer.backend.token_to_id(FAMILIES[name].opening)
    request = {"messages": HI, "tools": BOUNDED_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
               "max_tokens": 100, "temperature": 1.0, "seed": 7, "n": SEEDS,
               "logit_bias": {str(opening): FAMILIES[name].bias}}
    whole = client.post("/v1/chat/completions", json=request)
    assert whole.status_code == 200, whole.text
    replies = sorted(whole.json()["choices"], key=lambda c: c["index"])
    called = [reply for reply in replies if reply["message"].get("tool_calls")]
    for reply in called:  # max_tokens may cut a reply after its call, before the closing marker
        assert reply["finish_reason"] in ("tool_calls", "length")
        for call_name, arguments in named(reply["message"]["tool_calls"]):
            jsonschema.validate(arguments, BOUNDED[call_name])
    # No call leaked into content: a reply that wrote the marker made a call (or max_tokens cut it).
    leaked = [r for r in replies if FAMILIES[name].opening in (r["message"]["content"] or "")
              and r["finish_reason"] != "length"]
    assert not leaked, leaked
    assert len(called) >= SEEDS // 4, [r["message"] for r in replies]
    if name != "llama3_json":  # free text first, then the call: the grammar waited for the marker
        assert any(reply["message"]["content"] for reply in called)
    streamed = choices_of(chunks_of(client.post("/v1/chat/completions", json={**request, "stream": True})))
    for reply in replies:
        mine = streamed[reply["index"]]
        assert named(mine["calls"].values()) == named(reply["message"].get("tool_calls") or [])
        assert (mine["content"].strip() or None) == ((reply["message"]["content"] or "").strip() or None)
        assert mine["finish_reason"] == reply["finish_reason"]


@pytest.mark.parametrize("family_server", ["qwen3_coder"], indirect=True)  # it writes raw strings
def test_a_schema_the_format_cannot_enforce_is_a_400_naming_tools(family_server) -> None:
    _, _, client = family_server
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}
    assert_error(client.post("/v1/chat/completions", json={"messages": HI, "tools": [tool], "max_tokens": 4}),
                 400, "tools")


@pytest.mark.parametrize("family_server", ["hermes"], indirect=True)
@pytest.mark.parametrize("extra", [{"min_tokens": 2}, {"bad_words": ["xyz"]}, {"allowed_token_ids": [5, 6]},
                                   {"response_format": {"type": "json_object"}}])
def test_auto_leaves_its_grammar_to_fields_a_grammar_cannot_share(family_server, extra) -> None:
    _, _, client = family_server
    body = {"messages": HI, "tools": TOOLS, "max_tokens": 4, **extra}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text


def test_a_named_parser_overrides_the_templates_format(tiny_model_dir) -> None:
    # The tiny model's ChatML template names no format (hermes); the server is told mistral.
    text = 'Checking.[TOOL_CALLS]get_time[ARGS]{"zone": -4}'
    request = {"messages": HI, "tools": TOOLS, "max_tokens": 100,
               "structured_outputs": {"choice": [text]}}
    with serving(lambda: tiny_engine(tiny_model_dir), tool_call_parser="mistral") as served, \
            httpx.Client(base_url=served.base_url, timeout=300) as client:
        choice = client.post("/v1/chat/completions", json=request).json()["choices"][0]
    assert choice["message"]["content"] == "Checking."
    assert named(choice["message"]["tool_calls"]) == [("get_time", {"zone": -4})]
