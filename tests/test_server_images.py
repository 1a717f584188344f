"""Images over the HTTP APIs, with the official clients over loopback: an image_url data URL (to an
Idefics3 model and to a Qwen2-VL one), an Anthropic image block and a Responses input_image get
the answer the offline engine gives for the same prompt and image; http(s) URLs are fetched from
allowed hosts only; corrupt, oversized, unsupported or misplaced images are a 400 naming the part,
never a 500."""

from __future__ import annotations

import base64
import contextlib
import http.server
import struct
import threading
import zlib
from collections.abc import Iterator

import anthropic
import openai
import pytest
from test_server_api import MODEL, idle_client, serving, tiny_engine

from nanoserve.llm import LLM
from nanoserve.multimodal.limits import ImageLimits
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.app import ServerLimits
from nanoserve.server.images import MediaPolicy
from tests.tiny_vlm import image_bytes, random_image, write_tiny_idefics3, write_tiny_qwen2_vl

pytest.importorskip("transformers")

PNG = image_bytes(random_image(100, 70, seed=1))
QUESTION = "What is in the picture?"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with a few bytes of pixel data (a decompression
    bomb's shape: the size is refused from the header, before any pixel is decoded)."""
    png = image_bytes(random_image(1, 1))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_idefics3(tmp_path_factory.mktemp("idefics3-server"))


class ImageHost:
    """A loopback HTTP server answering every GET with `body`."""

    def __init__(self, body: bytes) -> None:
        served = body

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(served)))
                self.end_headers()
                self.wfile.write(served)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cat.png"

    def __enter__(self) -> ImageHost:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    with ImageHost(PNG) as image_host:
        yield image_host


@pytest.fixture(scope="module")
def served(vlm_dir):
    limits = ServerLimits(max_body_bytes=4 << 20, media=MediaPolicy(frozenset({"127.0.0.1"})))
    engine = {"dtype": "float32",
              "image_limits": ImageLimits(max_images_per_prompt=2, max_pixels=1000 * 1000)}
    with serving(lambda: tiny_engine(vlm_dir, **engine), limits=limits) as server:
        yield server


@pytest.fixture(scope="module")
def expected(vlm_dir) -> str:
    """The offline engine's greedy answer to QUESTION about PNG, through the same chat template."""
    llm = LLM(str(vlm_dir), dtype="float32", device="cpu", num_kv_blocks=96)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + "<image>"}])
    (completion,) = llm.generate({"prompt": text, "multi_modal_data": {"image": PNG}},
                                 SamplingParams(max_tokens=8, temperature=0.0))
    return completion.outputs[0].text


def chat_parts(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@contextlib.contextmanager
def openai_client(served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0) as client:
        yield client


def test_openai_client_sends_a_data_url_image_and_gets_the_offline_answer(served, expected):
    with openai_client(served) as client:
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(data_url(PNG)), max_tokens=8,
                                               temperature=0.0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens > 80  # the image's rows are in the prompt


def test_an_allowed_hosts_image_url_is_fetched(served, expected, host):
    with openai_client(served) as client:
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(host.url), max_tokens=8,
                                               temperature=0.0)
    assert reply.choices[0].message.content == expected


def test_anthropic_image_block_and_responses_input_image_get_the_same_answer(served, expected):
    with anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0) as client:
        message = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0.0},
                                         messages=[
            {"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PNG).decode()}}]}])
    assert message.content[0].text == expected
    with openai_client(served) as client:
        response = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0.0, input=[
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                         {"type": "input_image", "image_url": data_url(PNG)}]}])
    assert response.output_text == expected


def test_a_qwen2_vl_model_answers_a_data_url_image_as_the_offline_engine_does(tmp_path_factory):
    """Qwen2-VL's placeholder (`<|vision_start|><|image_pad|><|vision_end|>`) stands for the
    image part in the rendered chat, and the answer rotates by the same M-RoPE positions."""
    qwen_dir = write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-server"))
    llm = LLM(str(qwen_dir), dtype="float32", device="cpu", num_kv_blocks=96)
    placeholder = llm.engine.images.processor.placeholder
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + placeholder}])
    (completion,) = llm.generate({"prompt": text, "multi_modal_data": {"image": PNG}},
                                 SamplingParams(max_tokens=8, temperature=0.0))
    with serving(lambda: tiny_engine(qwen_dir, dtype="float32")) as server, openai_client(server) as client:
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(data_url(PNG)), max_tokens=8,
                                               temperature=0.0)
    assert reply.choices[0].message.content == completion.outputs[0].text
    assert reply.usage.prompt_tokens == len(completion.prompt_token_ids)


BAD_IMAGES = {
    "truncated PNG": (data_url(PNG[: len(PNG) // 2]), "messages[0].content[1].image_url"),
    "10k x 10k": (data_url(png_claiming(10_000, 10_000)), "messages[0].content[1].image_url"),
    "SVG": (data_url(b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>', "image/svg+xml"),
            "messages[0].content[1].image_url"),
    "not base64": ("data:image/png;base64,@@@", "messages[0].content[1].image_url"),
    "host not allowed": ("http://localhost:1/cat.png", "messages[0].content[1].image_url.url"),
    "scheme": ("file:///etc/passwd", "messages[0].content[1].image_url.url"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_are_a_400_naming_the_part(served, case):
    url, param = BAD_IMAGES[case]
    with idle_client(served) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat_parts(url),
                                                           "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_too_many_images_and_a_fetch_past_the_size_limit_are_400s(served, vlm_dir):
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}] * 3}]
    with idle_client(served) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": three})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    with ImageHost(b"\0" * (30 << 20)) as big, idle_client(served) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat_parts(big.url)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1].image_url.url"


def test_a_url_needs_allowed_media_domains(vlm_dir, host):
    with serving(lambda: tiny_engine(vlm_dir)) as server, idle_client(server) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat_parts(host.url)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1].image_url.url"
    assert "--allowed-media-domains" in response.json()["error"]["message"]


def test_a_text_only_model_refuses_an_image_part_naming_it(tiny_model_dir):
    with serving(lambda: tiny_engine(tiny_model_dir)) as server, idle_client(server) as http:
        response = http.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": chat_parts(data_url(PNG))})
        assert http.get("/health").status_code == 200
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1]"


def test_a_gemma3_model_answers_an_openai_data_url_image_as_offline(tmp_path_factory):
    """Gemma 3: the image part becomes its <start_of_image> placeholder, expanded and attended
    both ways, over the same path as the offline engine."""
    from tests.tiny_vlm import write_tiny_gemma3

    gemma3_dir = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-server"))
    llm = LLM(str(gemma3_dir), dtype="float32", device="cpu", num_kv_blocks=96)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + "<start_of_image>"}])
    (completion,) = llm.generate({"prompt": text, "multi_modal_data": {"image": PNG}},
                                 SamplingParams(max_tokens=8, temperature=0.0))
    limits = ServerLimits(max_body_bytes=4 << 20, media=MediaPolicy(frozenset()))
    with (serving(lambda: tiny_engine(gemma3_dir, dtype="float32"), limits=limits) as server,
          openai_client(server) as client):
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(data_url(PNG)), max_tokens=8,
                                               temperature=0.0)
    assert reply.choices[0].message.content == completion.outputs[0].text
    assert reply.usage.prompt_tokens == len(completion.prompt_token_ids)


def test_a_llava_gguf_and_mmproj_pair_answers_an_openai_data_url_image_as_its_folder(tmp_path_factory):
    """`serve --model text.gguf --mmproj mmproj.gguf` with LLaVA-1.5's pair in llama.cpp's layout:
    the official client's data-URL image gets the answer the folder it was written from gives
    offline (same prompt tokens, same greedy text)."""
    from tests.tiny_vlm import write_text_gguf, write_tiny_llava, write_tiny_llava_mmproj

    llava_dir = write_tiny_llava(tmp_path_factory.mktemp("llava-server"), shortest_edge=28,
                                 pad_to_square=True, llama_cpp_f16=True, seed=7)
    out = tmp_path_factory.mktemp("llava-server-gguf")
    text, mmproj = write_text_gguf(llava_dir, out), write_tiny_llava_mmproj(llava_dir, out / "mmproj.gguf")
    llm = LLM(str(llava_dir), dtype="float32", device="cpu", num_kv_blocks=96)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + "<image>"}])
    (completion,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": PNG}},
                                 SamplingParams(max_tokens=8, temperature=0.0))
    limits = ServerLimits(max_body_bytes=4 << 20, media=MediaPolicy(frozenset()))
    with (serving(lambda: tiny_engine(text, mmproj=str(mmproj), dtype="float32"), limits=limits) as server,
          openai_client(server) as client):
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(data_url(PNG)), max_tokens=8,
                                               temperature=0.0)
    assert completion.outputs[0].text and reply.choices[0].message.content == completion.outputs[0].text
    assert reply.usage.prompt_tokens == len(completion.prompt_token_ids)


def test_a_llava_text_gguf_without_the_image_token_answers_a_data_url_image_as_its_folder(tmp_path_factory):
    """llava-v1.5-7b's case: the text GGUF's vocabulary lacks `<image>` (the folder's has it). The
    server splits the chat's text at the image, places the rows under an id outside the
    vocabulary, and answers as the folder does offline; prompt_logprobs (vLLM's field) are null
    at the image's rows, where there is no token to score."""
    from tests.tiny_vlm import write_text_gguf, write_tiny_llava, write_tiny_llava_mmproj

    llava_dir = write_tiny_llava(tmp_path_factory.mktemp("llava-server-base"), shortest_edge=28,
                                 pad_to_square=True, llama_cpp_f16=True, seed=7)
    out = tmp_path_factory.mktemp("llava-server-base-gguf")
    text = write_text_gguf(llava_dir, out, without_token="<image>")
    mmproj = write_tiny_llava_mmproj(llava_dir, out / "mmproj.gguf")
    llm = LLM(str(llava_dir), dtype="float32", device="cpu", num_kv_blocks=96)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + "<image>"}])
    (completion,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": PNG}},
                                 SamplingParams(max_tokens=8, temperature=0.0))
    image_rows = completion.prompt_token_ids.count(llm.tokenizer.backend.token_to_id("<image>"))
    limits = ServerLimits(max_body_bytes=4 << 20, media=MediaPolicy(frozenset()))
    with (serving(lambda: tiny_engine(text, mmproj=str(mmproj), dtype="float32"), limits=limits) as server,
          openai_client(server) as client):
        reply = client.chat.completions.create(model=MODEL, messages=chat_parts(data_url(PNG)), max_tokens=8,
                                               temperature=0.0, extra_body={"prompt_logprobs": 1})
    assert completion.outputs[0].text and reply.choices[0].message.content == completion.outputs[0].text
    assert reply.usage.prompt_tokens == len(completion.prompt_token_ids)
    scored = reply.model_extra["prompt_logprobs"]
    assert len(scored) == len(completion.prompt_token_ids) and image_rows > 0
    assert [entry is None for entry in scored].count(True) == 1 + image_rows
