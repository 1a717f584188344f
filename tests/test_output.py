"""OutputProcessor: the stop rules as a request sees them, one sampled token at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import sentencepiece_tokenizer

from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.output import OutputProcessor
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _generate(tokenizer: Tokenizer, chars: str, **params: object) -> tuple[str, str | None, str | int | None]:
    """(text, finish_reason, stop_reason) when the model samples one token per character."""
    processor = OutputProcessor(tokenizer)
    sampling = SamplingParams(**params)
    request = Request("r", [5], sampling, seed=0, output_state=processor.new_state(sampling))
    scheduler = Scheduler(SchedulerConfig(), BlockPool(4, 16))
    scheduler.add(request)
    text = []
    for char in chars:
        (token_id,) = tokenizer.encode(char, add_bos=False)
        new_token, output = processor.judge(request, token_id, None)
        scheduler.update_after_step(SchedulerOutput(), [new_token])
        assert output.num_output_tokens == len(request.output_ids)
        text.append(output.text)
        if output.finished:
            return "".join(text), output.finish_reason, output.stop_reason
    return "".join(text), None, None


def test_stop_string_straddling_min_tokens_is_found(tiny_tokenizer):
    # "X" is the 2nd token (min_tokens not yet passed), "Y" the 3rd: the stop completes armed.
    assert _generate(tiny_tokenizer, "aXYb", stop=["XY"], min_tokens=2) == ("a", "stop", "XY")


def test_stop_string_completed_before_min_tokens_is_plain_text(tiny_tokenizer):
    assert _generate(tiny_tokenizer, "aXYb", stop=["aX"], min_tokens=2, max_tokens=4) == (
        "aXYb", "length", None)
    assert _generate(tiny_tokenizer, "aXYb", stop=["aX"], min_tokens=1) == ("", "stop", "aX")


def test_first_token_after_the_prompt_keeps_its_leading_space():
    """SentencePiece decoders drop a decode's first space; the prompt's tail is the context."""
    tokenizer = sentencepiece_tokenizer("metaspace")
    processor = OutputProcessor(tokenizer)
    sampling = SamplingParams()
    prompt_ids = tokenizer.encode("The capital is")
    state = processor.new_state(sampling, prompt_ids)
    request = Request("r", prompt_ids, sampling, seed=0, output_state=state)
    _, output = processor.judge(request, tokenizer.backend.token_to_id("\u2581Paris"), None)
    assert output.text == " Paris"


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(tiny_tokenizer):
    assert _generate(tiny_tokenizer, "aXYb", stop=["XY"], max_tokens=3) == ("a", "stop", "XY")
    assert _generate(tiny_tokenizer, "XY", stop=["XY"], max_tokens=2) == ("", "stop", "XY")


def test_text_held_back_for_a_stop_string_is_released_when_max_tokens_ends_the_request(tiny_tokenizer):
    # "X" might begin "XY", so it is held back; the budget ends first, and the text is whole.
    assert _generate(tiny_tokenizer, "aXYb", stop=["XY"], max_tokens=2) == ("aX", "length", None)


def test_a_stop_token_as_the_last_allowed_token_finishes_with_stop(tiny_tokenizer):
    (token_x,) = tiny_tokenizer.encode("X", add_bos=False)
    assert _generate(tiny_tokenizer, "abX", stop_token_ids=[token_x], max_tokens=3) == ("ab", "stop", token_x)
