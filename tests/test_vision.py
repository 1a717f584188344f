"""Each vision family's image side against transformers (Idefics3 / SmolVLM, LLaVA-1.5, Gemma 3,
Qwen2-VL, Qwen2.5-VL): the processor's pixel values and prompt ids, the encoder's embedding rows,
and the text model's logits and greedy tokens with images in the prompt (float32, float32 K/V,
tiny random checkpoints built by transformers in several sizes; Gemma 3's image rows attend to
each other both ways; Qwen's take M-RoPE grids of positions, the text after them shifted)."""

from __future__ import annotations

import dataclasses

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
    assert_generate_prints,
    assert_pair_computes_the_folders_bits,
    assert_same_processor_as_folder,
    image_bytes,
    random_image,
    reference_gemma3_processor,
    reference_llava_processor,
    reference_processor,
    reference_qwen2_vl_processor,
    run_to_end,
    write_tiny_gemma3,
    write_tiny_gguf_pair,
    write_tiny_idefics3,
    write_tiny_llava,
    write_tiny_qwen2_vl,
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
    "qwen2-vl": (write_tiny_qwen2_vl, {}),
    "qwen2-vl-wider": (write_tiny_qwen2_vl, dict(vision_hidden=48, vision_layers=3, patch_size=6,
                                                 text_hidden=96, mrope_section=(4, 4, 4), max_pixels=96 * 96,
                                                 seed=1)),
    # Windows of 2 x 2 merged patches (a 100 x 70 image: 3 x 5 windows, the last row and column ragged)
    "qwen2.5-vl": (write_tiny_qwen2_vl, dict(qwen2_5=True, vision_layers=3, seed=2)),
    "qwen2.5-vl-one-window-layer": (write_tiny_qwen2_vl, dict(qwen2_5=True, window_size=24, patch_size=6,
                                                              full_attention_layers=(0,), text_layers=3,
                                                              seed=3)),
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
            "idefics3": reference_processor, "qwen2_vl": reference_qwen2_vl_processor,
            "qwen2_5_vl": reference_qwen2_vl_processor}[family(vlm_dir)](vlm_dir)


def with_placeholder(vlm_dir, text: str) -> str:
    """`text` with its `<image>` placeholders spelled as the family's processor spells them."""
    return text.replace("<image>", load_processor(vlm_dir, read_vision_config(vlm_dir)).placeholder)


@pytest.fixture(scope="module")
def hf_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def hf_image_rows(hf_model, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' embedding rows of one image (its tiles; Qwen's patches, their grid the shape)."""
    with torch.no_grad():
        if hf_model.config.model_type in ("qwen2_vl", "qwen2_5_vl"):
            grid_h, grid_w, width = pixels.shape
            return hf_model.model.get_image_features(pixels.reshape(-1, width),
                                                     torch.tensor([[1, grid_h, grid_w]])).pooler_output[0]
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
        if "image_grid_thw" in theirs:  # Qwen: transformers' patch rows, the grid they came from
            assert theirs["image_grid_thw"][0].tolist() == [1, *ours.pixel_values.shape[:2]]
            pixels = pixels.view(ours.pixel_values.shape)
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
        tokens = run_to_end(engine, request_id)
        assert tokens == greedy.tolist()


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
    assert_same_processor_as_folder(processor, theirs_processor)
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

    from nanoserve.llm import LLM
    from tests.tiny_vlm import image_bytes, write_text_gguf, write_tiny_llava_mmproj

    out = tmp_path_factory.mktemp("llava-gguf")
    text = write_text_gguf(llava_pair_dir, out)
    mmproj = write_tiny_llava_mmproj(llava_pair_dir, out / "mmproj.gguf")
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128}
    folder = Engine(EngineConfig(model=str(llava_pair_dir), **options))
    pair = Engine(EngineConfig(model=str(text), mmproj=str(mmproj), **options))
    prompts = ["Describe <image> please", "<image> and <image>: which?"]
    images = [[random_image(100, 70, seed=1)], [random_image(20, 33, seed=2), random_image(64, 64, seed=3)]]
    assert_pair_computes_the_folders_bits(pair, folder, prompts, images)

    image = out / "cat.png"
    image.write_bytes(image_bytes(random_image(100, 70, seed=1)))
    (expected,) = LLM(str(llava_pair_dir), **options).generate(
        {"prompt": "<image>What is it?", "multi_modal_data": {"image": image.read_bytes()}},
        SamplingParams(max_tokens=6, temperature=0.0))
    assert_generate_prints(text, mmproj, image, expected.outputs[0].text)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-rope"))


def test_mrope_positions_of_any_chunk_and_of_generated_tokens_equal_transformers_get_rope_index(qwen2_vl_dir):
    """Every slice of a prompt with two images (text before, between and after them) takes the
    positions transformers' get_rope_index gives its tokens, and a generated token at index p
    the position p + its mrope_position_delta on all three axes."""
    from transformers import AutoModelForImageTextToText

    from nanoserve.multimodal.inputs import place_images, rope_positions

    config = read_vision_config(qwen2_vl_dir)
    processor, theirs_of = load_processor(qwen2_vl_dir, config), reference(qwen2_vl_dir)
    images = [random_image(100, 70, seed=1), random_image(20, 33, seed=2)]
    text = f"Compare {processor.placeholder} with {processor.placeholder}, then say which."
    inputs = theirs_of(images=[images], text=[text], return_tensors="pt")
    hf_model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32)
    expected, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                    image_grid_thw=inputs["image_grid_thw"])
    expected, delta = expected[:, 0].tolist(), int(delta)
    ids = inputs["input_ids"][0].tolist()
    processed = [processor.process(image) for image in images]
    placed = place_images(ids, processed, config.image_token_id, "images")
    length = len(ids)
    assert delta < 0  # the images' grids take fewer positions than their tokens
    for start, stop in [(0, length), (0, 5), (3, 40), (40, 41), (30, 90), (60, length), (length - 1, length)]:
        assert rope_positions(placed, start, stop) == [axis[start:stop] for axis in expected], (start, stop)
    assert rope_positions(placed, length, length + 3) == [list(range(length + delta, length + delta + 3))] * 3


def test_an_older_qwen2_vl_config_with_top_level_text_fields_reads_its_mrope_section():
    """Qwen/Qwen2-VL-2B-Instruct's config.json: its text fields at the top level, M-RoPE as
    rope_scaling type "mrope"."""
    from nanoserve.loading.hf_config import read_model_config
    from nanoserve.model.vision_config import VisionConfig, text_config_dict

    raw = {"architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
           "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
           "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 28,
           "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
           "use_cache": True, "use_sliding_window": False,
           "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                             "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
                             "spatial_patch_size": 14, "temporal_patch_size": 2},
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}
    vision = VisionConfig.from_hf_dict(raw)
    assert (vision.hidden_size, vision.intermediate_size, vision.merge_size, vision.image_token_id) == (
        1280, 5120, 2, 151655)
    text = read_model_config(text_config_dict(raw))
    assert (text.mrope_section, text.rope_theta, text.rope_scaling) == ((16, 24, 24), 1e6, None)
    assert text.head_dim == 128
    assert (text.qkv_bias, text.tie_word_embeddings, text.num_kv_heads) == (True, True, 2)


def test_an_older_qwen2_5_vl_config_reads_its_windows_and_merger_width():
    """Qwen/Qwen2.5-VL-3B-Instruct's config.json: top-level text fields, the tower's windows and
    the merger's out_hidden_size (the text width)."""
    from nanoserve.loading.hf_config import read_model_config
    from nanoserve.model.vision_config import VisionConfig, text_config_dict

    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
           "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
           "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
           "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
           "use_cache": True, "use_sliding_window": False,
           "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                             "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                             "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                             "spatial_patch_size": 14, "window_size": 112,
                             "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                             "temporal_patch_size": 2},
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}
    vision = VisionConfig.from_hf_dict(raw)
    assert (vision.family, vision.hidden_size, vision.intermediate_size, vision.text_hidden_size) == (
        "qwen2_5_vl", 1280, 3420, 2048)
    assert (vision.window_size, vision.full_attention_layers) == (112, (7, 15, 23, 31))
    text = read_model_config(text_config_dict(raw))
    assert (text.mrope_section, text.head_dim, text.max_position_embeddings) == ((16, 24, 24), 128, 128000)


def test_a_qwen_mrope_section_that_does_not_cover_the_head_is_refused_naming_it():
    from nanoserve.loading.hf_config import read_model_config
    from nanoserve.model.vision_config import text_config_dict

    raw = {"model_type": "qwen2_vl", "vision_config": {"embed_dim": 32, "num_heads": 4},
           "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
                           "num_key_value_heads": 2,
                           "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 2]}}}
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        read_model_config(text_config_dict(raw))


def test_generated_tokens_rotate_past_the_images_shift_as_transformers_does(qwen2_vl_dir):
    """Decode rows take position p + mrope_position_delta: each generated token's logprob equals
    transformers' over the whole sequence (prompt, images and the tokens before it) within 1e-4.
    (Sampled, so the tokens vary and each row's logits show.)"""
    from transformers import AutoModelForImageTextToText

    from nanoserve.llm import LLM

    processor = load_processor(qwen2_vl_dir, read_vision_config(qwen2_vl_dir))
    images = [random_image(100, 70, seed=1), random_image(20, 33, seed=2)]
    text = f"Compare {processor.placeholder} with {processor.placeholder}, then say which."
    llm = LLM(str(qwen2_vl_dir), device="cpu", dtype="float32", num_kv_blocks=128, kv_cache_dtype="float32")
    prompt = {"prompt": text, "multi_modal_data": {"image": [image_bytes(image) for image in images]}}
    (completion,) = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                                                        ignore_eos=True))
    tokens = completion.outputs[0].token_ids
    inputs = reference(qwen2_vl_dir)(images=[images], text=[text], return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                             torch.zeros(1, len(tokens), dtype=torch.int32)], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    hf_model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = hf_model(**inputs).logits[0, length - 1:-1].log_softmax(-1)
    expected = scores[torch.arange(len(tokens)), torch.tensor(tokens)]
    ours = torch.tensor([entry.logprob for entry in completion.outputs[0].logprobs])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("raw", [
    {"min_pixels": 20 * 20, "max_pixels": 40 * 40},  # the older preprocessor_config.json keys
    {"size": {"shortest_edge": 64 * 64, "longest_edge": 96 * 96}},
    {"size": {"shortest_edge": 8 * 8, "longest_edge": 24 * 24}, "max_pixels": 48 * 48},
])
def test_qwen_pixel_bounds_read_from_either_spelling_as_transformers_reads_them(qwen2_vl_dir, raw):
    from transformers import Qwen2VLImageProcessorPil

    from nanoserve.multimodal.processors import QwenVLProcessor

    options = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}
    ours = QwenVLProcessor.from_config(raw | options, read_vision_config(qwen2_vl_dir))
    theirs = Qwen2VLImageProcessorPil(**raw, **options)
    for image in images_of_every_kind()[:6]:
        processed = ours.process(image)
        expected = theirs(images=[image], return_tensors="pt")
        assert expected["image_grid_thw"][0].tolist() == [1, *processed.pixel_values.shape[:2]], image.size
        pixels = expected["pixel_values"]
        assert torch.equal(processed.pixel_values.reshape(pixels.shape), pixels)


def test_a_qwen_preprocessor_config_for_another_tower_is_refused_naming_the_field(qwen2_vl_dir):
    from nanoserve.multimodal.processors import QwenVLProcessor

    with pytest.raises(UnsupportedModelError, match="'patch_size' = 14"):
        QwenVLProcessor.from_config({"patch_size": 14}, read_vision_config(qwen2_vl_dir))
