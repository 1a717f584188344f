"""Images through the engine: an image request's tokens and logprobs are the same bits alone, in a
crowd of text and image requests (chunked prefill splitting prompts inside images; never inside
Gemma 3's, whose rows attend to each other both ways; Qwen2-VL's and Qwen2.5-VL's rotating by
M-RoPE positions, text rows in the same step by their own), after preemption, and with prefix
caching on or off (a cached prefix ending inside a Gemma 3 image too), on the native and the torch
attention; the prefix cache shares blocks between prompts with the same image only; each image
is encoded once; bad images are refused before any step."""

from __future__ import annotations

import pytest

from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.multimodal.limits import ImageLimits
from nanoserve.sampling_params import SamplingParams
from tests.tiny_vlm import (
    image_bytes,
    random_image,
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_llava,
    write_tiny_qwen2_vl,
)

pytest.importorskip("transformers")

PROMPT = "<|im_start|>user\nWhat is in <image>?<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = "<|im_start|>user\nCompare <image> with <image>.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2.5-vl"), qwen2_5=True, seed=1)


def image(seed: int, width: int = 100, height: int = 70) -> bytes:
    return image_bytes(random_image(width, height, seed=seed))


def params(seed: int) -> SamplingParams:
    # Sampled (keyed by seed and position) and greedy rows both: a difference in any logit shows.
    return SamplingParams(max_tokens=12, temperature=0.0 if seed % 2 else 0.9, seed=seed, ignore_eos=True,
                          logprobs=3)


def image_prompt(seed: int, placeholder: str = "<image>") -> dict:
    return {"prompt": PROMPT.replace("<image>", placeholder), "multi_modal_data": {"image": image(seed)}}


def crowd(placeholder: str = "<image>") -> list:
    two = {"prompt": TWO_IMAGES.replace("<image>", placeholder),
           "multi_modal_data": {"image": [image(2), image(3, 30, 50)]}}
    return [image_prompt(1, placeholder), "The capital of France is", two, image_prompt(4, placeholder),
            "Once upon a time, in a small village", image_prompt(1, placeholder)]


def outcome(llm: LLM, prompts: list, seeds: list[int] | None = None) -> list[tuple[list[int], list[tuple]]]:
    """Each prompt's tokens and logprobs, prompt i sampled with params(seeds[i]) (default: i)."""
    seeds = seeds if seeds is not None else list(range(len(prompts)))
    completions = llm.generate(prompts, [params(seed) for seed in seeds])
    assert llm.engine.pool.is_completely_free
    return [(c.outputs[0].token_ids, [(e.token_id, e.logprob, e.top) for e in c.outputs[0].logprobs])
            for c in completions]


# family -> (its checkpoint fixture, its placeholder, a pool (blocks of 4) small enough to preempt its crowd)
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {"idefics3": ("vlm_dir", "<image>", 60), "llava": ("llava_dir", "<image>", 24),
            "gemma3": ("gemma3_dir", "<start_of_image>", 24),
            "qwen2_vl": ("qwen2_vl_dir", QWEN_PLACEHOLDER, 40),
            "qwen2_5_vl": ("qwen2_5_vl_dir", QWEN_PLACEHOLDER, 40)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_image_requests_are_the_same_bits_alone_in_a_crowd_and_after_preemption(family, request):
    fixture, placeholder, cramped_blocks = FAMILIES[family]
    vlm_dir = request.getfixturevalue(fixture)
    prompts = crowd(placeholder)
    roomy = LLM(str(vlm_dir), device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=512,
                block_size=4)
    alone = [outcome(roomy, [prompt], [seed])[0] for seed, prompt in enumerate(prompts)]
    # Small steps: every image prompt (about 100 tokens) is split into chunks, inside its images.
    chunked = LLM(str(vlm_dir), device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=512,
                  max_num_batched_tokens=24, block_size=4)
    assert outcome(chunked, prompts) == alone
    cramped = LLM(str(vlm_dir), device="cpu", dtype="float32", batch_invariant=True,
                  num_kv_blocks=cramped_blocks, max_num_batched_tokens=32, block_size=4)
    cramped.engine.images.cache.max_bytes = 0  # a recompute reads the rows its request kept, not the cache
    assert outcome(cramped, prompts) == alone
    assert cramped.engine.scheduler.num_preemptions >= 2, "the pool was not small enough to preempt"
    uncached = LLM(str(vlm_dir), device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=512,
                   enable_prefix_caching=False, max_num_batched_tokens=24, block_size=4)
    assert outcome(uncached, prompts) == alone


def test_prefix_cache_shares_blocks_for_the_same_image_only(vlm_dir):
    llm = LLM(str(vlm_dir), device="cpu", dtype="float32", num_kv_blocks=512, block_size=4)
    engine = llm.engine
    (first,) = llm.generate(image_prompt(5), params(0))
    prompt_ids = first.prompt_token_ids
    first_image_row = prompt_ids.index(engine.images.encoder.config.image_token_id)
    # Same image: every full block of the prompt but the last (whose last token is computed anew).
    assert same_cached(engine, image_prompt(5)) == (len(prompt_ids) - 1) // 4 * 4
    # Another image behind the same token ids: only the blocks before its first row.
    assert same_cached(engine, image_prompt(6)) == first_image_row // 4 * 4


def same_cached(engine, prompt: dict) -> int:
    """The prompt tokens the prefix cache supplies to `prompt` now."""
    request_id = engine.add_request(prompt["prompt"], SamplingParams(max_tokens=1),
                                    images=[prompt["multi_modal_data"]["image"]])
    while engine.has_unfinished():
        outputs = engine.step()
    (output,) = outputs
    assert output.request_id == request_id
    return output.num_cached_tokens


def test_each_image_is_encoded_once_however_many_requests_and_chunks_carry_it(vlm_dir):
    llm = LLM(str(vlm_dir), device="cpu", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    llm.generate([image_prompt(7), image_prompt(7), image_prompt(8)], [params(i) for i in range(3)])
    assert llm.engine.images.cache.misses == 2


@pytest.fixture(scope="module")
def strict(vlm_dir):
    return LLM(str(vlm_dir), device="cpu", dtype="float32", num_kv_blocks=128,
               image_limits=ImageLimits(max_images_per_prompt=1, max_pixels=200 * 200))


@pytest.mark.parametrize(("prompt", "images", "param"), [
    (PROMPT, [image_bytes(random_image(64, 64))[:60]], "images[0]"),  # a truncated PNG
    (PROMPT, [b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'], "images[0]"),
    (PROMPT, [image_bytes(random_image(300, 200))], "images[0]"),  # over max_pixels
    (TWO_IMAGES, [image(1), image(2)], "images"),  # over max_images_per_prompt
    (PROMPT + "<image>", [image(1)], "images"),  # two placeholders, one image
    (PROMPT, ["not an image"], "images[0]"),
])
def test_bad_images_are_refused_naming_the_part_before_any_step(strict, prompt, images, param):
    engine = strict.engine
    steps = engine.stats.steps
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(prompt, SamplingParams(max_tokens=2), images=images)
    assert error.value.param == param
    assert engine.stats.steps == steps and not engine.has_unfinished()


def test_a_text_only_model_refuses_images(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate({"prompt": "hi <image>", "multi_modal_data": {"image": image(1)}})
    assert error.value.param == "images"


def test_generate_image_file_streams_the_librarys_text_and_a_bad_file_exits_2(vlm_dir, tmp_path):
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    (tmp_path / "cat.png").write_bytes(image(1))
    (tmp_path / "cat.svg").write_bytes(b'<svg xmlns="http://www.w3.org/2000/svg"/>')
    llm = LLM(str(vlm_dir), device="cpu", dtype="float32", num_kv_blocks=128)
    (expected,) = llm.generate({"prompt": "<image>What is it?", "multi_modal_data": {"image": image(1)}},
                               SamplingParams(max_tokens=6, temperature=0.0))
    args = ["generate", "What is it?", "--model", str(vlm_dir), "--dtype", "float32", "--max-tokens", "6"]
    result = CliRunner().invoke(app, [*args, "--image", str(tmp_path / "cat.png")])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(expected.outputs[0].text + "\n")
    result = CliRunner().invoke(app, [*args, "--image", str(tmp_path / "cat.svg")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "images[0]" in result.output or "not a PNG" in result.output


def test_a_cached_prefix_ending_inside_a_gemma3_image_gives_the_uncached_bits(gemma3_dir):
    """A prompt ending in its image: a repeat finds cached blocks up to a boundary inside the
    image, and computes the rest of the image in one chunk whose rows read the cached ones
    (computed whole, so final): the same bits as with no prefix cache."""
    settings = dict(device="cpu", dtype="float32", batch_invariant=True, num_kv_blocks=256, block_size=8,
                    kv_cache_dtype="float32")
    cached, uncached = LLM(str(gemma3_dir), **settings), LLM(str(gemma3_dir), enable_prefix_caching=False,
                                                            **settings)
    image_token_id = cached.engine.images.encoder.config.image_token_id
    for lead in ("Describe", "Describe it", "Describe it now", "Describe this", "Say", "Say it"):
        prompt = {"prompt": f"{lead} <start_of_image>", "multi_modal_data": {"image": image(11)}}
        (first,) = cached.generate(prompt, params(1))
        ids = first.prompt_token_ids
        image_rows = [p for p, token in enumerate(ids) if token == image_token_id]
        hit = (len(ids) - 1) // 8 * 8
        if image_rows[0] < hit <= image_rows[-1]:
            break
    else:
        pytest.fail("no prompt put a block boundary inside its image")
    hits = cached.engine.scheduler.prefix_cache_hits
    (again,) = cached.generate(prompt, params(1))
    assert cached.engine.scheduler.prefix_cache_hits - hits == hit
    (expected,) = uncached.generate(prompt, params(1))
    for ours in (first, again):
        assert ours.outputs[0].token_ids == expected.outputs[0].token_ids
        assert ([(e.token_id, e.logprob, e.top) for e in ours.outputs[0].logprobs]
                == [(e.token_id, e.logprob, e.top) for e in expected.outputs[0].logprobs])


def test_a_qwen_image_longer_than_200_times_its_width_is_refused_naming_the_part(qwen2_vl_dir):
    """transformers' smart_resize refuses an aspect ratio over 200: a 400 naming the image, no step."""
    llm = LLM(str(qwen2_vl_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    engine, steps = llm.engine, llm.engine.stats.steps
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(PROMPT.replace("<image>", QWEN_PLACEHOLDER), SamplingParams(max_tokens=2),
                           images=[image(1, 1005, 5)])
    assert error.value.param == "images[0]" and "200" in error.value.message
    assert engine.stats.steps == steps and not engine.has_unfinished()
