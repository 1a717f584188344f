"""The Idefics3 / SmolVLM image side against transformers: the processor's pixel values and prompt
ids, the encoder's embedding rows, and the text model's logits and greedy tokens with images in
the prompt (float32, tiny random checkpoints built by transformers in several sizes)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.loading.vision import load_image_encoder, read_vision_config
from nanoserve.multimodal.inputs import expand_placeholders
from nanoserve.multimodal.processors import load_processor
from nanoserve.sampling_params import SamplingParams
from tests.tiny_vlm import random_image, reference_processor, write_tiny_idefics3

pytest.importorskip("transformers")

SIZES = {
    "small": {},
    "wider": dict(vision_hidden=48, vision_layers=3, vision_heads=6, text_hidden=96, text_layers=3,
                  longest_edge=96, tie_word_embeddings=True, seed=1),
    "patch8": dict(image_size=64, patch_size=8, scale_factor=4, longest_edge=160, seed=2),
    "unsplit": dict(split=False, scale_factor=1, seed=3),
}
# (width, height): landscape, portrait, square, smaller than one tile, one tile exactly, a strip
IMAGE_SHAPES = [(100, 70), (20, 33), (64, 64), (10, 7), (32, 32), (200, 50)]


@pytest.fixture(scope="module", params=sorted(SIZES))
def vlm_dir(request, tmp_path_factory):
    return write_tiny_idefics3(tmp_path_factory.mktemp(f"idefics3-{request.param}"), **SIZES[request.param])


@pytest.fixture(scope="module")
def hf_model(vlm_dir):
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def images_of_every_kind() -> list[Image.Image]:
    shapes = [random_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SHAPES)]
    return [*shapes, random_image(40, 30, seed=9, mode="RGBA"), random_image(30, 40, seed=10).convert("L")]


def test_pixel_values_and_prompt_ids_equal_transformers_processor(vlm_dir):
    config = read_vision_config(vlm_dir)
    processor, reference = load_processor(vlm_dir, config), reference_processor(vlm_dir)
    for image in images_of_every_kind():
        ours = processor.process(image.convert("RGB") if image.mode == "L" else _composited(image))
        theirs = reference(images=[[image]], text=["Look: <image> what?"], return_tensors="pt")
        assert torch.equal(ours.pixel_values, theirs["pixel_values"][0]), image.size
        text = expand_placeholders("Look: <image> what?", "<image>", [ours], "prompt")
        assert reference.tokenizer(text)["input_ids"] == theirs["input_ids"][0].tolist()


def _composited(image: Image.Image) -> Image.Image:
    from nanoserve.multimodal.images import to_rgb

    return to_rgb(image)


def test_image_embeddings_match_transformers(vlm_dir, hf_model):
    config = read_vision_config(vlm_dir)
    processor = load_processor(vlm_dir, config)
    encoder = load_image_encoder(vlm_dir, config, dtype=torch.float32, device=torch.device("cpu"))
    for image in images_of_every_kind()[:4]:
        pixels = processor.process(image.convert("RGB")).pixel_values
        with torch.no_grad():
            expected = hf_model.model.get_image_features(pixels[None]).pooler_output[0]
        rows = encoder.encode(pixels)
        assert rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return Engine(EngineConfig(model=str(vlm_dir), dtype="float32", device="cpu", num_kv_blocks=256))


def test_logits_and_greedy_tokens_with_images_match_transformers(vlm_dir, hf_model, engine):
    reference = reference_processor(vlm_dir)
    prompts = [("Describe <image> please", [random_image(100, 70, seed=1)]),
               ("<image> and <image>: which?", [random_image(20, 33, seed=2), random_image(64, 64, seed=3)])]
    for text, images in prompts:
        inputs = reference(images=[images], text=[text], return_tensors="pt")
        with torch.no_grad():
            expected = hf_model(**inputs).logits[0, -1]
            generated = hf_model.generate(**inputs, max_new_tokens=6, do_sample=False)
            greedy = generated[0, inputs["input_ids"].shape[1]:]
        logits = engine.prompt_logits([text], images=[images])[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        request_id = engine.add_request(text, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                        images=images)
        tokens = _run(engine, request_id)
        assert tokens == greedy.tolist()


def _run(engine: Engine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.token_ids
    return tokens
