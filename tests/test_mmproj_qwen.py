"""Qwen2-VL and Qwen2.5-VL as llama.cpp lays them out: a `qwen2vl` text GGUF and a
`qwen2vl_merger` / `qwen2.5vl_merger` mmproj GGUF, written from tiny random transformers
checkpoints as llama.cpp's convert_hf_to_gguf.py writes them (tests/tiny_vlm.py), against the
Hugging Face folder they came from (itself held to transformers in test_vision.py): the same
vision config, processor, pixel values, image rows, logits and greedy tokens, bit for bit."""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.core import Engine
from nanoserve.errors import UnsupportedModelError
from nanoserve.loading.mmproj import QWEN_MAX_ROWS_DEFAULT, read_mmproj
from nanoserve.loading.vision import image_encoder, load_image_encoder, read_vision_config
from nanoserve.multimodal.processors import PROCESSORS, load_processor
from nanoserve.sampling_params import SamplingParams
from tests.tiny_vlm import (
    QWEN_VL_TOKENS,
    assert_generate_prints,
    assert_pair_computes_the_folders_bits,
    assert_same_processor_as_folder,
    random_image,
    write_qwen_vl_text_gguf,
    write_tiny_qwen2_vl,
    write_tiny_qwen_vl_mmproj,
)

pytest.importorskip("transformers")


def _sizes(patch_size: int, **options) -> dict:
    # The folder's max_pixels: the bound an mmproj implies (Qwen's published 16384 merged rows), so
    # the two processors are one; the folder's min_pixels (4 rows) is that bound already.
    return dict(patch_size=patch_size, max_pixels=QWEN_MAX_ROWS_DEFAULT * (2 * patch_size) ** 2, **options)


PAIR_SIZES = {
    "qwen2-vl": _sizes(4, vision_layers=3),  # the converter maps the merger's mlp.2 from 3 blocks up
    # Its MLP (48 * mlp_ratio 2 = 96) is not the width the converter writes as feed_forward_length (64).
    "qwen2-vl-mlp-wider-than-text": _sizes(6, vision_hidden=48, vision_layers=3, text_hidden=64, seed=1),
    # Windows of clip.cpp's 112 pixels (4 x 4 merged patches of 14): a 200 x 150 image is 2 x 2
    # windows, the last row and column ragged; the file states no window size.
    "qwen2.5-vl": _sizes(14, qwen2_5=True, vision_layers=3, window_size=112, full_attention_layers=(1,),
                         seed=2),
    "qwen2.5-vl-every-third-block-full": _sizes(14, qwen2_5=True, vision_layers=4, window_size=112,
                                                full_attention_layers=(2,), text_layers=3,
                                                mrope_section=(4, 2, 2), seed=3),
}
IMAGES = [(200, 150), (60, 44), (29, 90), (16, 16)]
OPTIONS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, "kv_cache_dtype": "float32"}


@pytest.fixture(scope="module", params=sorted(PAIR_SIZES))
def qwen_pair(request, tmp_path_factory):
    """(folder, text GGUF, mmproj GGUF)."""
    folder = write_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), **PAIR_SIZES[request.param])
    out = tmp_path_factory.mktemp(request.param + "-gguf")
    mmproj = write_tiny_qwen_vl_mmproj(folder, out / "mmproj.gguf")
    return folder, write_qwen_vl_text_gguf(folder, out), mmproj


def _vocabulary(folder) -> dict[str, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return {token: tokenizer.token_to_id(token) for token in QWEN_VL_TOKENS}


def test_a_qwen_mmproj_reads_into_the_folders_config_processor_pixels_and_image_rows(qwen_pair):
    folder_dir, _, mmproj = qwen_pair
    folder = read_vision_config(folder_dir)
    config, weights, fields = read_mmproj(mmproj, _vocabulary(folder_dir).get)
    assert config == folder
    processor, theirs_processor = PROCESSORS[config.family].from_config(fields, config), load_processor(
        folder_dir, folder)
    assert_same_processor_as_folder(processor, theirs_processor)
    ours = image_encoder(config, weights)
    theirs = load_image_encoder(folder_dir, folder, dtype=torch.float32, device=torch.device("cpu"))
    for i, (width, height) in enumerate(IMAGES):
        image = random_image(width, height, seed=i)
        pixels = processor.process(image).pixel_values
        assert torch.equal(pixels, theirs_processor.process(image).pixel_values), image.size
        assert torch.equal(ours.encode(pixels), theirs.encode(pixels)), image.size


def test_a_qwen_gguf_and_mmproj_pair_gives_the_folders_logits_and_greedy_tokens(qwen_pair):
    """Through the engine: the text GGUF's M-RoPE (rope.dimension_sections) and the mmproj's image
    rows give the folder's last logits and greedy tokens with images in the prompt."""
    folder_dir, text, mmproj = qwen_pair
    folder = Engine(EngineConfig(model=str(folder_dir), **OPTIONS))
    pair = Engine(EngineConfig(model=str(text), mmproj=str(mmproj), **OPTIONS))
    assert pair.model_config.mrope_section == folder.model_config.mrope_section
    image = pair.images.processor.placeholder
    prompts = [f"Describe {image} please", f"{image} and {image}: which?"]
    images = [[random_image(200, 150, seed=1)], [random_image(29, 90, seed=2), random_image(60, 44, seed=3)]]
    assert_pair_computes_the_folders_bits(pair, folder, prompts, images)


@pytest.fixture(scope="module")
def qwen2_5_dir(tmp_path_factory):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2.5-refusals"),
                               **PAIR_SIZES["qwen2.5-vl"])


QWEN_MMPROJ_REFUSALS = {
    "no-window-pattern": (dict(skip=("clip.vision.n_wa_pattern",)), "clip.vision.n_wa_pattern"),
    "no-head-count": (dict(skip=("clip.vision.attention.head_count",)), "clip.vision.attention.head_count"),
    "a-missing-key-projection": (dict(skip=("v.blk.1.attn_k.bias",)), "v.blk.1.attn_k.bias"),
    "one-frame-of-the-patch-convolution": (dict(skip=("v.patch_embd.weight.1",)), "v.patch_embd.weight.1"),
    "a-window-of-part-of-a-merged-patch": (
        dict(extra_keys=lambda w: w.add_vision_window_size(100)), "clip.vision.window_size"),
    "another-merger": (dict(extra_keys=lambda w: w.add_clip_projector_type("qwen3vl_merger")),
                       "qwen3vl_merger"),
}


@pytest.mark.parametrize(("layout", "named"), list(QWEN_MMPROJ_REFUSALS.values()),
                         ids=list(QWEN_MMPROJ_REFUSALS))
def test_a_qwen_mmproj_that_lacks_a_key_or_tensor_is_refused_naming_the_file_and_it(layout, named,
                                                                                     qwen2_5_dir, tmp_path):
    mmproj = write_tiny_qwen_vl_mmproj(qwen2_5_dir, tmp_path / "broken-mmproj.gguf", **layout)
    with pytest.raises(UnsupportedModelError, match=r"broken-mmproj\.gguf") as error:
        read_mmproj(mmproj, _vocabulary(qwen2_5_dir).get)
    assert named in str(error.value)


def test_a_text_model_without_qwens_image_token_is_refused_naming_it(qwen2_5_dir, tmp_path):
    mmproj = write_tiny_qwen_vl_mmproj(qwen2_5_dir, tmp_path / "mmproj.gguf")
    with pytest.raises(UnsupportedModelError, match=r"<\|image_pad\|>"):
        read_mmproj(mmproj, {}.get)


def test_the_pair_through_generate_prints_the_folders_text(tmp_path_factory):
    """`nanoserve generate --model TEXT.gguf --mmproj MMPROJ.gguf --image IMG` prints what the
    folder generates for the same image (its placeholder put before the prompt)."""

    from nanoserve.llm import LLM
    from tests.tiny_vlm import image_bytes

    folder = write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-cli"), **PAIR_SIZES["qwen2-vl"])
    out = tmp_path_factory.mktemp("qwen2-vl-cli-gguf")
    text = write_qwen_vl_text_gguf(folder, out)
    mmproj = write_tiny_qwen_vl_mmproj(folder, out / "mmproj.gguf")
    image = out / "cat.png"
    image.write_bytes(image_bytes(random_image(60, 44, seed=1)))
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=128)
    (expected,) = llm.generate({"prompt": llm.engine.images.processor.placeholder + "What is it?",
                                "multi_modal_data": {"image": image.read_bytes()}},
                               SamplingParams(max_tokens=6, temperature=0.0))
    assert_generate_prints(text, mmproj, image, expected.outputs[0].text)
