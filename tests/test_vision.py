"""Each vision family's image side against transformers (Idefics3 / SmolVLM, LLaVA-1.5, Gemma 3):
the processor's pixel values and prompt ids, the encoder's embedding rows, and the text model's
logits and greedy tokens with images in the prompt (float32, float32 K/V, tiny random checkpoints
built by transformers in several sizes; Gemma 3's image rows attend to each other both ways)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.errors import InvalidRequestError, UnsupportedModelError
from nanoserve.loading.vision import load_image_encoder, read_vision_config
from nanoserve.multimodal.inputs import expand_placeholders
from nanoserve.multimodal.processors import load_processor
from nanoserve.sampling_params import SamplingParams
from tests.tiny_vlm import (
    random_image,
    reference_gemma3_processor,
    reference_llava_processor,
    reference_processor,
    write_tiny_gemma3,
    write_tiny_gguf_pair,
    write_tiny_idefics3,
    write_tiny_llava,
)

pytest.importorskip("transformers")

SIZES = {
    "idefics3-small": (write_tiny_idefics3, {}),
    "idefics3-wider": (write_tiny_idefics3, dict(vision_hidden=48, vision_layers=3, vision_heads=6,
                                                 text_hidden=96, text_layers=3, longest_edge=96,
                                                 tie_word_embeddings=True, seed=1)),
    "idefics3-patch8": (write_tiny_idefics3, dict(image_size=64, patch_size=8, scale_factor=4,
                                                  longest_edge=160, seed=2)),
    "idefics3-unsplit": (write_tiny_idefics3, dict(split=False, scale_factor=1, seed=3)),
    "smolvlm2": (write_tiny_idefics3, dict(smolvlm=True, seed=6)),
    "llava-default": (write_tiny_llava, {}),
    "llava-full-padded": (write_tiny_llava, dict(strategy="full", feature_layer=-1, pad_to_square=True,
                                                 vision_hidden=48, shortest_edge=40, seed=4)),
    "gemma3-small": (write_tiny_gemma3, {}),
    # A sliding window (6) shorter than an image (9 rows): its rows see from their window to its end.
    "gemma3-window-inside-image": (write_tiny_gemma3, dict(vision_hidden=48, image_size=36, patch_size=6,
                                                           tokens_per_image=9, text_hidden=96, text_layers=4,
                                                           sliding_window=6, head_dim=32, seed=1)),
    "gemma3-unpooled": (write_tiny_gemma3, dict(image_size=24, tokens_per_image=36, seed=2)),
}
# (width, height): landscape, portrait, square, smaller than one tile, one tile exactly, a strip
IMAGE_SHAPES = [(100, 70), (20, 33), (64, 64), (10, 7), (32, 32), (200, 50)]


@pytest.fixture(scope="module", params=sorted(SIZES))
def vlm_dir(request, tmp_path_factory):
    write, options = SIZES[request.param]
    return write(tmp_path_factory.mktemp(request.param), **options)


def family(vlm_dir) -> str:
    return read_vision_config(vlm_dir).family


def reference(vlm_dir):
    return {"llava": reference_llava_processor, "gemma3": reference_gemma3_processor,
            "idefics3": reference_processor}[family(vlm_dir)](vlm_dir)


def with_placeholder(vlm_dir, text: str) -> str:
    """`text` with its `<image>` placeholders spelled as the family's processor spells them."""
    return text.replace("<image>", load_processor(vlm_dir, read_vision_config(vlm_dir)).placeholder)


@pytest.fixture(scope="module")
def hf_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def hf_image_rows(hf_model, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' embedding rows of one image (its tiles)."""
    with torch.no_grad():
        if hf_model.config.model_type == "gemma3":
            return hf_model.model.get_image_features(pixels).pooler_output[0]
        if hasattr(hf_model.config, "vision_feature_layer"):
            return hf_model.model.get_image_features(
                pixels, vision_feature_layer=hf_model.config.vision_feature_layer,
                vision_feature_select_strategy=hf_model.config.vision_feature_select_strategy).pooler_output[0]
        return hf_model.model.get_image_features(pixels[None]).pooler_output[0]


def images_of_every_kind() -> list[Image.Image]:
    shapes = [random_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SHAPES)]
    return [*shapes, random_image(40, 30, seed=9, mode="RGBA"), random_image(30, 40, seed=10).convert("L")]


def test_pixel_values_and_prompt_ids_equal_transformers_processor(vlm_dir):
    config = read_vision_config(vlm_dir)
    processor, theirs_of = load_processor(vlm_dir, config), reference(vlm_dir)
    prompt = with_placeholder(vlm_dir, "Look: <image> what?")
    for image in images_of_every_kind():
        ours = processor.process(image.convert("RGB") if image.mode == "L" else _composited(image))
        theirs = theirs_of(images=[[image]], text=[prompt], return_tensors="pt")
        pixels = theirs["pixel_values"][0] if family(vlm_dir) == "idefics3" else theirs["pixel_values"]
        assert torch.equal(ours.pixel_values, pixels), image.size
        text = expand_placeholders(prompt, processor.placeholder, [ours], "prompt")
        assert theirs_of.tokenizer(text)["input_ids"] == theirs["input_ids"][0].tolist()


def _composited(image: Image.Image) -> Image.Image:
    from nanoserve.multimodal.images import to_rgb

    return to_rgb(image)


def test_image_embeddings_match_transformers(vlm_dir, hf_model):
    config = read_vision_config(vlm_dir)
    processor = load_processor(vlm_dir, config)
    encoder = load_image_encoder(vlm_dir, config, dtype=torch.float32, device=torch.device("cpu"))
    for image in images_of_every_kind()[:4]:
        pixels = processor.process(image.convert("RGB")).pixel_values
        expected = hf_image_rows(hf_model, pixels)
        rows = encoder.encode(pixels)
        assert rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return Engine(EngineConfig(model=str(vlm_dir), dtype="float32", device="cpu", num_kv_blocks=256,
                               kv_cache_dtype="float32"))


def test_logits_and_greedy_tokens_with_images_match_transformers(vlm_dir, hf_model, engine):
    """(Gemma 3: transformers' processor gives token_type_ids, whose image runs it attends
    bidirectionally, in prefill; causal attention would miss by far more than the tolerance.)"""
    theirs_of = reference(vlm_dir)
    prompts = [("Describe <image> please", [random_image(100, 70, seed=1)]),
               ("<image> and <image>: which?", [random_image(20, 33, seed=2), random_image(64, 64, seed=3)])]
    for text, images in prompts:
        text = with_placeholder(vlm_dir, text)
        inputs = theirs_of(images=[images], text=[text], return_tensors="pt")
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


def test_a_gguf_and_mmproj_pair_computes_the_hugging_face_folders_bits(tmp_path_factory):
    """llama.cpp's layout (text GGUF + mmproj GGUF, float32) loads into the same encoder, processor
    and logits as the folder it was written from."""
    vlm_dir = write_tiny_idefics3(tmp_path_factory.mktemp("idefics3-hf"), seed=5)
    text, mmproj = write_tiny_gguf_pair(vlm_dir, tmp_path_factory.mktemp("idefics3-gguf"))
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128}
    folder = Engine(EngineConfig(model=str(vlm_dir), **options))
    pair = Engine(EngineConfig(model=str(text), mmproj=str(mmproj), **options))
    assert pair.images.processor == folder.images.processor
    ours, theirs = pair.images.encoder.config, folder.images.encoder.config
    assert dataclasses.replace(ours, layer_norm_eps=theirs.layer_norm_eps) == theirs
    assert ours.layer_norm_eps == pytest.approx(theirs.layer_norm_eps, rel=1e-7)  # a float32 in GGUF
    prompts = ["Describe <image> please", "<image> and <image>: which?"]
    images = [[random_image(100, 70, seed=1)], [random_image(20, 33, seed=2), random_image(64, 64, seed=3)]]
    assert torch.equal(pair.prompt_logits(prompts, images), folder.prompt_logits(prompts, images))


def test_an_mmproj_that_is_not_a_file_is_refused_naming_it(tmp_path, tiny_model_dir):
    with pytest.raises(InvalidRequestError) as error:
        Engine(EngineConfig(model=str(tiny_model_dir), mmproj=str(tmp_path / "missing.gguf"),
                            num_kv_blocks=16))
    assert error.value.param == "mmproj"


def test_a_llava_hf_config_that_lists_only_changed_fields_reads_with_transformers_defaults():
    """llava-hf's config.json gives text_config and vision_config as diffs from the defaults."""
    from nanoserve.loading.hf_config import read_model_config
    from nanoserve.model.vision_config import VisionConfig, text_config_dict

    raw = {"model_type": "llava", "image_token_index": 32000, "vision_feature_layer": -2,
           "text_config": {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096,
                           "rms_norm_eps": 1e-05},
           "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                             "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14}}
    vision = VisionConfig.from_hf_dict(raw)
    assert (vision.hidden_act, vision.rows_per_tile, vision.text_hidden_size) == ("quick_gelu", 576, 4096)
    text = read_model_config(text_config_dict(raw))
    assert (text.hidden_size, text.num_layers, text.num_kv_heads, text.vocab_size) == (4096, 32, 32, 32064)


def test_a_gemma3_config_that_lists_only_changed_fields_reads_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json gives text_config and vision_config as diffs from
    Gemma3TextConfig's and SiglipVisionConfig's defaults."""
    from nanoserve.loading.hf_config import read_model_config
    from nanoserve.model.vision_config import VisionConfig, text_config_dict

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "torch_dtype": "bfloat16",
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    vision = VisionConfig.from_hf_dict(raw)
    assert (vision.rows_per_tile, vision.image_token_id, vision.bidirectional) == (256, 262144, True)
    text = read_model_config(text_config_dict(raw))
    assert (text.num_heads, text.num_kv_heads, text.head_dim, text.vocab_size) == (8, 4, 256, 262208)
    assert (text.sliding_window, text.rope_theta, text.rope_scaling) == (1024, 1e6, {"rope_type": "linear",
                                                                                      "factor": 8.0})
    assert text.local_rope.theta == 10000.0 and text.sliding_layers[:6] == (True,) * 5 + (False,)


def test_gemma3_with_pan_and_scan_or_another_pooling_is_refused_naming_the_field(tmp_path):
    import json

    from nanoserve.model.vision_config import VisionConfig
    from nanoserve.multimodal.processors import Gemma3Processor

    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 32, "patch_size": 4}
    raw = {"model_type": "gemma3", "mm_tokens_per_image": 9, "text_config": {"hidden_size": 64},
           "vision_config": vision}
    with pytest.raises(UnsupportedModelError, match="mm_tokens_per_image"):
        VisionConfig.from_hf_dict(raw)
    config = VisionConfig.from_hf_dict(raw | {"mm_tokens_per_image": 16})
    with pytest.raises(UnsupportedModelError, match="do_pan_and_scan"):
        Gemma3Processor.from_config(json.loads('{"do_pan_and_scan": true}'), config)


def test_a_step_budget_below_one_gemma3_image_is_refused_naming_the_option(tmp_path_factory):
    """Its image is computed in one step (vLLM refuses the same below its largest item)."""
    vlm_dir = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-budget"))
    with pytest.raises(InvalidRequestError) as error:
        Engine(EngineConfig(model=str(vlm_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                            max_num_batched_tokens=15))
    assert error.value.param == "max_num_batched_tokens" and "16" in str(error.value)


MMPROJ_POOLINGS = {"pooled-by-llama.cpp's-default-4": dict(tokens_per_image=4),
                   "pooled-by-2-a-stated-scale-factor": dict(image_size=28, patch_size=7, tokens_per_image=4,
                                                             seed=3)}


@pytest.mark.parametrize("options", list(MMPROJ_POOLINGS.values()), ids=list(MMPROJ_POOLINGS))
def test_a_gemma3_mmproj_gguf_reads_into_the_hugging_face_folders_encoder_and_processor(options,
                                                                                       tmp_path_factory):
    """llama.cpp's gemma3 mmproj (its projector's norm stored as 1 + w, its pooling as a scale
    factor) gives the folder's vision config, processor and image rows, bit for bit."""
    import dataclasses

    from nanoserve.loading.mmproj import read_mmproj
    from nanoserve.model.vision import build_encoder
    from nanoserve.multimodal.processors import PROCESSORS
    from tests.tiny_vlm import write_tiny_gemma3_mmproj

    vlm_dir = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-hf"), **options)
    mmproj = write_tiny_gemma3_mmproj(vlm_dir, tmp_path_factory.mktemp("gemma3-gguf") / "mmproj.gguf")
    folder = read_vision_config(vlm_dir)
    vocabulary = {"<image_soft_token>": folder.image_token_id}
    config, weights, fields = read_mmproj(mmproj, vocabulary.get)
    assert dataclasses.replace(config, layer_norm_eps=folder.layer_norm_eps) == folder
    assert PROCESSORS["gemma3"].from_config(fields, config) == load_processor(vlm_dir, folder)
    ours = build_encoder(config, weights)
    theirs = load_image_encoder(vlm_dir, folder, dtype=torch.float32, device=torch.device("cpu"))
    pixels = load_processor(vlm_dir, folder).process(random_image(50, 40, seed=4)).pixel_values
    assert torch.equal(ours.encode(pixels), theirs.encode(pixels))
    with pytest.raises(UnsupportedModelError, match="<image_soft_token>"):
        read_mmproj(mmproj, {}.get)


@pytest.fixture(scope="module")
def llava_pair_dir(tmp_path_factory):
    """A LLaVA-1.5 folder an mmproj can hold exactly (its float16 matrices float16 values) whose
    processor is the one an mmproj implies (padded to a square, resized to the tower's side)."""
    return write_tiny_llava(tmp_path_factory.mktemp("llava-hf"), shortest_edge=28, pad_to_square=True,
                            llama_cpp_f16=True, seed=7)


LLAVA_MMPROJ_LAYOUTS = {"feature-layer-stated": {}, "last-layer-dropped": dict(state_feature_layer=False),
                        "2023-no-projector-type": dict(state_feature_layer=False, state_projector_type=False)}


@pytest.mark.parametrize("layout", list(LLAVA_MMPROJ_LAYOUTS.values()), ids=list(LLAVA_MMPROJ_LAYOUTS))
def test_a_llava_mmproj_in_llama_cpps_layout_gives_the_folders_config_processor_and_image_rows(
        layout, llava_pair_dir, tmp_path):
    """convert_image_encoder_to_gguf.py's layout (fc1 and fc2 under each other's names, float16
    patch convolution and projector matrices, CLIP's own projection_dim, the tower cut after the
    layer read, named by clip.vision.feature_layer or not) reads into the folder's vision config,
    processor and image rows, bit for bit."""
    from nanoserve.loading.mmproj import read_mmproj
    from nanoserve.model.vision import build_encoder
    from nanoserve.multimodal.processors import PROCESSORS
    from tests.tiny_vlm import write_tiny_llava_mmproj

    mmproj = write_tiny_llava_mmproj(llava_pair_dir, tmp_path / "mmproj.gguf", **layout)
    folder = read_vision_config(llava_pair_dir)
    config, weights, fields = read_mmproj(mmproj, {"<image>": folder.image_token_id}.get)
    assert config.num_layers == folder.num_layers - 1  # the file keeps the layers the projector reads
    read = range(config.num_layers + 1)[config.feature_layer]
    assert read == range(folder.num_layers + 1)[folder.feature_layer] == config.num_layers
    same = dict(num_layers=folder.num_layers, feature_layer=folder.feature_layer,
                layer_norm_eps=folder.layer_norm_eps)
    assert dataclasses.replace(config, **same) == folder
    assert config.layer_norm_eps == pytest.approx(folder.layer_norm_eps, rel=1e-7)  # a float32 in GGUF
    processor = PROCESSORS["llava"].from_config(fields, config)
    theirs_processor = load_processor(llava_pair_dir, folder)
    # The mean and std are float32s in GGUF: the float32s the processor normalises with.
    ours_stats, theirs_stats = processor.normalization, theirs_processor.normalization
    stats = dataclasses.replace(ours_stats, mean=theirs_stats.mean, std=theirs_stats.std)
    assert dataclasses.replace(processor, normalization=stats) == theirs_processor
    assert np.array_equal(np.float32([ours_stats.mean, ours_stats.std]),
                          np.float32([theirs_stats.mean, theirs_stats.std]))
    ours = build_encoder(config, weights)
    theirs = load_image_encoder(llava_pair_dir, folder, dtype=torch.float32, device=torch.device("cpu"))
    for image in images_of_every_kind()[:4]:
        pixels = processor.process(image.convert("RGB")).pixel_values
        assert torch.equal(pixels, theirs_processor.process(image.convert("RGB")).pixel_values), image.size
        assert torch.equal(ours.encode(pixels), theirs.encode(pixels)), image.size


LLAVA_MMPROJ_REFUSALS = {
    "granite's-stacked-feature-layers": (dict(state_feature_layer=False),
                                         lambda w: w.add_array("clip.vision.feature_layer", [1, 2]),
                                         "clip.vision.feature_layer"),
    "llava-next's-tiles": ({}, lambda w: w.add_array("clip.vision.image_grid_pinpoints", [28, 56, 56, 28]),
                           "clip.vision.image_grid_pinpoints"),
    "a-silu-tower": ({}, lambda w: w.add_bool("clip.use_silu", True), "clip.use_silu"),
}


@pytest.mark.parametrize(("layout", "extra_keys", "field"), list(LLAVA_MMPROJ_REFUSALS.values()),
                         ids=list(LLAVA_MMPROJ_REFUSALS))
def test_a_llava_mmproj_nanoserve_cannot_run_is_refused_naming_the_field(layout, extra_keys, field,
                                                                        llava_pair_dir, tmp_path):
    from nanoserve.loading.mmproj import read_mmproj
    from tests.tiny_vlm import write_tiny_llava_mmproj

    mmproj = write_tiny_llava_mmproj(llava_pair_dir, tmp_path / "mmproj.gguf", extra_keys=extra_keys,
                                     **layout)
    with pytest.raises(UnsupportedModelError, match=field):
        read_mmproj(mmproj, {"<image>": 1}.get)


def test_a_llava_gguf_and_mmproj_pair_generates_the_folders_tokens_in_the_engine_and_the_cli(
        llava_pair_dir, tmp_path_factory):
    """The pair through the engine: the folder's last logits (so its pixels and image rows) and
    greedy tokens, bit for bit; `nanoserve generate --mmproj --image` prints the folder's text."""
    from typer.testing import CliRunner

    from nanoserve.llm import LLM
    from nanoserve_cli.main import app
    from tests.tiny_vlm import image_bytes, write_text_gguf, write_tiny_llava_mmproj

    out = tmp_path_factory.mktemp("llava-gguf")
    text = write_text_gguf(llava_pair_dir, out)
    mmproj = write_tiny_llava_mmproj(llava_pair_dir, out / "mmproj.gguf")
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128}
    folder = Engine(EngineConfig(model=str(llava_pair_dir), **options))
    pair = Engine(EngineConfig(model=str(text), mmproj=str(mmproj), **options))
    prompts = ["Describe <image> please", "<image> and <image>: which?"]
    images = [[random_image(100, 70, seed=1)], [random_image(20, 33, seed=2), random_image(64, 64, seed=3)]]
    assert torch.equal(pair.prompt_logits(prompts, images), folder.prompt_logits(prompts, images))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [_run(engine, engine.add_request(prompts[1], greedy, images=images[1]))
              for engine in (pair, folder)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6

    image = out / "cat.png"
    image.write_bytes(image_bytes(random_image(100, 70, seed=1)))
    (expected,) = LLM(str(llava_pair_dir), **options).generate(
        {"prompt": "<image>What is it?", "multi_modal_data": {"image": image.read_bytes()}},
        SamplingParams(max_tokens=6, temperature=0.0))
    args = ["generate", "What is it?", "--model", str(text), "--mmproj", str(mmproj), "--image", str(image),
            "--dtype", "float32", "--max-tokens", "6"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert expected.outputs[0].text and result.stdout.endswith(expected.outputs[0].text + "\n")
