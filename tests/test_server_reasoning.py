"""Reasoning on /v1/chat/completions: a tiny model with think tokens and a Qwen3-style template.

Random weights think at random, so each test fixes the output's shape with the grammar: a
thinking budget of N with the end tag biased away makes the thinking exactly N tokens and
the end tag the forced one; the expected split is read from the tokens' own bytes (the
chat logprobs), never from our parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from test_server_api import Served, assert_error, chunks_of, idle_client, serving, tiny_engine
from tiny_model import write_tiny_llama
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from nanoserve.errors import InvalidRequestError
from nanoserve.server.app import ServerLimits
from nanoserve.server.parsers.reasoning import ReasoningConfig, ReasoningPlan, detect_parser
from nanoserve.tokenizer import Tokenizer

QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
OPENS_THE_BLOCK = QWEN3_STYLE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
HI = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWER = {"type": "object", "properties": {"sum": {"enum": [3, 4, 5]}}, "required": ["sum"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory) -> str:
    """The tiny model with <think> and </think> as added tokens (as Qwen3's) and the template."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny_thinking"), vocab_size=392)
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE}))
    return str(path)


@pytest.fixture(scope="module")
def tags(thinking_model_dir) -> dict[str, int]:
    backend = HFTokenizer.from_file(f"{thinking_model_dir}/tokenizer.json")
    return {"start": backend.token_to_id("<think>"), "end": backend.token_to_id("</think>")}


@pytest.fixture(scope="module")
def served(thinking_model_dir) -> Iterator[Served]:
    limits = ServerLimits(trust_request_chat_template=True)
    with serving(lambda: tiny_engine(thinking_model_dir), limits=limits) as server:
        yield server


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with idle_client(served) as http:
        yield http


def token_bytes(logprobs: list[dict]) -> list[bytes]:
    return [bytes(entry["bytes"]) for entry in logprobs]


def expected_split(pieces: list[bytes], end_at: int, skip: int = 0) -> tuple[str, str]:
    """(thinking, answer) from the tokens: before the end tag at `end_at` (less `skip` tags
    that open the block), and after it."""
    assert pieces[end_at] == b"</think>"
    return b"".join(pieces[skip:end_at]).decode(), b"".join(pieces[end_at + 1:]).decode()


def think_request(tags: dict[str, int], budget: int, **extra) -> dict:
    """Greedy; the end tag biased away, so only the spent budget brings it."""
    return {"messages": HI, "temperature": 0, "max_tokens": 40, "logprobs": True,
            "thinking_token_budget": budget, "logit_bias": {str(tags["end"]): -100}, **extra}


def test_the_parser_is_chosen_from_the_template_only_where_it_is_certain() -> None:
    assert detect_parser(QWEN3_STYLE).name == "qwen3"
    assert detect_parser("<｜Assistant｜><think>\n{{ x }}</think>").name == "deepseek_r1"
    assert detect_parser("{{ messages }}") is None
    assert detect_parser("<|im_start|>{{ m.content }}") is None  # ChatML without think tags
    assert detect_parser("[INST]<think></think>") is None  # tags in a template we do not know


def test_a_named_parser_the_vocabulary_cannot_serve_is_refused(tiny_model_dir) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        ReasoningConfig("qwen3").tags(Tokenizer.from_dir(tiny_model_dir))
    assert raised.value.param == "reasoning_parser"
    assert ReasoningConfig("auto").tags(Tokenizer.from_dir(tiny_model_dir)) is None
    with pytest.raises(InvalidRequestError):
        ReasoningConfig("qwen")


@pytest.mark.parametrize(("template_kwargs", "opening"), [
    ({}, "may_open"), ({"enable_thinking": False}, "closed")])
def test_where_the_output_begins_is_read_from_the_prompt(thinking_model_dir, template_kwargs,
                                                         opening) -> None:
    tokenizer = Tokenizer.from_dir(thinking_model_dir)

    def opening_of(parser: str, ids: list[int]) -> str:
        tags = ReasoningConfig(parser).tags(tokenizer)
        return ReasoningPlan.for_prompt(tags, ids, tokenizer, budget_tokens=None, include=True).opening

    ids = tokenizer.encode_chat(HI, template_kwargs=template_kwargs)
    assert opening_of("qwen3", ids) == opening
    assert opening_of("qwen3", tokenizer.encode_chat(HI, chat_template=OPENS_THE_BLOCK)) == "inside"
    assert opening_of("deepseek_r1", ids) == ("implicit" if not template_kwargs else "closed")


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_a_spent_budget_forces_the_end_tag_and_the_answer_follows(client: httpx.Client, tags, budget) -> None:
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, budget, chat_template=OPENS_THE_BLOCK)).json()
    message = reply["choices"][0]["message"]
    thinking, answer = expected_split(token_bytes(reply["choices"][0]["logprobs"]["content"]), budget)
    assert message["reasoning_content"] == message["reasoning"] == thinking
    assert message["content"] == answer
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget + 1


def test_structured_outputs_apply_to_the_answer_after_the_thinking(client: httpx.Client, tags) -> None:
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, 4, chat_template=OPENS_THE_BLOCK, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER}})).json()
    choice = reply["choices"][0]
    thinking, answer = expected_split(token_bytes(choice["logprobs"]["content"]), 4)
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == thinking
    jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER)
    assert choice["message"]["content"] == answer


def test_a_reply_that_opens_the_block_itself_is_split_at_its_tags(client: httpx.Client, tags) -> None:
    # The template leaves the block to the model (Qwen3); the start tag, biased up, opens it.
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, 3, logit_bias={str(tags["end"]): -100, str(tags["start"]): 100})).json()
    pieces = token_bytes(reply["choices"][0]["logprobs"]["content"])
    assert pieces[0] == b"<think>"
    thinking, answer = expected_split(pieces, 4, skip=1)
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thinking, answer)
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_enable_thinking_false_answers_at_once(client: httpx.Client, tags) -> None:
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, 2, chat_template_kwargs={"enable_thinking": False})).json()
    choice = reply["choices"][0]
    assert "reasoning_content" not in choice["message"]
    assert choice["message"]["content"] == b"".join(token_bytes(choice["logprobs"]["content"])).decode()
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_continued_assistant_turn_that_opened_the_block_is_thinking(client: httpx.Client, tags) -> None:
    messages = [*HI, {"role": "assistant", "content": "<think>\nFirst"}]
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, 2, messages=messages, add_generation_prompt=False, continue_final_message=True)).json()
    thinking, answer = expected_split(token_bytes(reply["choices"][0]["logprobs"]["content"]), 2)
    assert reply["choices"][0]["message"]["reasoning_content"] == thinking
    assert reply["choices"][0]["message"]["content"] == answer


def test_streamed_thinking_and_answer_join_into_the_unary_ones(client: httpx.Client, tags) -> None:
    request = think_request(tags, 5, chat_template=OPENS_THE_BLOCK)
    unary = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]
    chunks = chunks_of(client.post("/v1/chat/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == unary["reasoning_content"]
    assert "".join(d.get("reasoning", "") for d in deltas) == unary["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == unary["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_include_reasoning_false_leaves_the_thinking_out(client: httpx.Client, tags) -> None:
    reply = client.post("/v1/chat/completions", json=think_request(
        tags, 3, chat_template=OPENS_THE_BLOCK, include_reasoning=False)).json()
    _, answer = expected_split(token_bytes(reply["choices"][0]["logprobs"]["content"]), 3)
    assert "reasoning_content" not in reply["choices"][0]["message"]
    assert reply["choices"][0]["message"]["content"] == answer


def test_tool_calls_are_read_from_the_answer_after_the_thinking(served: Served, tags) -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=HI, tools=tools, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=60, logit_bias={str(tags["end"]): -100},
        extra_body={"thinking_token_budget": 2, "chat_template": OPENS_THE_BLOCK})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), weather)
    assert choice.message.model_extra["reasoning_content"] is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 3


def test_a_budget_without_a_reasoning_parser_is_refused_by_name(thinking_model_dir) -> None:
    with (serving(lambda: tiny_engine(thinking_model_dir), reasoning=ReasoningConfig("none")) as off,
          idle_client(off) as http):
        response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2,
                                                           "thinking_token_budget": 4})
        assert_error(response, 400, "thinking_token_budget", "unsupported")
        plain = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).json()
        assert "reasoning_content" not in plain["choices"][0]["message"]
        assert "completion_tokens_details" not in plain["usage"]


def test_the_default_budget_comes_from_the_server(thinking_model_dir, tags) -> None:
    with (serving(lambda: tiny_engine(thinking_model_dir), reasoning=ReasoningConfig(budget_tokens=2),
                  limits=ServerLimits(trust_request_chat_template=True)) as server,
          idle_client(server) as http):
        request = think_request(tags, 2, chat_template=OPENS_THE_BLOCK)
        del request["thinking_token_budget"]
        reply = http.post("/v1/chat/completions", json=request).json()
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3


@pytest.mark.parametrize(("parser", "text", "split"), [
    ("qwen3", "<think>a</think>b", ("a", "b")),
    ("qwen3", "plain answer", (None, "plain answer")),
    ("deepseek_r1", "a</think>b", ("a", "b")),
    ("deepseek_r1", "<think>a</think>b", ("a", "b")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
])
def test_the_reader_splits_a_whole_reply(thinking_model_dir, parser, text, split) -> None:
    tokenizer = Tokenizer.from_dir(thinking_model_dir)
    tags = ReasoningConfig(parser).tags(tokenizer)
    plan = ReasoningPlan.for_prompt(tags, tokenizer.encode_chat(HI), tokenizer, budget_tokens=None,
                                    include=True)
    assert plan.reader().split(text) == split


def test_the_reader_holds_a_tag_cut_between_two_pieces(thinking_model_dir) -> None:
    tokenizer = Tokenizer.from_dir(thinking_model_dir)
    tags = ReasoningConfig().tags(tokenizer)
    reader = ReasoningPlan.for_prompt(tags, tokenizer.encode_chat(HI), tokenizer, budget_tokens=None,
                                      include=True).reader()
    pieces = [reader.feed(piece, final=False) for piece in ("<thi", "nk>wh", "y</th", "ink>so")]
    assert pieces == [("", ""), ("wh", ""), ("y", ""), ("", "so")]


def test_anthropic_thinking_comes_back_as_a_thinking_block(served: Served, client: httpx.Client) -> None:
    import anthropic

    # A prefilled assistant turn (Anthropic's way to continue one) opens the block.
    prefilled = [*HI, {"role": "assistant", "content": "<think>\nSo"}]
    chat = client.post("/v1/chat/completions", json={
        "messages": prefilled, "temperature": 0, "max_tokens": 30, "thinking_token_budget": 3,
        "continue_final_message": True, "add_generation_prompt": False}).json()
    with anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0) as messages:
        reply = messages.messages.create(model="tiny", max_tokens=30, messages=prefilled,
                                         thinking={"type": "enabled", "budget_tokens": 3},
                                         extra_body={"temperature": 0})
    message = chat["choices"][0]["message"]
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == message["reasoning_content"]
    assert reply.content[1].text == message["content"]


def test_a_responses_reply_carries_the_thinking_as_a_reasoning_item(thinking_model_dir) -> None:
    # deepseek_r1 reads everything before the end tag as thinking; the budget brings the tag.
    reasoning = ReasoningConfig("deepseek_r1", budget_tokens=2)
    with (serving(lambda: tiny_engine(thinking_model_dir), reasoning=reasoning) as server,
          idle_client(server) as http):
        chat = http.post("/v1/chat/completions", json={"messages": HI, "temperature": 0,
                                                       "max_tokens": 12}).json()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        reply = client.responses.create(model="tiny", input=HI, temperature=0, max_output_tokens=12)
    message = chat["choices"][0]["message"]
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == message["reasoning_content"]
    assert reply.output_text == message["content"]
    assert reply.usage.output_tokens_details.reasoning_tokens == 3
