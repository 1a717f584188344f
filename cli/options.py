"""The engine options, declared once, and the command line's usage errors (exit 2 naming the option).

`EngineOptions` owns every option that configures the engine: its spelling, help, range and
default (the EngineConfig default). A command takes them through `engine_options`, which turns
its `engine: EngineOptions` parameter into one option per field and hands the command their
parsed values as one object; `EngineOptions.config` checks them and builds the EngineConfig.
So a new engine option is one field here, spelt, checked and forwarded the same way by every
command that starts an engine. A command's own options (sampling, HTTP, sweeps) stay with it.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Any, NoReturn

import typer

from nanoserve.config import (
    DTYPES,
    PREFILL_PACE_MIN_TOKENS,
    PREFILL_STEP_MS_DEFAULT,
    QUANTIZED,
    EngineConfig,
)
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
def _number_or_off(value: str, *, what: str, bound: str, within: Callable[[float], bool]) -> float:
    """`off` (infinity), or a number `within` its bound (typer's own range check cannot spell `off`)."""
    if value.strip().lower() == "off":
        return float("inf")
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"{what} {bound}, or off; got {value!r}") from None
    if not within(number):
        raise typer.BadParameter(f"must be {bound}, or off; got {value!r}")
    return number


def parse_fair_share_rows(value: str) -> float:
    """`off`, or row units >= 0."""
    return _number_or_off(value, what="a number of row units", bound=">= 0", within=lambda rows: rows >= 0)


FairShareRows = Annotated[float | None, typer.Option(
    parser=parse_fair_share_rows, metavar="ROWS|off",
    help="While more than one client request runs, each takes at most the lightest one's rows "
         "(plus their attention context) plus ROWS a step, so one request with many choices, a "
         "long context or a long prompt slows the others by a bounded factor; tokens unchanged. "
         "off: no share. Default per device: 2 on CPU (measured), off on CUDA.")]
LongPrefillTokenThreshold = Annotated[int | None, typer.Option(
    min=1, help="Most prompt tokens of one request in a step (vLLM's option): a longer prompt is "
                "computed in chunks of at most this many; default: no bound but the step's budgets.")]


def parse_prefill_step_ms(value: str) -> float:
    """`off`, or milliseconds > 0."""
    return _number_or_off(value, what="milliseconds", bound="> 0", within=lambda ms: 0 < ms < float("inf"))


PrefillStepMs = Annotated[float | None, typer.Option(
    parser=parse_prefill_step_ms, metavar="MS|off",
    help="A step no one shares computes the prompt tokens its measured cost fits in about MS "
         f"milliseconds beside its own decode rows (at least {PREFILL_PACE_MIN_TOKENS} tokens), since "
         "a request that arrives waits for the step in flight; tokens unchanged. off: the whole "
         f"--max-num-batched-tokens. Default per device: {PREFILL_STEP_MS_DEFAULT['cpu']:g} on CPU, "
         "off on CUDA.")]
SchedulingPolicy = Annotated[str, typer.Option(
    help="Which waiting request runs first, and which running one is preempted first when the KV "
         "cache is full: fcfs (arrival order) or priority (a request's priority field, lower "
         "first, then arrival, as vLLM); tokens unchanged either way.")]
MaxModelLen = Annotated[int | None, typer.Option(min=2, help="Context length limit; default: the model's.")]
KvCacheGb = Annotated[float | None, typer.Option(
    min=0.0001, help="KV cache size in GiB; default: a quarter of free memory (at most 4 GiB on CPU).")]
KvCacheDtype = Annotated[str, typer.Option(
    help="What the KV cache stores: auto (the activations' dtype), float32, bfloat16, q8_0 (int8 "
         "with one scale per head per token: about 3.8x float32's tokens in the same memory), or "
         "fp8 (CUDA only).")]
BlockSize = Annotated[int, typer.Option(min=1, max=1024, help="Tokens per KV cache block.")]
BatchInvariant = Annotated[bool, typer.Option(
    "--batch-invariant/--no-batch-invariant",
    help="A request's tokens and logprobs never depend on what shares its steps (default); "
         "--no-batch-invariant trades that for speed.")]
PrefixCaching = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="Reuse the KV cache of prompt prefixes already computed (default); the output is the same "
         "either way under --batch-invariant.")]
PrefixCacheDir = Annotated[str | None, typer.Option(
    help="Keep the prefix cache's full KV blocks in this directory across restarts: written when "
         "evicted and at shutdown, read back on a later prefix hit (bound to the model file, its dtype "
         "and the KV cache's dtype and block size). Default: memory only.")]
PrefixCacheDirMaxGb = Annotated[float, typer.Option(
    min=0.0001,
    help="Size limit of --prefix-cache-dir in GB (every model's files in it); least recently used "
         "blocks are deleted first.")]
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
Mmproj = Annotated[str | None, typer.Option(
    help="A llama.cpp mmproj .gguf: the vision tower and projector beside a text model (SmolVLM's "
         "idefics3, Gemma 3's gemma3 or LLaVA-1.5's mlp projector); images then go in at its "
         "placeholders (<image>, <start_of_image>).")]
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
Task = Annotated[str, typer.Option(
    help="generate (the default: the model generates, and /v1/embeddings pools its hidden states "
         "too) or embed (an embedding model, as vLLM's --task embed: /v1/embeddings only; the "
         "generation endpoints answer 400).")]
Pooling = Annotated[str | None, typer.Option(
    help="How /v1/embeddings pools the prompt's final hidden states: last (the last token's) or "
         "mean (every token's average); default: the checkpoint's own (sentence-transformers' "
         "pooling config), else last.")]
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
    "lora_path": "--lora-modules", "lora_name": "--lora-modules",
    "dry_multiplier": "--dry-multiplier", "dry_base": "--dry-base",
    "dry_allowed_length": "--dry-allowed-length", "dry_penalty_last_n": "--dry-penalty-last-n",
    "dry_sequence_breakers": "--dry-sequence-breaker", "xtc_probability": "--xtc-probability",
    "xtc_threshold": "--xtc-threshold", "mirostat": "--mirostat", "mirostat_tau": "--mirostat-tau",
    "mirostat_eta": "--mirostat-eta",
}

_DEFAULT = EngineConfig()  # the options' defaults are the engine's own


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """The engine options as parsed: each field is the EngineConfig field of the same name."""

    model: Model = _DEFAULT.model
    dtype: Dtype = _DEFAULT.dtype
    device: Device = _DEFAULT.device
    max_num_seqs: MaxNumSeqs = _DEFAULT.max_num_seqs
    max_num_batched_tokens: MaxBatchedTokens = _DEFAULT.max_num_batched_tokens
    max_prefill_tokens_while_decoding: MaxPrefillWhileDecoding = _DEFAULT.max_prefill_tokens_while_decoding
    max_model_len: MaxModelLen = _DEFAULT.max_model_len
    kv_cache_gb: KvCacheGb = _DEFAULT.kv_cache_gb
    kv_cache_dtype: KvCacheDtype = _DEFAULT.kv_cache_dtype
    block_size: BlockSize = _DEFAULT.block_size
    batch_invariant: BatchInvariant = _DEFAULT.batch_invariant
    enable_prefix_caching: PrefixCaching = _DEFAULT.enable_prefix_caching
    prefix_cache_dir: PrefixCacheDir = _DEFAULT.prefix_cache_dir
    prefix_cache_dir_max_gb: PrefixCacheDirMaxGb = _DEFAULT.prefix_cache_dir_max_gb
    threads: Threads = _DEFAULT.threads
    linear_kernel: LinearKernel = _DEFAULT.linear_kernel
    quantize: Quantize = _DEFAULT.quantize
    speculative_tokens: SpeculativeTokens = _DEFAULT.speculative_tokens
    speculative_method: SpeculativeMethod = _DEFAULT.speculative_method
    speculative_ngram_min: SpeculativeNgramMin = _DEFAULT.speculative_ngram_min
    speculative_ngram_max: SpeculativeNgramMax = _DEFAULT.speculative_ngram_max
    draft_model: DraftModel = _DEFAULT.draft_model
    mmproj: Mmproj = _DEFAULT.mmproj
    speculative_policy: SpeculativePolicy = _DEFAULT.speculative_policy
    speculative_disable_by_batch_size: SpeculativeDisableByBatchSize = (
        _DEFAULT.speculative_disable_by_batch_size)
    async_scheduling: AsyncScheduling = _DEFAULT.async_scheduling
    fair_share_rows: FairShareRows = _DEFAULT.fair_share_rows
    long_prefill_token_threshold: LongPrefillTokenThreshold = _DEFAULT.long_prefill_token_threshold
    prefill_step_ms: PrefillStepMs = _DEFAULT.prefill_step_ms
    scheduling_policy: SchedulingPolicy = _DEFAULT.scheduling_policy
    tensor_parallel_size: TensorParallelSize = _DEFAULT.tensor_parallel_size
    task: Task = _DEFAULT.task
    pooling: Pooling = _DEFAULT.pooling

    def check(self) -> None:
        """Exit 2 naming the option on a value no engine could take, before anything loads."""
        from nanoserve.engine.prefix_store import check_prefix_cache_dir
        from nanoserve.engine.spec_decode import SpecConfig
        from nanoserve.quant import QUANTIZERS

        if self.dtype not in (*DTYPES, "auto", QUANTIZED):
            fail(f"--dtype must be one of {', '.join(DTYPES)}, auto, {QUANTIZED}; got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANTIZERS:
            fail(f"--quantize must be one of {', '.join(QUANTIZERS)}; got {self.quantize!r}")
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            fail(f"--device must be cpu or cuda; got {self.device!r}")
        try:  # the engine's own checks, each option's in one place (nanoserve.config)
            check_prefix_cache_dir(EngineConfig(**asdict(self)))
        except InvalidRequestError as error:
            fail_for(error)
        if self.device is not None and self.device.split(":")[0] == "cpu" and self.kv_cache_dtype == "fp8":
            fail("--kv-cache-dtype fp8 runs on CUDA only; on the CPU use q8_0 or bfloat16")
        check_linear_kernel(self.linear_kernel)
        try:
            SpecConfig(self.speculative_tokens, self.speculative_method, self.speculative_ngram_min,
                       self.speculative_ngram_max, self.speculative_policy,
                       self.speculative_disable_by_batch_size).check(draft_model=self.draft_model)
        except InvalidRequestError as error:
            fail_for(error)

    def config(self, **fixed: Any) -> EngineConfig:
        """The checked EngineConfig of these options, with `fixed` fields a command sets itself."""
        self.check()
        return EngineConfig(**(asdict(self) | fixed))


def engine_options(*, only: Collection[str] | None = None,
                   omit: Collection[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the engine options (`only` these, or every one but `omit`).

    The command declares `engine: EngineOptions` (keyword-only, after a bare `*`: it has no
    default); typer sees one option per field in its place (so --help lists them there), and the
    command receives their parsed values as one object. Typer reads a command's options from its
    signature and has no notion of a parameter object, so the signature is rewritten to spell the
    fields out. A name in `only` or `omit` that is no field fails here, at import.
    """
    unknown = set(only or ()).union(omit) - {f.name for f in fields(EngineOptions)}
    if unknown:
        raise ValueError(f"not engine options: {sorted(unknown)}")
    chosen = [f for f in fields(EngineOptions) if (only is None or f.name in only) and f.name not in omit]
    names = [f.name for f in chosen]
    hints = typing.get_type_hints(EngineOptions, include_extras=True)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        if "engine" not in signature.parameters:
            raise TypeError(f"{command.__name__} declares no `engine: EngineOptions` parameter")
        kind = signature.parameters["engine"].kind
        shared = [inspect.Parameter(f.name, kind, annotation=hints[f.name], default=f.default)
                  for f in chosen]
        parameters = [p for own in signature.parameters.values()
                      for p in (shared if own.name == "engine" else [own])]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            engine = EngineOptions(**{name: values.pop(name) for name in names})
            return command(engine=engine, **values)

        run.__signature__ = signature.replace(parameters=parameters)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate


def check_linear_kernel(name: str | None) -> None:
    """A name that is no kernel at all fails here, before the model loads; whether this machine
    can run it, and whether it passes the self-test, the engine finds out at start-up."""
    from nanoserve.model.linear import KERNELS, QUANTIZED_KERNELS

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


def serve_as_torchrun_rank(config: EngineConfig) -> None:
    """In a rank above 0 of a torchrun launch, run the worker's loop (it serves rank 0's steps,
    neither HTTP nor a prompt) and exit with its status; elsewhere return at once."""
    from nanoserve.distributed.group import is_torchrun_worker

    if not is_torchrun_worker():
        return
    from nanoserve.worker.loop import serve_torchrun_rank

    try:
        status = serve_torchrun_rank(config)
    except NanoserveError as error:
        fail_for(error)
    raise typer.Exit(code=status)


def fail_for(error: NanoserveError) -> NoReturn:
    from nanoserve.distributed.group import TensorParallelError

    if isinstance(error, TensorParallelError):  # a rank died or hung: a failure, not a usage error
        typer.secho(f"Error: {error}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1)
    if isinstance(error, InvalidRequestError) and error.param:
        option = FIELD_TO_OPTION.get(error.param, f"--{error.param.replace('_', '-')}")
        fail(f"invalid value for {option}: {error.message}")
    fail(f"--model: {error}" if not isinstance(error, InvalidRequestError) else str(error))
