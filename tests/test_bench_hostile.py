"""The hostile-client bench's own parts, without a server: its probes are reproducible and reach
what they aim at, and its judges read every protocol's shapes (a judge that cannot see a server
error or a mismatch would report a clean run whatever happened)."""

from __future__ import annotations

import json
import random

from nanoserve.bench.experiments.hostile import (
    BODY_LIMIT_BYTES,
    _merge,
    _server_error_event,
    mutations,
    raw_probes,
    valid_bodies,
)


def test_mutations_are_seeded_json_bodies() -> None:
    base = valid_bodies("m")["/v1/chat/completions"]
    first = list(mutations("/v1/chat/completions", base, random.Random(3), 50))
    again = list(mutations("/v1/chat/completions", base, random.Random(3), 50))
    assert first == again
    assert all(isinstance(json.loads(probe.content), dict) for probe in first)
    assert len({probe.content for probe in first}) > 40  # not one body fifty times


def test_raw_parser_probes_fit_the_body_limit_so_they_reach_the_parser() -> None:
    for probe in raw_probes("/v1/completions"):
        assert (len(probe.content) > BODY_LIMIT_BYTES) == (probe.case == "oversized body"), probe.case


def test_a_server_error_event_is_found_in_each_protocols_shape_and_a_client_error_is_not() -> None:
    openai = 'data: {"error": {"message": "internal error: KeyError", "type": "internal_server_error"}}'
    anthropic = 'data: {"type": "error", "error": {"type": "api_error", "message": "internal error"}}'
    responses = 'data: {"type": "error", "sequence_number": 3, "code": "internal_error", "message": "x"}'
    refusal = 'data: {"error": {"message": "n must be >= 1", "type": "invalid_request_error"}}'
    for stream in (openai, anthropic, responses):
        assert _server_error_event(f'data: {{"choices": []}}\n\n{stream}\n\ndata: [DONE]')
    assert not _server_error_event(f"{refusal}\n\ndata: [DONE]")


def test_a_stream_merges_to_the_unary_answers_choices() -> None:
    unary = {"index": 0, "text": "ab", "finish_reason": "length",
             "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.25],
                          "top_logprobs": [{"a": -0.5}, {"b": -1.25}]}}
    chunks = [{"index": 0, "text": "a", "finish_reason": None,
               "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]}},
              {"index": 0, "text": "b", "finish_reason": "length",
               "logprobs": {"tokens": ["b"], "token_logprobs": [-1.25], "top_logprobs": [{"b": -1.25}]}}]
    whole, streamed = {}, {}
    _merge(whole, unary, chat=False, delta=False)
    for chunk in chunks:
        _merge(streamed, chunk, chat=False, delta=True)
    assert whole == streamed
    entry = {"token": "a", "logprob": -0.5, "top_logprobs": []}
    chat_whole, chat_streamed = {}, {}
    _merge(chat_whole, {"index": 0, "message": {"content": "a"}, "logprobs": {"content": [entry]},
                        "finish_reason": "stop"}, chat=True, delta=False)
    _merge(chat_streamed, {"index": 0, "delta": {"role": "assistant"}}, chat=True, delta=True)
    _merge(chat_streamed, {"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]},
                           "finish_reason": "stop"}, chat=True, delta=True)
    assert chat_whole == chat_streamed
    streamed[0]["logprobs"][1] = ("b", -1.2500001, {"b": -1.25})
    assert whole != streamed  # one logprob's last bit apart is a mismatch
