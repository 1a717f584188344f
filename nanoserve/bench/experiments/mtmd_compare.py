"""nanoserve against llama.cpp's `llama-mtmd-cli` on one image: encode time and time to first token.

Owns: the files compared, written once under the anchors cache (`../shared/anchors/llamacpp-bench`
builds llama.cpp there): a GGUF text model + `mmproj` GGUF pair of SmolVLM-256M-Instruct's
published shape, laid out as llama.cpp's converter writes one (the text model is the default
model's own Q4_1 GGUF, SmolLM2-135M, with SmolVLM's image tokens added to its vocabulary up to
SmolVLM's 49280; the tower is SigLIP base patch16 at 512 px with random weights, float16 as the
converter writes by default or float32 (`--mmproj-type`), the embeddings float32 as it forces
them, and the idefics3 projector with scale factor 4 into the text model's 576), and a
synthesized PNG; the turns (the CLI and one nanoserve process one after the other, the order
swapped every turn, both on `--threads`); and a CSV of every turn's figures and their ratios,
with the medians and the machine in every row.
Figures, per engine: the image's encode time (llama.cpp: its own "mtmd batch encoding done"
lines summed over the image's tiles; nanoserve: the engine's encoder over the processed tiles,
after a warm-up request) and the time to first token of one request with the image, from its
image file's bytes to the first sampled token (llama.cpp: its log's timestamps, from the line
printed once both models are loaded to its perf summary, less the sampled token's decode;
nanoserve: one `LLM.generate` with `max_tokens=1`, after a warm-up request with another image
of the same size, as llama.cpp warms up at load). The tile counts and prompt lengths each
engine used are in every row.
Refuses: running without the anchor's `llama-mtmd-cli` (run the anchor script first), and
options it does not know (exit 2 naming them).

    python -m nanoserve.bench.experiments.mtmd_compare --turns 3
    python -m nanoserve.bench.experiments.mtmd_compare --image-size 1024x768 --out results/mtmd_1024.csv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np

from nanoserve import openmp
from nanoserve.bench.experiments import side_by_side
from nanoserve.bench.experiments.llamacpp_compare import Anchors, default_gguf

# SmolVLM-256M-Instruct's published shape (config.json, preprocessor_config.json)
VISION_SHAPE = {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "image_size": 512, "patch_size": 16}
SCALE_FACTOR = 4
LONGEST_EDGE = 2048  # the processor's "size": images are resized to this longest edge, then tiled
TEXT_VOCAB = 49280
TEXT_HIDDEN = 576  # SmolLM2-135M's: the projector's output
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]
# The tokens the idefics3 prompts spell (llama.cpp's mtmd looks them up by their text)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
PAIR_DIR = "smolvlm-256m-shape"
# --mmproj-type: the file type llama.cpp's converter records, and the matrices' dtype
MMPROJ_TYPES = {"f16": ("MOSTLY_F16", np.float16), "f32": ("ALL_F32", np.float32)}
PROMPT = "Describe this image."


def write_pair(cache: Path, longest_edge: int = LONGEST_EDGE, mmproj_type: str = "f16") -> tuple[Path, Path]:
    """The text and mmproj GGUFs under `cache`, written the first time; `longest_edge` is the
    mmproj's preprocessor size (`clip.vision.preproc_image_size`), which both engines read, and
    `mmproj_type` its matrices' type (a key of `MMPROJ_TYPES`)."""
    folder = cache / PAIR_DIR
    text, mmproj = folder / "text.Q4_1.gguf", folder / f"mmproj.{mmproj_type}.edge{longest_edge}.gguf"
    folder.mkdir(parents=True, exist_ok=True)
    if not text.is_file():
        write_text(default_gguf(), text)
    if not mmproj.is_file():
        write_mmproj(mmproj, longest_edge, mmproj_type=mmproj_type)
    return text, mmproj


def write_text(source: Path, target: Path) -> None:
    """`source` with SmolVLM's image tokens (control tokens, as the converter writes special added
    tokens) and reserved ones appended to its vocabulary, their embedding rows copies of the first
    rows (the matrix keeps its quantization: rows are whole blocks)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, TokenType

    reader = GGUFReader(str(source))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    added = IMAGE_TOKENS + [f"<|reserved_{i}|>" for i in range(TEXT_VOCAB - len(tokens) - len(IMAGE_TOKENS))]
    writer = GGUFWriter(str(target) + ".part", "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = tokens + added
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [TokenType.CONTROL] * len(added)
        elif key == "llama.vocab_size":
            value = TEXT_VOCAB
        kind = field.types[0]
        sub_type = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "token_embd.weight":
            data = np.concatenate([data, data[:len(added)]])
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    _finish(writer, target)


def write_mmproj(target: Path, longest_edge: int, shape: dict[str, int] = VISION_SHAPE,
                 mmproj_type: str = "f16") -> None:
    """A SigLIP tower of `shape` (SigLIP base patch16 at 512 px) and the idefics3 projector,
    random weights, with the metadata and tensor names of llama.cpp's converter
    (conversion/smolvlm.py), its matrices of `mmproj_type` (the converter's default: f16)."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, ffn, text_hidden = shape["hidden"], shape["ffn"], TEXT_HIDDEN
    positions = (shape["image_size"] // shape["patch_size"]) ** 2
    writer = gguf.GGUFWriter(str(target) + ".part", "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    file_type, matrix_dtype = MMPROJ_TYPES[mmproj_type]
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text_hidden)
    writer.add_vision_image_size(shape["image_size"])
    writer.add_vision_patch_size(shape["patch_size"])
    writer.add_vision_embedding_length(hidden)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(shape["layers"])
    writer.add_vision_head_count(shape["heads"])
    writer.add_vision_image_mean(IMAGE_MEAN)
    writer.add_vision_image_std(IMAGE_STD)
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_projector_scale_factor(SCALE_FACTOR)
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(longest_edge)

    def matrix(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(matrix_dtype)

    def norm(name: str) -> None:
        writer.add_tensor(f"{name}.weight", 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32))
        writer.add_tensor(f"{name}.bias", 0.1 * rng.standard_normal(hidden, dtype=np.float32))

    def linear(name: str, rows: int, cols: int, bias: bool = True) -> None:
        writer.add_tensor(f"{name}.weight", matrix(rows, cols))
        if bias:
            writer.add_tensor(f"{name}.bias", 0.02 * rng.standard_normal(rows, dtype=np.float32))

    patch = shape["patch_size"]
    writer.add_tensor("v.patch_embd.weight", matrix(hidden, 3, patch, patch).astype(np.float32))
    writer.add_tensor("v.patch_embd.bias", 0.02 * rng.standard_normal(hidden, dtype=np.float32))
    writer.add_tensor("v.position_embd.weight", matrix(positions, hidden).astype(np.float32))
    for layer in range(shape["layers"]):
        block = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            linear(f"{block}.{name}", hidden, hidden)
        norm(f"{block}.ln1")
        norm(f"{block}.ln2")
        linear(f"{block}.ffn_up", ffn, hidden)
        linear(f"{block}.ffn_down", hidden, ffn)
    norm("v.post_ln")
    linear("mm.model.fc", text_hidden, hidden * SCALE_FACTOR ** 2, bias=False)
    _finish(writer, target)


def _finish(writer, target: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(target) + ".part").replace(target)


def write_image(folder: Path, width: int, height: int, seed: int = 0) -> Path:
    """A PNG of `width` x `height` (smooth gradients under noise, as a photo compresses),
    written the first time; another `seed` is another image of the same size."""
    from PIL import Image

    path = folder / f"image-{width}x{height}-{seed}.png"
    if not path.is_file():
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        rng = np.random.default_rng(seed)
        phase = rng.uniform(0, 2 * np.pi, 3)
        channels = [127 + 100 * np.sin(x / width * (3 + i) + y / height * (2 + i) + phase[i])
                    for i in range(3)]
        pixels = np.stack(channels, axis=-1) + rng.normal(0, 12, (height, width, 3))
        partial = path.with_suffix(".part.png")
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(partial)
        partial.replace(path)
    return path


# llama-mtmd-cli's log lines, with --log-timestamps ("M.SS.mmm.uuu" since start)
_STAMP = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w "
_LOADED = re.compile(_STAMP + r"WARN: This is an experimental CLI", re.M)
_BATCH = re.compile(r"encoding mtmd batch, n_chunks = (\d+)")
_ENCODED = re.compile(r"mtmd batch encoding done in (\d+) ms")
_DECODED = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")
_PERF = re.compile(_STAMP + r"llama_perf_context_print:", re.M)
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def _stamp_ms(match: re.Match) -> float:
    minutes, seconds, millis, micros = (int(g) for g in match.groups()[:4])
    return (minutes * 60 + seconds) * 1000 + millis + micros / 1000


def parse_mtmd_log(log: str) -> dict[str, float]:
    """llama-mtmd-cli's own figures from its log (`--log-timestamps -v`, one image, `-n 1`): the
    image's tiles and encode time (its batch-encoding lines summed), the image embeddings'
    decode time, its prompt eval, and the time to first token: from the line printed once both
    models are loaded to the perf summary printed after the first token, less that token's own
    decode (the CLI decodes each sampled token before it stops)."""
    loaded, perf = _LOADED.search(log), _PERF.search(log)
    prompt_eval, token_eval = _PROMPT_EVAL.search(log), _EVAL.search(log)
    encodes = [int(m) for m in _ENCODED.findall(log)]
    if loaded is None or perf is None or prompt_eval is None or not encodes:
        raise ValueError("llama-mtmd-cli's log lacks its load, encode or perf lines (run it with "
                         "--log-timestamps -v):\n" + log[-2000:])
    sampled_decode_ms = float(token_eval.group(1)) if token_eval is not None else 0.0
    return {"tiles": sum(int(n) for n in _BATCH.findall(log)), "encode_ms": float(sum(encodes)),
            "image_decode_ms": float(sum(int(m) for m in _DECODED.findall(log))),
            "prompt_eval_ms": float(prompt_eval.group(1)), "prompt_tokens": int(prompt_eval.group(2)),
            "ttft_ms": _stamp_ms(perf) - _stamp_ms(loaded) - sampled_decode_ms}


def llama_cpp(text: Path, mmproj: Path, image: Path, threads: int, anchors: Anchors) -> dict[str, float]:
    """One llama-mtmd-cli run: the image with the prompt, one greedy token; the prompt rendered by
    the GGUF's own chat template (`--jinja`, as nanoserve renders it: the same prompt tokens)."""
    command = [str(anchors.tool("llama-mtmd-cli")), "-m", str(text), "--mmproj", str(mmproj),
               "--image", str(image), "-p", PROMPT, "-n", "1", "--temp", "0", "-t", str(threads),
               "--jinja", "--log-timestamps", "-v"]
    done = subprocess.run(command, capture_output=True, text=True, env=openmp.foreign_environment())
    if done.returncode != 0:
        raise RuntimeError(f"llama-mtmd-cli failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return parse_mtmd_log(done.stdout + done.stderr)


_NANOSERVE_TURN = """
import json, sys
from pathlib import Path
from nanoserve.bench.experiments.mtmd_compare import nanoserve_turn
print(json.dumps(nanoserve_turn(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]),
                                int(sys.argv[5]))))
"""


def nanoserve(text: Path, mmproj: Path, image: Path, warm_image: Path, threads: int) -> dict[str, float]:
    """`nanoserve_turn` in its own process (a fresh engine, as each CLI run is)."""
    command = [sys.executable, "-c", _NANOSERVE_TURN, str(text), str(mmproj), str(image), str(warm_image),
               str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the nanoserve turn failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def nanoserve_turn(text: Path, mmproj: Path, image: Path, warm_image: Path, threads: int) -> dict[str, float]:
    """The engine on the pair (`--dtype auto`: the text model in its own quantization, the tower
    float32), a warm-up request with `warm_image`, then: the time to first token of one request
    with `image` (its file's bytes in, prefix caching off so the warm-up's prompt is not reused),
    and the encoder's time over that image's processed tiles."""
    import time

    from nanoserve.llm import LLM
    from nanoserve.multimodal.images import decode_image
    from nanoserve.sampling_params import SamplingParams

    llm = LLM(str(text), mmproj=str(mmproj), device="cpu", threads=threads, enable_prefix_caching=False)
    images = llm.engine.images
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": images.processor.placeholder + PROMPT}])
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": warm_image.read_bytes()}}, one_token)
    data = image.read_bytes()
    start = time.perf_counter()
    done = llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}}, one_token)[0]
    ttft_s = time.perf_counter() - start
    pixels = images.processor.process(decode_image(data, "image")).pixel_values
    start = time.perf_counter()
    images.encoder.encode(pixels.to(images.device))
    encode_s = time.perf_counter() - start
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    return {"tiles": int(pixels.shape[0]), "encode_ms": 1000 * encode_s, "ttft_ms": 1000 * ttft_s,
            "prompt_tokens": len(done.prompt_token_ids), "dtype": dtype,
            "linear_kernel": llm.engine.kernel_choice.kernel.name}


def turn_row(turn: int, ours: dict[str, float], theirs: dict[str, float]) -> dict[str, object]:
    """One turn's figures side by side; a ratio above 1 is nanoserve faster."""
    return {"turn": turn, "nanoserve_tiles": ours["tiles"], "llamacpp_tiles": theirs["tiles"],
            "nanoserve_prompt_tokens": ours["prompt_tokens"],
            "llamacpp_prompt_tokens": theirs["prompt_tokens"],
            "nanoserve_encode_ms": round(ours["encode_ms"], 1), "llamacpp_encode_ms": theirs["encode_ms"],
            "encode_speedup": round(theirs["encode_ms"] / ours["encode_ms"], 3),
            "nanoserve_ttft_ms": round(ours["ttft_ms"], 1), "llamacpp_ttft_ms": round(theirs["ttft_ms"], 1),
            "ttft_speedup": round(theirs["ttft_ms"] / ours["ttft_ms"], 3),
            "llamacpp_image_decode_ms": theirs["image_decode_ms"],
            "llamacpp_prompt_eval_ms": theirs["prompt_eval_ms"], "nanoserve_dtype": ours["dtype"],
            "nanoserve_linear_kernel": ours["linear_kernel"], "load_avg_1m": round(os.getloadavg()[0], 2)}


def machine_columns(threads: int, image_size: tuple[int, int], longest_edge: int,
                    mmproj_type: str = "f16") -> dict[str, object]:
    """The columns every row carries: the machine and the run's settings."""
    settings = {"threads": threads, "image_size": "x".join(map(str, image_size)),
                "longest_edge": longest_edge, "mmproj_type": mmproj_type}
    return side_by_side.machine_columns() | settings


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"both sides must be >= 1, got {text!r}")
    return width, height


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.experiments.mtmd_compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-size", type=_size, default=(512, 512), help="WIDTHxHEIGHT of the PNG")
    parser.add_argument("--longest-edge", type=int, default=LONGEST_EDGE,
                        help="the mmproj's preprocessor size: images are resized to this longest edge, "
                             "then tiled (SmolVLM-256M's processor: 2048)")
    parser.add_argument("--mmproj-type", choices=sorted(MMPROJ_TYPES), default="f16",
                        help="the mmproj's matrices (f16: llama.cpp's converter's default)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines")
    parser.add_argument("--turns", type=int, default=3,
                        help="alternating turns; the CSV keeps each and the median")
    parser.add_argument("--out", type=Path, default=Path("results/mtmd_compare.csv"))
    args = parser.parse_args(argv)
    side_by_side.require_at_least_one(parser, args, ("longest_edge", "threads", "turns"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    anchors = Anchors.here()
    if not anchors.tool("llama-mtmd-cli").is_file():
        sys.exit(f"no llama-mtmd-cli under {anchors.build}: run ../shared/anchors/llamacpp-bench once first "
                 "(it builds llama.cpp with llama-mtmd-cli)")
    text, mmproj = write_pair(anchors.cache, args.longest_edge, args.mmproj_type)
    image = write_image(text.parent, *args.image_size)
    warm_image = write_image(text.parent, *args.image_size, seed=1)
    machine = machine_columns(args.threads, args.image_size, args.longest_edge, args.mmproj_type)
    rows: list[dict[str, object]] = []
    for turn in range(1, args.turns + 1):
        theirs_turn = partial(llama_cpp, text, mmproj, image, args.threads, anchors)
        ours_turn = partial(nanoserve, text, mmproj, image, warm_image, args.threads)
        ours, theirs = side_by_side.in_turn_order(turn, theirs_turn, ours_turn)
        row = turn_row(turn, ours, theirs)
        rows.append(machine | row)
        print(", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    (median,) = side_by_side.write_turns_csv(args.out, rows)
    print(f"{median['image_size']} image, {median['nanoserve_tiles']} tiles (llama.cpp "
          f"{median['llamacpp_tiles']}): encode {median['nanoserve_encode_ms']} ms vs "
          f"{median['llamacpp_encode_ms']} ms ({median['encode_speedup']}x), TTFT "
          f"{median['nanoserve_ttft_ms']} ms vs {median['llamacpp_ttft_ms']} ms ({median['ttft_speedup']}x)")


if __name__ == "__main__":
    main()
