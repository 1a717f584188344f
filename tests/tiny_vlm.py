"""Tiny but real Idefics3 (SmolVLM) checkpoints for the vision tests, built by transformers offline.

`write_tiny_idefics3` writes what the loaders read: config.json and random float32 weights saved
by transformers' own `Idefics3ForConditionalGeneration.save_pretrained`, the tiny byte-level BPE
tokenizer of tiny_model.py with Idefics3's image tokens added as special tokens, a ChatML
template, and the image processor's preprocessor_config.json (`Idefics3ImageProcessorPil`).
`reference_processor` is transformers' processor for such a folder.
`write_text_gguf` and the `write_tiny_*_mmproj` writers lay a folder out as llama.cpp's
converters do: its text model as a llama GGUF, its tower and projector as an mmproj GGUF.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken

from tests.tiny_model import BOS_TOKEN, EOS_TOKEN, _tokenizer_config, tiny_tokenizer

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def write_tiny_idefics3(path: str | Path, *, vision_hidden: int = 32, vision_layers: int = 2,
                        vision_heads: int = 4, image_size: int = 32, patch_size: int = 4,
                        scale_factor: int = 2, text_hidden: int = 64,
                        text_layers: int = 2, longest_edge: int = 64, split: bool = True,
                        tie_word_embeddings: bool = False, smolvlm: bool = False, seed: int = 0) -> Path:
    """A complete Idefics3 folder: tiles of `image_size` pixels (the processor's max_image_size),
    images first resized so their longest edge is `longest_edge`."""
    import transformers

    kind = "SmolVLM" if smolvlm else "Idefics3"  # SmolVLM2's classes: the same architecture
    config_class = getattr(transformers, f"{kind}Config")
    model_class = getattr(transformers, f"{kind}ForConditionalGeneration")
    image_processor_class = getattr(transformers, f"{kind}ImageProcessorPil")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_TOKENS])
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    config = config_class(
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=text_hidden,
                         intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=text_hidden // 4,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                         eos_token_id=tokenizer.token_to_id(EOS_TOKEN), pad_token_id=None,
                         tie_word_embeddings=tie_word_embeddings),
        vision_config=dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
                           image_size=image_size, patch_size=patch_size),
        scale_factor=scale_factor, image_token_id=tokenizer.token_to_id("<image>"),
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # norms off their all-ones init, biases off zero: the test can see them
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    tokenizer_config = _tokenizer_config() | {"model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    processor = image_processor_class(size={"longest_edge": longest_edge},
                                          max_image_size={"longest_edge": image_size},
                                          do_image_splitting=split)
    processor.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": rows_per_tile(config)}))
    return path


def write_tiny_llava(path: str | Path, *, vision_hidden: int = 32, vision_layers: int = 3,
                     image_size: int = 28, patch_size: int = 7, shortest_edge: int = 32,
                     strategy: str = "default",
                     feature_layer: int = -2, pad_to_square: bool = False, llama_cpp_f16: bool = False,
                     seed: int = 0) -> Path:
    """A complete LLaVA-1.5-style folder (CLIP tower, MLP projector, Llama text model).
    `llama_cpp_f16`: the patch convolution and the projector's matrices hold float16 values, as
    llama.cpp's LLaVA converter always stores them, so an mmproj written from the folder holds
    the folder's values."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                         eos_token_id=tokenizer.token_to_id(EOS_TOKEN), pad_token_id=None),
        vision_config=dict(model_type="clip_vision_model", hidden_size=vision_hidden,
                           intermediate_size=2 * vision_hidden, num_hidden_layers=vision_layers,
                           num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                           projection_dim=vision_hidden),
        image_token_id=tokenizer.token_to_id("<image>"), vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "class_embedding" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if llama_cpp_f16 and name.endswith(LLAVA_F16_MATRICES):
                param.copy_(param.half().float())
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config() | {"model_max_length": 4096}))
    LlavaImageProcessorPil(size={"shortest_edge": shortest_edge}, do_pad=pad_to_square,
                           crop_size={"height": image_size, "width": image_size}).save_pretrained(path)
    options = {"patch_size": patch_size, "vision_feature_select_strategy": strategy,
               "num_additional_image_tokens": 1}
    (path / "processor_config.json").write_text(json.dumps(options))
    return path


# What llama.cpp's convert_image_encoder_to_gguf.py stores in float16 whatever it is asked for
LLAVA_F16_MATRICES = ("patch_embedding.weight", "linear_1.weight", "linear_2.weight")
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def write_tiny_gemma3(path: str | Path, *, vision_hidden: int = 32, vision_layers: int = 2,
                      image_size: int = 32, patch_size: int = 4, tokens_per_image: int = 16,
                      text_hidden: int = 64, text_layers: int = 3, sliding_window: int = 24,
                      head_dim: int = 16, seed: int = 0) -> Path:
    """A complete Gemma 3 vision-language folder (SigLIP tower, pooled soft tokens, a Gemma 3
    text model whose sliding and full layers alternate; images of `tokens_per_image` rows)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in GEMMA3_TOKENS])
    tokenizer.save(str(path / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in GEMMA3_TOKENS]
    config = Gemma3Config(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=text_hidden,
                         intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
                         num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                         sliding_window=sliding_window, max_position_embeddings=2048,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(text_layers)],
                         bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                         eos_token_id=tokenizer.token_to_id(EOS_TOKEN), pad_token_id=None),
        vision_config=dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_hidden_layers=vision_layers, num_attention_heads=4, image_size=image_size,
                           patch_size=patch_size, vision_use_head=False),
        mm_tokens_per_image=tokens_per_image, boi_token_index=ids[0], image_token_index=ids[1],
        eoi_token_index=ids[2])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms and the projection off their init, biases off zero: the test can see them
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "projection" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config() | {"model_max_length": 4096}))
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": tokens_per_image}))
    return path


def reference_gemma3_processor(path: Path):
    """transformers' Gemma3Processor over the folder's tokenizer (its image tokens named as Gemma's
    tokenizer names them) and image processor."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    names = dict(zip(("boi_token", "image_token", "eoi_token"), GEMMA3_TOKENS, strict=True))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN, extra_special_tokens=names)
    options = json.loads((path / "processor_config.json").read_text())
    return Gemma3Processor(Gemma3ImageProcessorPil.from_pretrained(path), tokenizer, **options)


def reference_llava_processor(path: Path):
    """transformers' LlavaProcessor over the folder's tokenizer and image processor."""
    from transformers import LlavaImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN)
    options = json.loads((path / "processor_config.json").read_text())
    return LlavaProcessor(LlavaImageProcessorPil.from_pretrained(path), tokenizer, **options)


def rows_per_tile(config) -> int:
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2


def reference_processor(path: Path):
    """transformers' Idefics3Processor over the folder's tokenizer and image processor (a SmolVLM2
    folder's own image processor; SmolVLMProcessor's text expansion is Idefics3's, and it needs
    num2words and torchvision, which the tests do not install)."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    smolvlm = json.loads((path / "config.json").read_text())["model_type"] == "smolvlm"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN)
    seq_len = json.loads((path / "processor_config.json").read_text())["image_seq_len"]
    image_processor_class = getattr(transformers, f"{'SmolVLM' if smolvlm else 'Idefics3'}ImageProcessorPil")
    return transformers.Idefics3Processor(image_processor_class.from_pretrained(path), tokenizer,
                                          image_seq_len=seq_len)


def assert_same_processor_as_folder(processor, folder_processor) -> None:
    """An mmproj's processor equals its folder's; the mean and std are float32s in GGUF, so
    theirs must equal the folder's as the float32s the processor normalises with."""
    ours_stats, theirs_stats = processor.normalization, folder_processor.normalization
    stats = dataclasses.replace(ours_stats, mean=theirs_stats.mean, std=theirs_stats.std)
    assert dataclasses.replace(processor, normalization=stats) == folder_processor
    assert np.array_equal(np.float32([ours_stats.mean, ours_stats.std]),
                          np.float32([theirs_stats.mean, theirs_stats.std]))


def run_to_end(engine, request_id: str) -> list[int]:
    """Steps `engine` until nothing is left; the tokens request `request_id` generated."""
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.token_ids
    return tokens


def assert_pair_computes_the_folders_bits(pair, folder, prompts: list[str], images: list[list]) -> None:
    """A GGUF + mmproj pair's engine and its folder's give the same last logits for `prompts` with
    their `images`, and the same 6 greedy tokens for the second prompt."""
    from nanoserve.sampling_params import SamplingParams

    assert torch.equal(pair.prompt_logits(prompts, images), folder.prompt_logits(prompts, images))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [run_to_end(engine, engine.add_request(prompts[1], greedy, images=images[1]))
              for engine in (pair, folder)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def assert_generate_prints(text: Path, mmproj: Path, image: Path, expected: str) -> None:
    """`nanoserve generate "What is it?" --model TEXT --mmproj MMPROJ --image IMAGE` (float32, 6
    tokens) ends its output with `expected`, the folder's completion of the same request."""
    from typer.testing import CliRunner

    from nanoserve_cli.main import app

    args = ["generate", "What is it?", "--model", str(text), "--mmproj", str(mmproj), "--image", str(image),
            "--dtype", "float32", "--max-tokens", "6"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert expected and result.stdout.endswith(expected + "\n")


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_tiny_gguf_pair(vlm_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """An Idefics3 folder as llama.cpp's converter lays it out: the text model as a llama GGUF
    (`write_text_gguf`) and the tower and projector as an mmproj GGUF, float32, its
    tensor names from gguf-py's own map and its metadata from gguf-py's own writer methods."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((vlm_dir / "config.json").read_text())
    vision = raw["vision_config"]
    tensors = load_file(str(vlm_dir / "model.safetensors"))
    text_gguf = write_text_gguf(vlm_dir, out_dir)

    mmproj = out_dir / "mmproj.gguf"
    writer, processor = _siglip_mmproj_writer(mmproj, gguf.VisionProjectorType.IDEFICS3, vlm_dir)
    writer.add_vision_projector_scale_factor(raw["scale_factor"])
    writer.add_vision_preproc_image_size(processor["size"]["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in tensors.items():
        if name.startswith(("model.vision_model.", "model.connector.")):
            stem, kind = name.rsplit(".", 1)
            writer.add_tensor(f"{names.get_name(stem)}.{kind}", tensor.numpy())
    _write_out(writer)
    return text_gguf, mmproj


def _siglip_mmproj_writer(path: Path, projector_type: str, vlm_dir: Path):
    """An mmproj writer holding what llama.cpp's converter writes of a folder's SigLIP tower (its
    shape, the text width it projects to, GELU) and of its processor (mean and std); the family's
    own keys are the caller's. Returns the writer and the processor's config."""
    import gguf

    raw = json.loads((vlm_dir / "config.json").read_text())
    vision = raw["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector_type)
    writer.add_vision_projection_dim(raw["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_use_gelu(True)
    processor = json.loads((vlm_dir / "preprocessor_config.json").read_text())
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    return writer, processor


def _write_out(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A vision-language folder's text tensors (Idefics3's, LLaVA's as transformers 5 and 4 save them)
# under a Llama checkpoint's names.
_TEXT_PREFIXES = (("model.text_model.", "model."), ("language_model.model.", "model."),
                  ("model.language_model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("lm_head.", "lm_head."))


def write_text_gguf(vlm_dir: Path, out_dir: Path, *, without_token: str | None = None) -> Path:
    """The folder's text model as llama.cpp's converter writes it (tiny_model.write_tiny_gguf of
    a Llama folder with its tensors and tokenizer): `out_dir`/text.gguf, float32.
    `without_token`: the base model's vocabulary, which lacks that token (the folder's last, as
    llava-hf's `<image>` is 32000 after Llama's 32,000): the token gone, and with it its row of
    the embedding and output matrices (llava-v1.5-7b's GGUFs: no `<image>`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.tiny_model import write_tiny_gguf

    raw = json.loads((vlm_dir / "config.json").read_text())
    text = raw["text_config"]
    llama_dir = out_dir / "text-hf"
    llama_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(vlm_dir / name, llama_dir / name)
    # A GGUF lists every token, added ones too (the converter's vocabulary is the whole of it).
    tokenizer = json.loads((vlm_dir / "tokenizer.json").read_text())
    if without_token is not None:
        (dropped,) = [added for added in tokenizer["added_tokens"] if added["content"] == without_token]
        assert dropped["id"] == text["vocab_size"] - 1, "only the last id leaves the others' ids as they are"
        tokenizer["added_tokens"].remove(dropped)
        text = text | {"vocab_size": text["vocab_size"] - 1}
    tokenizer["model"]["vocab"] |= {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    (llama_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
            "eos_token_id")
    llama = {key: text[key] for key in keys} | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": None,
        "rope_theta": text["rope_parameters"]["rope_theta"],
        "tie_word_embeddings": raw["tie_word_embeddings"]}
    (llama_dir / "config.json").write_text(json.dumps(llama))
    renamed = {}
    for name, tensor in load_file(str(vlm_dir / "model.safetensors")).items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                by_token = new + name[len(old):] in ("model.embed_tokens.weight", "lm_head.weight")
                renamed[new + name[len(old):]] = tensor[:text["vocab_size"]] if by_token else tensor
                break
    save_file(renamed, str(llama_dir / "model.safetensors"))
    return write_tiny_gguf(out_dir / "text.gguf", llama_dir)


def _legacy_clip_name(name: str) -> str:
    """convert_image_encoder_to_gguf.py's `get_tensor_name` for a CLIP tower's tensor (its
    `vision_model.` names): fc1 becomes `ffn_down` and fc2 `ffn_up`, the names swapped as that
    script swaps them."""
    for old, new in (("vision_model", "v"), ("encoder.layers", "blk"), ("embeddings.", ""), ("_proj", ""),
                     ("self_attn.", "attn_"), ("layer_norm", "ln"), ("layernorm", "ln"),
                     ("mlp.fc1", "ffn_down"), ("mlp.fc2", "ffn_up"), ("embedding", "embd"), ("final", "post"),
                     ("layrnorm", "ln")):
        name = name.replace(old, new)
    return name


def write_tiny_llava_mmproj(vlm_dir: Path, path: Path, *, state_feature_layer: bool = True,
                            state_projector_type: bool = True, extra_keys=None) -> Path:
    """A LLaVA folder's tower and projector as llama.cpp's convert_image_encoder_to_gguf.py writes
    them (`--use-f32 --llava-projector`; its LLaVA models go through no other converter): the
    projector's `multi_modal_projector.linear_1/2` as `mm.0` / `mm.2`, their matrices and the patch
    convolution in float16 (4-D), everything else float32 under the script's own names (fc1/fc2
    swapped), no post-layernorm, CLIP's projection_dim as `projection_dim`, and the layers kept up
    to the one read: with `state_feature_layer`, `clip.vision.feature_layer` (non-negative) and
    that many blocks (the script's path when the folder's config names `vision_feature_layer`),
    else the tower less its last block and no feature layer (the path for a CLIP folder).
    `state_projector_type=False`: a 2023 file, `clip.has_llava_projector` alone.
    `extra_keys(writer)` adds metadata (a file the reader must refuse)."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((vlm_dir / "config.json").read_text())
    vision = raw["vision_config"]
    depth = vision["num_hidden_layers"]
    feature_layer = raw["vision_feature_layer"] % (depth + 1)  # the script's to_non_negative
    kept = feature_layer if state_feature_layer else depth - 1
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_file_type(0)
    if state_projector_type:
        writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.projection_dim", vision["projection_dim"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    writer.add_uint32("clip.vision.block_count", kept)
    if state_feature_layer:
        writer.add_array("clip.vision.feature_layer", [feature_layer])
    processor = json.loads((vlm_dir / "preprocessor_config.json").read_text())
    writer.add_array("clip.vision.image_mean", processor["image_mean"])
    writer.add_array("clip.vision.image_std", processor["image_std"])
    writer.add_bool("clip.use_gelu", vision["hidden_act"] == "gelu")
    if extra_keys is not None:
        extra_keys(writer)
    tensors = load_file(str(vlm_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.startswith("multi_modal_projector."):
            stem = name.replace("multi_modal_projector", "mm").replace("linear_1", "0")
            stem = stem.replace("linear_2", "2")
            writer.add_tensor(stem, tensor.numpy().astype(np.float16 if tensor.dim() == 2 else np.float32))
    for name, tensor in tensors.items():
        name = name.replace("vision_tower.", "vision_model.", 1)
        parts = name.split(".")
        if (not name.startswith("vision_model.") or "post_layernorm" in name
                or (parts[1:3] == ["encoder", "layers"] and int(parts[3]) >= kept)):
            continue
        writer.add_tensor(_legacy_clip_name(name),
                          tensor.numpy().astype(np.float16 if tensor.dim() == 4 else np.float32))
    _write_out(writer)
    return path


def write_tiny_gemma3_mmproj(vlm_dir: Path, path: Path) -> Path:
    """A Gemma 3 folder's tower and projector as llama.cpp's converter writes its mmproj GGUF
    (float32): gguf-py's tensor names (under the `vision_tower.vision_model.` spelling its map
    knows), the soft-token norm stored as 1 + w, the pooling kernel as projector.scale_factor
    where it is not llama.cpp's default 4."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((vlm_dir / "config.json").read_text())
    vision = raw["vision_config"]
    grid = vision["image_size"] // vision["patch_size"]
    kernel = grid // math.isqrt(raw["mm_tokens_per_image"])
    writer, _ = _siglip_mmproj_writer(path, gguf.VisionProjectorType.GEMMA3, vlm_dir)
    if kernel != 4:
        writer.add_vision_projector_scale_factor(kernel)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in load_file(str(vlm_dir / "model.safetensors")).items():
        name = name.replace("model.", "", 1) if name.startswith("model.") else name
        if name == "multi_modal_projector.mm_input_projection_weight":
            name = "multi_modal_projector.mm_input_projection.weight"
        elif name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        stem, kind = name.rsplit(".", 1)
        values = tensor + 1 if stem.endswith("mm_soft_emb_norm") else tensor
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", values.numpy())
    _write_out(writer)
    return path


QWEN_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def write_tiny_qwen2_vl(path: str | Path, *, qwen2_5: bool = False, vision_hidden: int = 32,
                        vision_layers: int = 2, patch_size: int = 4, text_hidden: int = 64,
                        text_layers: int = 2,
                        mrope_section: tuple[int, int, int] = (2, 3, 3), max_pixels: int = 64 * 64,
                        window_size: int = 16, full_attention_layers: tuple[int, ...] = (1,),
                        seed: int = 0) -> Path:
    """A complete Qwen2-VL (or Qwen2.5-VL: RMSNorm, SwiGLU, windows of `window_size` pixels on
    all blocks but `full_attention_layers`) folder: 2x2 patch merge, a Qwen2 text model with
    M-RoPE (`mrope_section` summing to its head_dim / 2), images resized within `max_pixels`."""
    import transformers

    kind = "Qwen2_5_VL" if qwen2_5 else "Qwen2VL"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_VL_TOKENS])
    tokenizer.save(str(path / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in QWEN_VL_TOKENS]
    vision = dict(depth=vision_layers, num_heads=4, patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2)
    if qwen2_5:
        vision |= dict(hidden_size=vision_hidden, intermediate_size=3 * vision_hidden // 2,
                       out_hidden_size=text_hidden, window_size=window_size,
                       fullatt_block_indexes=list(full_attention_layers))
    else:
        vision |= dict(embed_dim=vision_hidden, hidden_size=text_hidden, mlp_ratio=2)
    config = getattr(transformers, f"{kind}Config")(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=text_hidden,
                         intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "mrope_section": list(mrope_section),
                                          "rope_theta": 10000.0},
                         bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
                         eos_token_id=tokenizer.token_to_id(EOS_TOKEN), pad_token_id=None),
        vision_config=vision, image_token_id=ids[1], video_token_id=ids[3], vision_start_token_id=ids[0],
        vision_end_token_id=ids[2])
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # norms off their all-ones init, biases off zero: the test can see them
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config() | {"model_max_length": 4096}))
    transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 4 * (2 * patch_size) ** 2,
                                                "longest_edge": max_pixels},
                                          patch_size=patch_size, merge_size=2, temporal_patch_size=2
                                          ).save_pretrained(path)
    return path


def reference_qwen2_vl_processor(path: Path):
    """transformers' Qwen2VLProcessor over the folder's tokenizer and image processor (without its
    video processor, which needs torchvision, which the tests do not install)."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN)
    return ImagesOnly(Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer)


def write_qwen_vl_text_gguf(vlm_dir: Path, out_dir: Path) -> Path:
    """A Qwen2-VL / Qwen2.5-VL folder's text model as llama.cpp's converter (Qwen2VLModel) writes
    it: architecture `qwen2vl`, its M-RoPE section padded to four as `rope.dimension_sections`,
    gguf-py's tensor names for the architecture (Q and K rows as Hugging Face keeps them: only
    llama's are permuted), float32. `out_dir`/text.gguf."""
    import gguf
    from safetensors.torch import load_file

    from tests.tiny_model import _add_tokenizer

    raw = json.loads((vlm_dir / "config.json").read_text())
    text = raw["text_config"]
    rope = text["rope_parameters"]
    tokenizer_dir = out_dir / "text-tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    # A GGUF lists every token, added ones too (the converter's vocabulary is the whole of it).
    tokenizer = json.loads((vlm_dir / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] |= {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    (tokenizer_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tokenizer_dir / "tokenizer_config.json").write_text((vlm_dir / "tokenizer_config.json").read_text())

    path = out_dir / "text.gguf"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    _add_tokenizer(writer, tokenizer_dir, text, "gpt2", "smollm")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, text["num_hidden_layers"])
    for name, tensor in load_file(str(vlm_dir / "model.safetensors")).items():
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith(("visual.", "model.visual.")):
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    _write_out(writer)
    return path


def write_tiny_qwen_vl_mmproj(vlm_dir: Path, path: Path, *, skip=(), extra_keys=None) -> Path:
    """A Qwen2-VL / Qwen2.5-VL folder's tower and merger as llama.cpp's convert_hf_to_gguf.py
    (Qwen2VLVisionModel, `--mmproj --outtype f32`) writes them: projector type `qwen2vl_merger` or
    `qwen2.5vl_merger`; Qwen2-VL's embed_dim as the embedding length and its vision hidden_size
    (the merger's output) as feed_forward_length, as the converter renames them; the text width
    as projection_dim; image_size 560 where the config names none; the text's rms_norm_eps from
    the top level of config.json (else 1e-6) as the tower's epsilon; Qwen2.5-VL's use_silu and
    n_wa_pattern (fullatt_block_indexes[0] + 1, the indexes checked to be that pattern), and no
    window size, spatial merge or pixel bounds (clip.cpp keeps those in code). Tensors: q, k, v
    split out of qkv, the Conv3d split into `v.patch_embd.weight` and `.weight.1` (its two
    frames), the rest under gguf-py's map. `skip`: metadata keys or tensors left out;
    `extra_keys(writer)` adds metadata."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((vlm_dir / "config.json").read_text())
    vision = dict(raw["vision_config"])
    qwen2_5 = raw["model_type"] == "qwen2_5_vl"
    if "embed_dim" in vision:  # the converter's renaming of Qwen2-VL's config
        vision["intermediate_size"], vision["hidden_size"] = vision["hidden_size"], vision["embed_dim"]
    processor = json.loads((vlm_dir / "preprocessor_config.json").read_text())

    class Writer(gguf.GGUFWriter):
        def add_key_value(self, key, val, vtype, sub_type=None):
            if key not in skip:
                super().add_key_value(key, val, vtype, sub_type)

    writer = Writer(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(raw["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision.get("image_size", 560))
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    if qwen2_5:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        writer.add_vision_use_silu(True)
        full = vision["fullatt_block_indexes"]
        pattern = full[0] + 1
        assert all(b - a == pattern for a, b in itertools.pairwise(full)), full
        writer.add_vision_n_wa_pattern(pattern)
    else:
        writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    writer.add_vision_attention_layernorm_eps(raw.get("rms_norm_eps", 1e-6))
    if extra_keys is not None:
        extra_keys(writer)
    # The converter's map covers `depth` numbered modules: the merger's mlp.2 needs a depth of 3.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    out = {}
    for name, tensor in load_file(str(vlm_dir / "model.safetensors")).items():
        name = name.replace("model.visual.", "visual.", 1)
        if not name.startswith("visual."):
            continue
        if ".qkv." in name:
            for part, rows in zip("qkv", tensor.chunk(3), strict=True):
                stem, kind = name.replace("qkv", part).rsplit(".", 1)
                out[f"{names.get_name(stem)}.{kind}"] = rows
        elif "patch_embed.proj.weight" in name:
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = tensor[:, :, 0], tensor[:, :, 1]
        else:
            stem, kind = name.rsplit(".", 1)
            assert names.get_name(stem) is not None, f"the converter cannot map {name}"
            out[f"{names.get_name(stem)}.{kind}"] = tensor
    for name, tensor in out.items():
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
    _write_out(writer)
    return path
