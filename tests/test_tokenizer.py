"""Tokenizer, chat templates, streaming detokenization and stop strings."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import sentencepiece_tokenizer

from nanoserve.errors import InvalidRequestError
from nanoserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

REPLACEMENT_CHAR = "\ufffd"
ROCKET = "🚀"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _copy_with(src: Path, dst: Path, file_name: str, **changes: object) -> Path:
    """A copy of checkpoint `src` whose JSON file `file_name` has `changes` applied."""
    shutil.copytree(src, dst)
    config_path = dst / file_name
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps(config | changes))
    return dst


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=template,
    )


# ---- Tokenizer ----------------------------------------------------------------------------


@given(text=st.text(max_size=60))
@settings(max_examples=80, deadline=None)
def test_decode_inverts_encode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_spaces_between_special_tokens_set_shown_special_tokens_apart_as_transformers_slow_decode(
        tiny_tokenizer):
    """vLLM's spaces_between_special_tokens: true joins each special token and the text runs
    around it with a space (transformers' and vLLM's slow detokenizers); false joins them bare."""
    ids = tiny_tokenizer.encode("<|im_start|>user\nHi<|im_end|><|im_end|> there")
    spaced = tiny_tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == "<|im_start|> user\nHi <|im_end|> <|im_end|>  there"
    joined = tiny_tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined == "<|im_start|>user\nHi<|im_end|><|im_end|> there"
    assert tiny_tokenizer.decode(ids, spaces_between_special_tokens=True) == "user\nHi there"


@given(chunks=st.lists(st.lists(st.sampled_from([0, 1, 2, 72, 105, 300]), max_size=4), max_size=8))
@settings(max_examples=60, deadline=None)
def test_a_spaced_stream_joins_to_the_spaced_decode(tiny_tokenizer, chunks):
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=False,
                                         spaces_between_special_tokens=True)
    streamed = "".join([detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()])
    ids = [token for chunk in chunks for token in chunk]
    assert streamed == tiny_tokenizer.decode(ids, skip_special_tokens=False,
                                             spaces_between_special_tokens=True)


def test_special_tokens_in_text_encode_to_their_ids(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tiny_tokenizer.bos_token_id == 1
    assert ids[-1] == tiny_tokenizer.eos_token_id == 2
    assert tiny_tokenizer.decode(ids) == "user\nhi"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_encode_adds_bos_only_when_config_says_so(tiny_model_dir, tiny_tokenizer, tmp_path):
    assert tiny_tokenizer.encode("hello")[0] != tiny_tokenizer.bos_token_id
    with_bos = _copy_with(tiny_model_dir, tmp_path / "m", "tokenizer_config.json", add_bos_token=True)
    tokenizer = Tokenizer.from_dir(with_bos)
    assert tokenizer.encode("hello") == [tokenizer.bos_token_id, *tiny_tokenizer.encode("hello")]
    assert tokenizer.encode("hello", add_bos=False) == tiny_tokenizer.encode("hello")


def test_eos_token_ids_unite_tokenizer_and_generation_config(tiny_model_dir, tmp_path):
    model_dir = _copy_with(tiny_model_dir, tmp_path / "m", "generation_config.json", eos_token_id=[0, 2])
    assert Tokenizer.from_dir(model_dir).eos_token_ids == frozenset({0, 2})


def test_vocab_size_counts_added_tokens(tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == 384
    assert tiny_tokenizer.id_to_token(2) == "<|im_end|>"


def test_chat_template_renders_chatml(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny_tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_chat_template_trims_blocks_like_hf(tiny_tokenizer):
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }};\n"
    template += "    {% endif %}\n{% endfor %}"
    tokenizer = _with_template(tiny_tokenizer, template)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tokenizer.apply_chat_template(messages) == "a;\nb;\n"


def test_chat_template_sees_bos_and_eos_and_plain_tojson(tiny_tokenizer):
    template = "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}"
    tokenizer = _with_template(tiny_tokenizer, template)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "<b>&"}])
    assert rendered == '<|im_start|>{"role": "user", "content": "<b>&"}<|im_end|>'


def test_tojson_takes_the_keyword_arguments_templates_pass(tiny_tokenizer):
    template = ("{{ messages[0] | tojson(indent=2, separators=(',', ': '), ensure_ascii=True, "
                "sort_keys=True) }}")
    tokenizer = _with_template(tiny_tokenizer, template)
    message = {"role": "user", "content": "café"}
    rendered = tokenizer.apply_chat_template([message])
    expected = json.dumps(message, indent=2, separators=(",", ": "), ensure_ascii=True, sort_keys=True)
    assert rendered == expected


def test_every_special_token_of_the_config_reaches_the_template(tiny_model_dir, tmp_path):
    template = "{{ pad_token }}|{{ unk_token }}|{{ additional_special_tokens | join(',') }}|{{ bos_token }}"
    checkpoint = _copy_with(tiny_model_dir, tmp_path / "specials", "tokenizer_config.json",
                            pad_token="<|endoftext|>", unk_token={"content": "<unk>", "special": True},
                            additional_special_tokens=["<|im_start|>", {"content": "<|im_end|>"}],
                            chat_template=template)
    rendered = Tokenizer.from_dir(checkpoint).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|endoftext|>|<unk>|<|im_start|>,<|im_end|>|<|im_start|>"


def test_add_generation_prompt_false_leaves_out_the_assistant_header(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    ids = tiny_tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_continue_final_message_leaves_the_last_turn_open(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    rendered = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                  continue_final_message=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
    with pytest.raises(InvalidRequestError) as caught:
        tiny_tokenizer.apply_chat_template(messages, continue_final_message=True)
    assert caught.value.param == "continue_final_message"


def test_token_bytes_of_sentencepiece_pieces_are_utf8():
    tokenizer = sentencepiece_tokenizer("metaspace")
    token_bytes = {piece: tokenizer.token_bytes(tokenizer.backend.token_to_id(piece))
                   for piece in ("é", "<0xC3>", "\u2581Paris")}
    assert token_bytes == {"é": "é".encode(), "<0xC3>": b"\xc3", "\u2581Paris": b" Paris"}


@given(text=st.text(max_size=30))
@settings(max_examples=60, deadline=None)
def test_byte_level_token_bytes_join_to_the_texts_utf8(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert b"".join(tiny_tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_an_encoded_chat_has_the_templates_bos_and_no_second_one(tiny_tokenizer):
    tokenizer = Tokenizer(tiny_tokenizer.backend, bos_token=tiny_tokenizer.bos_token,
                          eos_token=tiny_tokenizer.eos_token, add_bos_token=True,
                          chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == [tokenizer.bos_token_id, *tokenizer.encode("hi", add_bos=False)]


def test_model_without_chat_template_is_an_invalid_request(tiny_tokenizer):
    tokenizer = _with_template(tiny_tokenizer, None)
    with pytest.raises(InvalidRequestError, match="no chat template") as caught:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert caught.value.param == "messages"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
    ],
)
def test_malformed_messages_are_invalid_requests(tiny_tokenizer, messages):
    with pytest.raises(InvalidRequestError) as caught:
        tiny_tokenizer.apply_chat_template(messages)
    assert caught.value.param == "messages"


def test_template_raise_exception_is_an_invalid_request(tiny_tokenizer):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tokenizer = _with_template(tiny_tokenizer, template)
    with pytest.raises(InvalidRequestError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])


# ---- IncrementalDetokenizer -------------------------------------------------------------


def _stream(tokenizer: Tokenizer, chunks: list[list[int]]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]


@st.composite
def _chunked_ids(draw: st.DrawFn) -> list[list[int]]:
    ids = draw(st.lists(st.integers(0, 383), max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


@given(chunks=_chunked_ids())
@settings(max_examples=150, deadline=None)
def test_streamed_text_concatenates_to_the_full_decode(tiny_tokenizer, chunks):
    all_ids = [i for chunk in chunks for i in chunk]
    assert "".join(_stream(tiny_tokenizer, chunks)) == tiny_tokenizer.decode(all_ids)


@given(text=st.text(max_size=40))
@settings(max_examples=80, deadline=None)
def test_streaming_valid_text_never_emits_a_partial_character(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    deltas = _stream(tiny_tokenizer, [[i] for i in ids])
    if REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == text


def test_emoji_split_across_tokens_is_held_until_whole(tiny_tokenizer):
    ids = tiny_tokenizer.encode(ROCKET)
    assert len(ids) > 1  # its four UTF-8 bytes span several byte-level tokens
    deltas = _stream(tiny_tokenizer, [[i] for i in ids])
    assert deltas == [""] * (len(ids) - 1) + [ROCKET, ""]


@pytest.mark.parametrize("decoder", ["metaspace", "strip"])
def test_first_streamed_token_keeps_its_leading_space_after_the_prompt(decoder):
    tokenizer = sentencepiece_tokenizer(decoder)
    prompt_ids, generated = tokenizer.encode("The capital is"), tokenizer.encode(" Paris")[-1:]
    assert tokenizer.id_to_token(generated[0]) == "\u2581Paris"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert detokenizer.push(generated) == " Paris"
    full = tokenizer.decode(prompt_ids + generated)
    assert full == "The capital is Paris"


@given(prompt=st.text(max_size=20), chunks=_chunked_ids())
@settings(max_examples=80, deadline=None)
def test_streamed_text_after_a_prompt_is_the_full_decode_past_the_prompt(tiny_tokenizer, prompt, chunks):
    prompt_ids = tiny_tokenizer.encode(prompt)
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, prompt_ids=prompt_ids)
    streamed = "".join([detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()])
    generated = [i for chunk in chunks for i in chunk]
    assert streamed == tiny_tokenizer.decode(prompt_ids + generated)[len(tiny_tokenizer.decode(prompt_ids)):]


def test_detokenizer_decodes_a_bounded_window(tiny_tokenizer):
    ids = tiny_tokenizer.encode(" ".join(["The quick brown fox 🚀 jumps."] * 40))

    class WindowLimit(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=True, **options):
            if len(token_ids) > 16:
                raise AssertionError(f"decoded {len(token_ids)} tokens for one push")
            return super().decode(token_ids, skip_special_tokens, **options)

    limited = WindowLimit(tiny_tokenizer.backend)
    assert "".join(_stream(limited, [[i] for i in ids])) == tiny_tokenizer.decode(ids)


# ---- StopStringMatcher --------------------------------------------------------------------


def _feed_all(matcher: StopStringMatcher, pieces: list[str],
              unarmed: Sequence[str] = ()) -> tuple[str, str | None]:
    """(emitted text, matched stop): `unarmed` pieces first (before min_tokens), then `pieces`."""
    emitted = []
    for piece, armed in [*((p, False) for p in unarmed), *((p, True) for p in pieces)]:
        text, stopped = matcher.feed(piece, armed=armed)
        emitted.append(text)
        if stopped:
            return "".join(emitted), matcher.matched
    return "".join(emitted) + matcher.flush(), None


def _reference(text: str, stops: list[str], armed_from: int = 0) -> tuple[str, str | None]:
    """The rule, stated plainly: at the first end position (past `armed_from`) where some stop
    string ends, the longest one ending there wins; the text before it is emitted."""
    for end in range(armed_from + 1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


@st.composite
def _split(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


_STOP_TEXT = st.text("abc<>", max_size=30)
_STOPS = st.lists(st.text("abc<>", min_size=1, max_size=4), min_size=1, max_size=3)


@given(data=st.data(), text=_STOP_TEXT, stops=_STOPS)
@settings(max_examples=300, deadline=None)
def test_matcher_emits_exactly_the_text_before_the_first_stop(data, text, stops):
    pieces = data.draw(_split(text))
    expected = _reference(text, stops)
    assert _feed_all(StopStringMatcher(stops), pieces) == expected
    assert _feed_all(StopStringMatcher(stops), [text]) == expected  # the split never matters


@given(data=st.data(), text=_STOP_TEXT, stops=_STOPS)
@settings(max_examples=300, deadline=None)
def test_unarmed_text_is_held_back_but_never_ends_in_a_stop(data, text, stops):
    boundary = data.draw(st.integers(0, len(text)))
    unarmed, armed = data.draw(_split(text[:boundary])), data.draw(_split(text[boundary:]))
    assert _feed_all(StopStringMatcher(stops), armed, unarmed) == _reference(text, stops, boundary)


@pytest.mark.parametrize("pieces", [["<<b<"], ["<<b", "<"]])
def test_first_stop_to_complete_wins_however_the_text_is_split(pieces):
    # "b" completes at index 2, before "<b<" (which starts earlier) completes at index 3.
    assert _feed_all(StopStringMatcher(["b", "<b<"]), pieces) == ("<<", "b")


def test_on_a_tie_of_end_the_longer_stop_wins():
    assert _feed_all(StopStringMatcher(["c", "bc"]), ["ab", "cd"]) == ("a", "bc")


def test_stop_straddling_the_arming_point_is_found():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("ab</", armed=False) == ("ab", False)
    assert matcher.feed("s>tail") == ("", True)
    assert matcher.matched == "</s>"


def test_stop_completed_while_unarmed_is_plain_text():
    matcher = StopStringMatcher(["b", "<b<"])
    assert matcher.feed("a<b", armed=False) == ("a", False)  # "<b" may yet become "<b<"
    assert matcher.feed("c") == ("<bc", False)  # the unarmed "b" does not count later
    assert matcher.feed("<b<") == ("<", True)
    assert matcher.matched == "b"


def test_matcher_holds_back_a_possible_stop_prefix():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("hello </e") == ("hello ", False)
    assert matcher.feed("x") == ("</ex", False)
    assert matcher.feed("</en") == ("", False)
    assert matcher.flush() == "</en"


def test_matcher_names_the_stop_it_hit_and_stays_stopped():
    matcher = StopStringMatcher(["STOP", "END"])
    assert matcher.feed("abcEN") == ("abc", False)
    assert matcher.feed("D and more") == ("", True)
    assert matcher.matched == "END"
    assert matcher.feed("later") == ("", True)


class ObviousMatcher:
    """The matcher as first written, one stop string at a time: the reference for the automaton."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.matched = [s for s in stops if s], "", None

    def feed(self, text: str, *, armed: bool = True) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        buffer = self.held + text
        ends = [(start + len(stop), -len(stop), stop) for stop in self.stops
                if (start := buffer.find(stop, max(0, len(self.held) - len(stop) + 1))) >= 0]
        if armed and ends:
            end, _, self.matched = min(ends)
            self.held = ""
            return buffer[: end - len(self.matched)], True
        keep = next((n for n in range(len(buffer), 0, -1)
                     if any(len(s) > n and s.startswith(buffer[-n:]) for s in self.stops)), 0)
        self.held = buffer[len(buffer) - keep:]
        return buffer[: len(buffer) - keep], False


@given(data=st.data(), text=st.text("ab<", max_size=60),
       stops=st.lists(st.text("ab<", min_size=1, max_size=7), min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_the_automaton_answers_every_feed_as_the_obvious_matcher_does(data, text, stops):
    """Many overlapping stops, random delta splits, a random arming point: feed by feed equal."""
    boundary = data.draw(st.integers(0, len(text)))
    feeds = [(piece, False) for piece in data.draw(_split(text[:boundary]))]
    feeds += [(piece, True) for piece in data.draw(_split(text[boundary:]))]
    automaton, obvious = StopStringMatcher(stops), ObviousMatcher(stops)
    for piece, armed in feeds:
        assert automaton.feed(piece, armed=armed) == obvious.feed(piece, armed=armed)
        assert automaton.matched == obvious.matched
    assert automaton.flush() == obvious.held


def test_the_choices_of_one_request_share_one_automaton():
    stops = [f"stop {i}" for i in range(64)]
    assert StopStringMatcher(stops)._automaton is StopStringMatcher(list(stops))._automaton


def test_matcher_without_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


# ---- the real tokenizer -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.real_model
def test_real_tokenizer_matches_reference_prompt_ids(smollm2_tokenizer, reference):
    for case in reference.cases:
        text = case["rendered"] if case["messages"] else case["prompt"]
        assert smollm2_tokenizer.encode(text) == case["prompt_ids"], text


@pytest.mark.real_model
def test_real_chat_template_renders_reference(smollm2_tokenizer, reference):
    for case in reference.cases:
        if case["messages"]:
            assert smollm2_tokenizer.apply_chat_template(case["messages"]) == case["rendered"]


@pytest.mark.real_model
def test_real_greedy_ids_decode_to_reference_text(smollm2_tokenizer, reference):
    for case in reference.cases:
        text = smollm2_tokenizer.decode(case["greedy_ids"], skip_special_tokens=False)
        assert text == case["greedy_text"]


@pytest.mark.real_model
def test_real_emoji_stream_never_emits_replacement_char(smollm2_tokenizer, reference):
    case = next(c for c in reference.cases if c["prompt"] and ROCKET in c["prompt"])
    ids = case["prompt_ids"] + case["greedy_ids"]
    deltas = _stream(smollm2_tokenizer, [[i] for i in ids])
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids)
    assert ROCKET in deltas


@pytest.mark.real_model
def test_real_special_ids(smollm2_tokenizer):
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == 1
    assert smollm2_tokenizer.eos_token_ids == frozenset({2})
    assert not smollm2_tokenizer.add_bos_token
