"""`nanoserve generate`: stream one completion to stdout, then a one-line summary to stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanoserve.errors import NanoserveError
from nanoserve.sampling_params import DRY_SEQUENCE_BREAKERS, SamplingParams, StructuredOutputs
from nanoserve_cli import options
from nanoserve_cli.app import app

if TYPE_CHECKING:
    from nanoserve.llm import LLM


# One request runs: there is no batch to size or share, and its blocks keep the default size.
ONE_REQUEST_OMITS = ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_while_decoding",
                     "block_size", "fair_share_rows", "long_prefill_token_threshold", "prefill_step_ms",
                     "task", "pooling")


@app.command()
@options.engine_options(omit=ONE_REQUEST_OMITS)
def generate(
    prompt: Annotated[str, typer.Argument(
        help="The prompt (with --chat: the user message); - reads it from stdin.")],
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 or -1 keeps all.")] = -1,
    top_p: Annotated[float, typer.Option(
        help="Keep the smallest set with this much probability, in (0, 1].")] = 1.0,
    min_p: Annotated[float, typer.Option(
        help="Drop tokens below min_p x the top probability, in [0, 1].")] = 0.0,
    typical_p: Annotated[float, typer.Option(
        help="Locally typical sampling: keep the most typical tokens holding this much probability, "
             "in (0, 1]; 1 keeps all.")] = 1.0,
    top_n_sigma: Annotated[float, typer.Option(
        help="Keep tokens whose logit is at least max - n x the logits' std (after temperature); "
             "-1 is off.")] = -1.0,
    p_less: Annotated[bool, typer.Option(
        "--p-less", help="p-less sampling: keep tokens at least as likely as two draws agreeing "
                         "(the sum of squared probabilities).")] = False,
    dry_multiplier: Annotated[float, typer.Option(
        help="DRY (llama.cpp's): penalize tokens that extend a repeat of earlier text; 0 is off.")] = 0.0,
    dry_base: Annotated[float, typer.Option(
        help="DRY's penalty grows by this factor per repeated token.")] = 1.75,
    dry_allowed_length: Annotated[int, typer.Option(help="DRY: repeats this long go unpenalized.")] = 2,
    dry_penalty_last_n: Annotated[int, typer.Option(
        help="DRY looks at this many last tokens; -1: all, 0: off.")] = -1,
    dry_sequence_breaker: Annotated[list[str] | None, typer.Option(
        help="DRY: a repeat never reaches back past this string (repeatable; default: newline, "
             "':', '\"', '*').")] = None,
    xtc_probability: Annotated[float, typer.Option(
        help="XTC (llama.cpp's): chance per token of dropping the top choices; 0 is off.")] = 0.0,
    xtc_threshold: Annotated[float, typer.Option(
        help="XTC drops the tokens above this probability but the least likely of them.")] = 0.1,
    mirostat: Annotated[int, typer.Option(
        help="Mirostat sampling: 1 or 2 (2.0); 0 is off. It replaces top-k, top-p and the like.")] = 0,
    mirostat_tau: Annotated[float, typer.Option(
        "--mirostat-tau", "--mirostat-ent", help="Mirostat's target surprise (entropy).")] = 5.0,
    mirostat_eta: Annotated[float, typer.Option(
        "--mirostat-eta", "--mirostat-lr", help="Mirostat's learning rate.")] = 0.1,
    json_schema: Annotated[Path | None, typer.Option(
        help="Constrain the output to this JSON schema (a file).", dir_okay=False)] = None,
    regex: Annotated[str | None, typer.Option(
        help="Constrain the output to this regular expression.")] = None,
    seed: Annotated[int | None, typer.Option(help="Same seed, same text.")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        help="Stop at the first of these strings to complete, left out of the text (repeatable).")] = None,
    stop_token_id: Annotated[list[int] | None, typer.Option(
        help="Stop at this token id (repeatable).")] = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Wrap the prompt in the model's chat template.")] = False,
    image: Annotated[list[Path] | None, typer.Option(
        help="An image file (PNG, JPEG, WebP, GIF) for a vision-language model (repeatable); placed at "
             "the prompt's image placeholders (SmolVLM's <image>), else before the prompt.")] = None,
    *,
    engine: options.EngineOptions,
) -> None:
    """Stream one completion of PROMPT from the model (greedy unless --temperature is set)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, typical_p=typical_p,
                                top_n_sigma=top_n_sigma, seed=seed, stop=tuple(stop or ()),
                                stop_token_ids=tuple(stop_token_id or ()), p_less=p_less,
                                structured_outputs=_structured(json_schema, regex),
                                dry_multiplier=dry_multiplier, dry_base=dry_base,
                                dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n,
                                dry_sequence_breakers=(tuple(dry_sequence_breaker) if dry_sequence_breaker
                                                       else DRY_SEQUENCE_BREAKERS),
                                xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                                mirostat=mirostat, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
    except NanoserveError as error:
        options.fail_for(error)
    config = engine.config(max_num_seqs=1)
    options.serve_as_torchrun_rank(config)
    try:
        from nanoserve.llm import LLM

        llm = LLM.from_config(config)
        print(llm.engine.native_summary, file=sys.stderr)
        for note in llm.engine.weight_notes:
            print(note, file=sys.stderr)
        print(llm.engine.kernel_summary, file=sys.stderr)
        print(llm.engine.kv_cache_summary, file=sys.stderr)
        if image:
            _stream(llm, _image_prompt(llm, prompt, [_read(path) for path in image], chat), params)
            return
        messages = [{"role": "user", "content": prompt}]
        _stream(llm, llm.tokenizer.encode_chat(messages) if chat else prompt, params)
    except NanoserveError as error:
        options.fail_for(error)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        options.fail(f"--image: cannot read {path}: {error}")


def _image_prompt(llm: LLM, prompt: str, images: list[bytes], chat: bool) -> dict:
    """The prompt with its images: their placeholders where the prompt has them, else one per
    image before it; with `chat`, in the chat template (as parts where the template reads parts)."""
    from nanoserve.tokenizer import template_reads_parts

    placeholder = llm.engine.images.processor.placeholder if llm.engine.images is not None else "<image>"
    if placeholder not in prompt:
        prompt = placeholder * len(images) + prompt
    if chat:
        content: str | list[dict] = prompt
        if template_reads_parts(llm.tokenizer.chat_template):
            pieces = prompt.split(placeholder)
            content = [{"type": "text", "text": pieces[0]}]
            for piece in pieces[1:]:
                content += [{"type": "image"}, {"type": "text", "text": piece}]
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def _structured(json_schema: Path | None, regex: str | None) -> StructuredOutputs | None:
    if json_schema is not None and regex is not None:
        options.fail("give at most one of --json-schema and --regex")
    if regex is not None:
        return StructuredOutputs(regex=regex, param="regex")
    if json_schema is None:
        return None
    try:
        text = json_schema.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        options.fail(f"--json-schema: cannot read {json_schema}: {error}")
    return StructuredOutputs(json=text, param="json_schema")


def _stream(llm: LLM, prompt: str | list[int] | dict, params: SamplingParams) -> None:
    start = time.perf_counter()
    first_token_s = None
    num_prompt = num_output = 0
    for output in llm.stream(prompt, params):
        if first_token_s is None:
            first_token_s = time.perf_counter() - start
        sys.stdout.write(output.text)
        sys.stdout.flush()
        num_prompt, num_output = output.num_prompt_tokens, output.num_output_tokens
    elapsed_s = time.perf_counter() - start
    decode_s = elapsed_s - (first_token_s or 0.0)
    decode_rate = (num_output - 1) / decode_s if num_output > 1 and decode_s > 0 else 0.0
    sys.stdout.write("\n")
    print(f"prompt {num_prompt} tokens, generated {num_output} tokens, "
          f"{decode_rate:.1f} tokens/s decode, time to first token {1000 * (first_token_s or 0):.0f} ms",
          file=sys.stderr)

