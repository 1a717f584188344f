"""A LLaVA-1.5 text GGUF whose vocabulary has no `<image>` token (llava-v1.5-7b's, Llama's 32,000
tokens) with its mmproj, against transformers' LlavaForConditionalGeneration with `<image>` in its
vocabulary, fed the same image: the prompt's text pieces are the transformers processor's ids, the
image rows take an id outside the vocabulary, and the logits over the vocabulary, the greedy
tokens (with penalties too) and the prompt logprobs are transformers' (float32). Everything that
walks prompt ids keeps off that id: prompt logprobs (None there), DRY, prompt lookup and the
draft model."""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.engine.proposers import NgramProposer
from nanoserve.engine.request import Request
from nanoserve.engine.sampler import SamplingBatch, SamplingRow
from nanoserve.engine.spec_decode import DraftState, SpecConfig
from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.openai.protocol import TokenText, prompt_logprobs_body
from tests.tiny_vlm import (
    assert_generate_prints,
    image_bytes,
    random_image,
    reference_llava_processor,
    run_to_end,
    write_text_gguf,
    write_tiny_llava,
    write_tiny_llava_mmproj,
)

pytest.importorskip("transformers")

PROMPTS = [("Describe <image> please", [random_image(100, 70, seed=1)]),
           ("<image> and <image>: which?", [random_image(20, 33, seed=2), random_image(64, 64, seed=3)])]
# The text before the image comes back after it: prompt lookup and DRY find the image after it.
REPEAT = ("look at<image>look at", [random_image(40, 30, seed=4)])
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, "kv_cache_dtype": "float32"}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("llava-hf"), shortest_edge=28, pad_to_square=True,
                            llama_cpp_f16=True, seed=7)


@pytest.fixture(scope="module")
def base_vocab_pair(llava_dir, tmp_path_factory):
    """The folder's text model as a GGUF without `<image>`, and its mmproj."""
    out = tmp_path_factory.mktemp("llava-base-vocab")
    return (write_text_gguf(llava_dir, out, without_token="<image>"),
            write_tiny_llava_mmproj(llava_dir, out / "mmproj.gguf"))


@pytest.fixture(scope="module")
def engine(base_vocab_pair):
    text, mmproj = base_vocab_pair
    return Engine(EngineConfig(model=str(text), mmproj=str(mmproj), **OPTIONS))


@pytest.fixture(scope="module")
def hf_model(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def hf_inputs(llava_dir, text: str, images: list):
    """transformers' processor's input ids and pixels for the prompt (`<image>` in its vocabulary)."""
    return reference_llava_processor(llava_dir)(images=[images], text=[text], return_tensors="pt")


def hf_logits(hf_model, input_ids: torch.Tensor, pixels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """transformers' float32 logits at every position, over the base vocabulary's ids."""
    with torch.no_grad():
        return hf_model(input_ids=input_ids, pixel_values=pixels).logits[0, :, :vocab_size]


def hf_greedy(hf_model, inputs, vocab_size: int, num_tokens: int, edit=lambda logits, ids, output: logits
              ) -> list[int]:
    """transformers' greedy tokens over the base vocabulary, each step's last logits through `edit`."""
    ids, output = inputs["input_ids"], []
    for _ in range(num_tokens):
        logits = edit(hf_logits(hf_model, ids, inputs["pixel_values"], vocab_size)[-1], ids, output)
        output.append(int(logits.argmax()))
        ids = torch.cat([ids, torch.tensor([[output[-1]]])], dim=1)
    return output


def prompt_ids(engine: Engine, text: str, images: list) -> list[int]:
    request_id = engine.add_request(text, SamplingParams(max_tokens=1), images=images)
    ids = list(engine.requests[request_id].prompt_ids)
    engine.abort(request_id)
    return ids


def test_the_text_pieces_are_transformers_ids_and_the_image_rows_lie_outside_the_vocabulary(
        engine, hf_model, llava_dir):
    image_token_id = hf_model.config.image_token_id
    assert engine.tokenizer.backend.token_to_id("<image>") is None
    for text, images in [*PROMPTS, REPEAT]:
        theirs = hf_inputs(llava_dir, text, images)["input_ids"][0].tolist()
        ours = prompt_ids(engine, text, images)
        assert len(ours) == len(theirs)
        image_rows = [p for p, token in enumerate(theirs) if token == image_token_id]
        assert image_rows and all(ours[p] >= engine.vocab_size for p in image_rows)
        assert [t for p, t in enumerate(ours) if p not in image_rows] == [
            t for p, t in enumerate(theirs) if p not in image_rows]


def test_the_image_rows_id_is_taken_only_where_placed_images_put_it(engine):
    """The id outside the vocabulary is internal: a prompt of token ids holding it is refused, and
    a prompt placed by the server's planner holds it at its images' rows alone."""
    text, images = PROMPTS[0]
    ids, placed = engine.images.prompt(text, images, engine.admission.encode_pieces, lambda ids: ids)
    image_rows_id = ids[placed[0].positions[0]]
    for prompt, with_images in [(ids, None), ([*ids, image_rows_id], placed)]:
        with pytest.raises(InvalidRequestError, match=rf"in \[0, {engine.vocab_size}\)") as refusal:
            engine.add_request(prompt, SamplingParams(max_tokens=1), images=with_images)
        assert refusal.value.param == "prompt"
    run_to_end(engine, engine.add_request(ids, SamplingParams(max_tokens=1), images=placed))


def test_logits_and_greedy_tokens_are_transformers_fed_the_image_by_its_own_token(
        engine, hf_model, llava_dir):
    vocab = engine.vocab_size
    for text, images in PROMPTS:
        inputs = hf_inputs(llava_dir, text, images)
        expected = hf_logits(hf_model, inputs["input_ids"], inputs["pixel_values"], vocab)[-1]
        logits = engine.prompt_logits([text], images=[images])[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        tokens = run_to_end(engine, engine.add_request(text, GREEDY, images=images))
        assert tokens == hf_greedy(hf_model, inputs, vocab, 6)


def test_prompt_logprobs_are_none_at_the_image_rows_and_transformers_elsewhere(engine, hf_model, llava_dir):
    text, images = PROMPTS[1]
    inputs = hf_inputs(llava_dir, text, images)
    expected = torch.log_softmax(
        hf_logits(hf_model, inputs["input_ids"], inputs["pixel_values"], engine.vocab_size), dim=-1)
    (completion,) = [output for output in _outputs(engine, text, images, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=2)) if output.prompt_logprobs is not None]
    ids, entries = prompt_ids(engine, text, images), completion.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        if ids[position] >= engine.vocab_size:
            assert entries[position] is None, position
        else:
            assert entries[position].token_id == ids[position]
            assert entries[position].logprob == pytest.approx(
                expected[position - 1, ids[position]].item(), abs=1e-4), position
    body = prompt_logprobs_body(entries, 2, TokenText(engine.tokenizer))  # the server's field
    assert [entry is None for entry in body] == [p == 0 or t >= engine.vocab_size for p, t in enumerate(ids)]


def _outputs(engine: Engine, text: str, images: list, params: SamplingParams) -> list:
    engine.add_request(text, params, images=images)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_penalties_and_bias_with_an_image_give_transformers_greedy_tokens(engine, hf_model, llava_dir):
    """Repetition penalty over the prompt and output (transformers' own processor; the image rows'
    id is not a token), OpenAI's presence and frequency penalties over the output, logit_bias."""
    from transformers import RepetitionPenaltyLogitsProcessor

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                            presence_penalty=0.5, frequency_penalty=0.25, logit_bias={300: 1.0})
    repetition = RepetitionPenaltyLogitsProcessor(1.5)

    def edit(logits, ids, output):
        logits = repetition(ids, logits[None].clone())[0]
        for token in set(output):  # frequency * count rounded once to float32, then presence
            logits[token] = logits[token] - torch.tensor(0.25 * output.count(token)) - 0.5
        logits[300] += 1.0
        return logits

    changed = False
    for text, images in [*PROMPTS, REPEAT]:
        inputs = hf_inputs(llava_dir, text, images)
        tokens = run_to_end(engine, engine.add_request(text, params, images=images))
        assert tokens == hf_greedy(hf_model, inputs, engine.vocab_size, 6, edit)
        changed |= tokens != hf_greedy(hf_model, inputs, engine.vocab_size, 6)
    assert changed  # the edits decided some token


def test_dry_never_penalizes_the_image_rows_id(engine):
    """DRY finds the image's rows after the prompt's earlier `look at`: their id would extend the
    repeat, and is never sampled, so it takes no cell; the request runs."""
    from nanoserve.engine.dry import DryHistory

    text, images = REPEAT
    ids = prompt_ids(engine, text, images)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, dry_multiplier=0.8,
                            dry_allowed_length=1)
    tokens, _ = DryHistory(params, ids).penalties()
    assert tokens.max() >= engine.vocab_size
    batch = SamplingBatch.build([SamplingRow(params, 0, 0, ids, [])], vocab_size=engine.vocab_size,
                                eos_token_ids=frozenset(), device="cpu")
    cells = batch.edits.dry if batch.edits is not None else None
    assert sorted(cells.cols.tolist() if cells is not None else []) == sorted(
        t for t in tokens.tolist() if t < engine.vocab_size)
    assert len(run_to_end(engine, engine.add_request(text, params, images=images))) == 6


def test_prompt_lookup_never_drafts_the_image_rows_id(engine):
    text, images = REPEAT
    ids = prompt_ids(engine, text, images)
    state = DraftState.for_config(SpecConfig(3))
    proposer = NgramProposer(vocab_size=engine.vocab_size)
    assert proposer.limit(Request("repeat", ids, GREEDY, 0), state, 3) == 0
    assert state.index.propose(3)[0] >= engine.vocab_size  # what the lookup found: the image's rows


@pytest.mark.parametrize("speculation", [{}, {"speculative_method": "draft"}], ids=["ngram", "draft-model"])
def test_speculation_with_an_image_gives_transformers_greedy_tokens(speculation, base_vocab_pair, hf_model,
                                                                    llava_dir):
    """Exact speculation beside an image: prompt lookup, and a draft model (the base model itself,
    which sees no image: a request whose rows' id it cannot embed drafts nothing)."""
    text, mmproj = base_vocab_pair
    if speculation:
        speculation = speculation | {"draft_model": str(text)}
    engine = Engine(EngineConfig(model=str(text), mmproj=str(mmproj), speculative_tokens=3,
                                 speculative_policy="always", **speculation, **OPTIONS))
    for prompt, images in [REPEAT, PROMPTS[0]]:
        tokens = run_to_end(engine, engine.add_request(prompt, GREEDY, images=images))
        assert tokens == hf_greedy(hf_model, hf_inputs(llava_dir, prompt, images), engine.vocab_size, 6)


def test_generate_with_the_pair_and_an_image_prints_transformers_greedy_text(base_vocab_pair, hf_model,
                                                                             llava_dir, engine, tmp_path):
    """`nanoserve generate "What is it?" --model TEXT --mmproj MMPROJ --image IMAGE` (the image's
    placeholder put before the prompt) prints what transformers' greedy tokens decode to."""
    text, mmproj = base_vocab_pair
    image = random_image(100, 70, seed=1)
    (tmp_path / "cat.png").write_bytes(image_bytes(image))
    inputs = hf_inputs(llava_dir, "<image>What is it?", [image])
    tokens = hf_greedy(hf_model, inputs, engine.vocab_size, 6)
    hf_tokenizer = reference_llava_processor(llava_dir).tokenizer
    if hf_tokenizer.eos_token_id in tokens:
        tokens = tokens[:tokens.index(hf_tokenizer.eos_token_id)]
    assert_generate_prints(text, mmproj, tmp_path / "cat.png", hf_tokenizer.decode(tokens))
