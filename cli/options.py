"""Options shared by the commands that start an engine, and turning them into an EngineConfig.

Declared once here so `generate`, `serve` and `bench` spell and check them the same way.
"""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from nanoserve.config import MAX_PREFILL_TOKENS_WHILE_DECODING, EngineConfig
from nanoserve.errors import InvalidRequestError, NanoserveError

Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="Hugging Face model directory, .gguf file, or hub id ORG/NAME[@REVISION] "
    "(a GGUF repository: ORG/NAME:FILE.gguf or ORG/NAME:Q4_K_M); default: SmolLM2-135M-Instruct.")]
Dtype = Annotated[str, typer.Option(
    help="auto (a GGUF in its own quantization on a CPU with the native kernels, else float32 on CPU "
         "and bfloat16 on CUDA), float32, bfloat16, float16, or quantized (a GGUF's own blocks).")]
Quantize = Annotated[str | None, typer.Option(
    help="Quantize a float checkpoint's matrices at load, as llama.cpp would: q8_0 or q4_0.")]
Device = Annotated[str | None, typer.Option(help="cpu or cuda; default: cuda when available.")]
MaxNumSeqs = Annotated[int, typer.Option(min=1, help="Most requests in one step.")]
MaxBatchedTokens = Annotated[int, typer.Option(
    min=1, help="Token budget of one step (prefill chunks + decodes).")]
MaxPrefillWhileDecoding = Annotated[int, typer.Option(
    min=1, help="Most prompt tokens one step computes while other requests decode; a prompt up to "
                "this long prefills at once, a longer one in chunks of its fair share (--fair-share-rows).")]
def parse_fair_share_rows(value: str) -> float:
    """`off`, or row units >= 0 (typer's own range check cannot spell `off`)."""
    if value.strip().lower() == "off":
        return float("inf")
    try:
        rows = float(value)
    except ValueError:
        raise typer.BadParameter(f"a number of row units >= 0, or off; got {value!r}") from None
    if not rows >= 0:
        raise typer.BadParameter(f"must be >= 0, or off; got {value!r}")
    return rows


FairShareRows = Annotated[float | None, typer.Option(
    parser=parse_fair_share_rows, metavar="ROWS|off",
    help="While more than one client request runs, each takes at most the lightest one's rows "
         "(plus their attention context) plus ROWS a step, so one request with many choices, a "
         "long context or a long prompt slows the others by a bounded factor; tokens unchanged. "
         "off: no share. Default per device: 2 on CPU (measured), off on CUDA.")]
MaxModelLen = Annotated[int | None, typer.Option(min=2, help="Context length limit; default: the model's.")]
KvCacheGb = Annotated[float | None, typer.Option(
    min=0.0001, help="KV cache size in GiB; default: a quarter of free memory (at most 4 GiB on CPU).")]
BlockSize = Annotated[int, typer.Option(min=1, max=1024, help="Tokens per KV cache block.")]
BatchInvariant = Annotated[bool, typer.Option(
    "--batch-invariant/--no-batch-invariant",
    help="A request's tokens and logprobs never depend on what shares its steps (default); "
         "--no-batch-invariant trades that for speed.")]
PrefixCaching = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="Reuse the KV cache of prompt prefixes already computed (default); the output is the same "
         "either way under --batch-invariant.")]
Threads = Annotated[int | None, typer.Option(
    min=1, help="CPU threads for the model; default: every core this process may use.")]
LinearKernel = Annotated[str | None, typer.Option(
    help="Force one matrix-multiply kernel (aten, aten-tile16, onednn, onednn-min2, native; for GGUF "
         "blocks native-quant or native-quant-x8); default: the fastest this machine measured that "
         "passes the batch-invariance self-test.")]

SpeculativeTokens = Annotated[int, typer.Option(
    min=0, max=16, help="Speculative decoding: up to K draft tokens per request per step, verified in "
    "one chunk; tokens and logprobs stay exactly as without it (under --batch-invariant). 0 is off "
    "(the default); at most 16.")]
SpeculativeMethod = Annotated[str, typer.Option(
    help="Where drafts come from: ngram (prompt lookup over the request's own tokens) or draft "
         "(a small model with the same vocabulary, --draft-model).")]
DraftModel = Annotated[str | None, typer.Option(
    help="The draft model of --speculative-method draft (a directory, .gguf or hub id, as --model): "
         "same tokenizer and vocabulary, its own KV cache; it proposes greedily.")]
AsyncScheduling = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Deferred output: launch each step before the last one's tokens are resolved on the host "
         "(outputs unchanged; steps with speculation, grammars or penalties resolve at once). "
         "Default per device: off on CPU and CUDA until measured.")]
TensorParallelSize = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", min=1,
    help="Split the model over N ranks (Megatron tensor parallelism, gloo on CPU, NCCL on CUDA): "
         "the engine starts N-1 worker processes, or joins a torchrun launch of N; each rank runs "
         "on its share of the cores (--threads sets it).")]
SpeculativeNgramMin = Annotated[int, typer.Option(
    min=1, help="Shortest suffix n-gram prompt lookup matches.")]
SpeculativeNgramMax = Annotated[int, typer.Option(
    min=1, help="Longest suffix n-gram prompt lookup tries first.")]
SpeculativePolicy = Annotated[str, typer.Option(
    help="How many drafts a request carries: cost (default: only as many as its measured acceptance "
         "pays for at the step's batch size, so speculation is not expected to lose) or always "
         "(every draft it can).")]
SpeculativeDisableByBatchSize = Annotated[int | None, typer.Option(
    help="No drafts while at least this many requests decode (vLLM's option); default: no cut-off.")]

# Maps a SamplingParams / engine field to the command-line option that sets it.
FIELD_TO_OPTION = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
    "top_p": "--top-p", "min_p": "--min-p", "typical_p": "--typical-p",
    "top_n_sigma": "--top-n-sigma", "seed": "--seed", "stop": "--stop",
    "stop_token_ids": "--stop-token-id", "dtype": "--dtype", "device": "--device",
    "prompt": "PROMPT", "messages": "--chat", "min_tokens": "--min-tokens",
    "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "logprobs": "--logprobs",
    "threads": "--threads", "linear_kernel": "--linear-kernel", "quantize": "--quantize",
    "p_less": "--p-less", "json_schema": "--json-schema", "regex": "--regex",
}


def engine_config(*, model: str | None, dtype: str, device: str | None, max_num_seqs: int = 32,
                  max_num_batched_tokens: int = 512,
                  max_prefill_tokens_while_decoding: int = MAX_PREFILL_TOKENS_WHILE_DECODING,
                  max_model_len: int | None = None,
                  kv_cache_gb: float | None = None, block_size: int = 16,
                  batch_invariant: bool = True, threads: int | None = None,
                  linear_kernel: str | None = None, prefix_caching: bool = True,
                  quantize: str | None = None, speculative_tokens: int = 0,
                  speculative_method: str = "ngram", speculative_ngram_min: int = 2,
                  speculative_ngram_max: int = 4, draft_model: str | None = None,
                  speculative_policy: str = "cost", speculative_disable_by_batch_size: int | None = None,
                  async_scheduling: bool | None = None,
                  fair_share_rows: float | None = None, tensor_parallel_size: int = 1) -> EngineConfig:
    from nanoserve.engine import DTYPES, QUANTIZED
    from nanoserve.quant import QUANTIZERS
    from nanoserve.spec_decode import SpecConfig

    if dtype not in (*DTYPES, "auto", QUANTIZED):
        fail(f"--dtype must be one of {', '.join(DTYPES)}, auto, {QUANTIZED}; got {dtype!r}")
    if quantize is not None and quantize not in QUANTIZERS:
        fail(f"--quantize must be one of {', '.join(QUANTIZERS)}; got {quantize!r}")
    if device is not None and device.split(":")[0] not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda; got {device!r}")
    check_linear_kernel(linear_kernel)
    try:
        SpecConfig(speculative_tokens, speculative_method, speculative_ngram_min, speculative_ngram_max,
                   speculative_policy, speculative_disable_by_batch_size).check(draft_model=draft_model)
    except InvalidRequestError as error:
        fail_for(error)
    return EngineConfig(model=model, dtype=dtype, device=device, block_size=block_size,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
                        max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                        batch_invariant=batch_invariant, threads=threads, linear_kernel=linear_kernel,
                        enable_prefix_caching=prefix_caching, quantize=quantize,
                        speculative_tokens=speculative_tokens, speculative_method=speculative_method,
                        speculative_ngram_min=speculative_ngram_min,
                        speculative_ngram_max=speculative_ngram_max, draft_model=draft_model,
                        speculative_policy=speculative_policy,
                        speculative_disable_by_batch_size=speculative_disable_by_batch_size,
                        async_scheduling=async_scheduling, fair_share_rows=fair_share_rows,
                        tensor_parallel_size=tensor_parallel_size)


def check_linear_kernel(name: str | None) -> None:
    """A name that is no kernel at all fails here, before the model loads; whether this machine
    can run it, and whether it passes the self-test, the engine finds out at start-up."""
    from nanoserve.linear import KERNELS, QUANTIZED_KERNELS

    names = [*KERNELS, *QUANTIZED_KERNELS]
    if name is not None and name not in names:
        fail(f"--linear-kernel must be one of {', '.join(names)}; got {name!r}")


def slots_or_deprecated(slots: tuple[int, ...], old: tuple[int, ...] | None,
                        old_name: str) -> tuple[int, ...]:
    """`--slots`, or the value of its old spelling (kept hidden so recorded commands still run),
    with one line saying the new name."""
    if old is None:
        return slots
    typer.secho(f"{old_name} is deprecated: use --slots", err=True, fg=typer.colors.YELLOW)
    return old


def fail(message: str) -> NoReturn:
    """Exit with status 2 and a one-line message: the usage-error convention, no traceback."""
    typer.secho(f"Error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def fail_for(error: NanoserveError) -> NoReturn:
    from nanoserve.parallel import TensorParallelError

    if isinstance(error, TensorParallelError):  # a rank died or hung: a failure, not a usage error
        typer.secho(f"Error: {error}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1)
    if isinstance(error, InvalidRequestError) and error.param:
        option = FIELD_TO_OPTION.get(error.param, f"--{error.param.replace('_', '-')}")
        fail(f"invalid value for {option}: {error.message}")
    fail(f"--model: {error}" if not isinstance(error, InvalidRequestError) else str(error))
