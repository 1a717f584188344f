"""`nanoserve serve`: the OpenAI-compatible HTTP server on uvicorn.

Binds 127.0.0.1 unless told otherwise. The model loads on the engine thread after the socket
is up, so /health answers 503 until it is ready. SIGTERM (or Ctrl-C) stops accepting
connections, lets in-flight requests finish for at most --drain-s seconds, then exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanoserve.config import MAX_PREFILL_TOKENS_WHILE_DECODING, EngineConfig
from nanoserve.errors import NanoserveError
from nanoserve_cli import options
from nanoserve_cli.app import app

if TYPE_CHECKING:
    from types import FrameType

    import uvicorn
    from fastapi import FastAPI

    from nanoserve.engine import Engine

API_KEY_ENV = "NANOSERVE_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_SEED = 2**63  # as nanoserve.sampling_params.MAX_SEED; the cli imports no engine code up front


@app.command()
def serve(
    model: options.Model = None,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 exposes the server to the network.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="Name clients send as `model` (repeatable; the first is listed). Default: the model "
             "directory's name.")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar=API_KEY_ENV, help=f"Require 'Authorization: Bearer KEY' on /v1 (or set ${API_KEY_ENV}).")]
    = None,
    dtype: options.Dtype = "auto",
    device: options.Device = None,
    max_num_seqs: options.MaxNumSeqs = 32,
    max_num_batched_tokens: options.MaxBatchedTokens = 512,
    max_prefill_tokens_while_decoding: options.MaxPrefillWhileDecoding = MAX_PREFILL_TOKENS_WHILE_DECODING,
    max_model_len: options.MaxModelLen = None,
    kv_cache_gb: options.KvCacheGb = None,
    block_size: options.BlockSize = 16,
    batch_invariant: options.BatchInvariant = True,
    prefix_caching: options.PrefixCaching = True,
    threads: options.Threads = None,
    linear_kernel: options.LinearKernel = None,
    quantize: options.Quantize = None,
    speculative_tokens: options.SpeculativeTokens = 0,
    speculative_method: options.SpeculativeMethod = "ngram",
    speculative_ngram_min: options.SpeculativeNgramMin = 2,
    speculative_ngram_max: options.SpeculativeNgramMax = 4,
    draft_model: options.DraftModel = None,
    speculative_policy: options.SpeculativePolicy = "cost",
    speculative_disable_by_batch_size: options.SpeculativeDisableByBatchSize = None,
    async_scheduling: options.AsyncScheduling = None,
    fair_share_rows: options.FairShareRows = None,
    tensor_parallel_size: options.TensorParallelSize = 1,
    max_tokens_limit: Annotated[int | None, typer.Option(
        min=1, help="Most tokens one sequence may ask for; default: the context.")] = None,
    max_n: Annotated[int, typer.Option(min=1, help="Most choices (n) per request.")] = 16,
    max_prompts: Annotated[int, typer.Option(min=1, help="Most prompts in one completions batch.")] = 64,
    max_top_logprobs: Annotated[int, typer.Option(min=0, max=20, help="Most top logprobs per token.")] = 20,
    max_body_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted.")] = 1 << 20,
    max_waiting: Annotated[int, typer.Option(
        min=0, help="Sequences that may queue beyond the running batch; over it: 503 + Retry-After.")] = 256,
    drain_s: Annotated[float, typer.Option(
        min=0.0, help="On SIGTERM, seconds in-flight requests get to finish before they are cut.")] = 30.0,
    trust_request_chat_template: Annotated[bool, typer.Option(
        "--trust-request-chat-template", help="Render a chat_template sent with a request (sandboxed, "
        "but it runs as long as it likes); off: such requests are 400.")] = False,
    header_timeout_s: Annotated[float, typer.Option(
        min=0.1, help="A connection that sends no complete request head this long after opening (or "
                      "after its last response) is closed; the body then has 30 s.")] = 10.0,
    reasoning_parser: Annotated[str, typer.Option(
        help="How a reasoning model's thinking is told from its answer (vLLM's names): qwen3, "
             "deepseek_r1; auto: from the chat template where it is certain; none: off.")] = "auto",
    reasoning_budget: Annotated[int | None, typer.Option(
        min=0, help="Thinking tokens a request gets unless it sets thinking_token_budget: then the "
                    "end tag is forced and the answer follows. Default: no limit.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error or critical.")] = "info",
    seed: Annotated[int | None, typer.Option(
        min=0, max=MAX_SEED - 1, help="Seed for requests that give none: the same requests, in the same "
                                      "order, then sample the same tokens. Default: a random seed each.")]
    = None,
) -> None:
    """Serve the model over OpenAI's completions, chat completions and Responses APIs and
    Anthropic's Messages API.

    Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
    POST /v1/messages, GET /v1/models,
    GET /v1/models/{id}, POST /tokenize, POST /detokenize (behind --api-key), and GET /health,
    GET /metrics (Prometheus), GET /version, GET /docs (OpenAPI). Request fields the server does
    not honour are refused with a 400 naming them (README: "Request fields").
    """
    import uvicorn

    from nanoserve.default_model import resolve_model
    from nanoserve.server.app import DRAIN_GRACE_S, ServerLimits, build_app
    from nanoserve.server.connections import with_header_timeout
    from nanoserve.server.reasoning import ReasoningConfig

    _check_api_key(api_key)
    try:
        reasoning = ReasoningConfig(reasoning_parser, reasoning_budget)
    except NanoserveError as error:
        options.fail_for(error)
    if log_level.lower() not in LOG_LEVELS:
        options.fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    config = options.engine_config(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
                                   max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                   block_size=block_size, batch_invariant=batch_invariant,
                                   threads=threads, linear_kernel=linear_kernel,
                                   prefix_caching=prefix_caching, quantize=quantize,
                                   speculative_tokens=speculative_tokens,
                                   speculative_method=speculative_method,
                                   speculative_ngram_min=speculative_ngram_min,
                                   speculative_ngram_max=speculative_ngram_max,
                                   draft_model=draft_model, speculative_policy=speculative_policy,
                                   speculative_disable_by_batch_size=speculative_disable_by_batch_size,
                                   async_scheduling=async_scheduling, fair_share_rows=fair_share_rows,
                                   tensor_parallel_size=tensor_parallel_size)
    # Logging first: resolving the model may download or convert it, and says so as it starts.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nanoserve.parallel import is_torchrun_worker

    if is_torchrun_worker():  # a rank > 0 of a torchrun launch serves rank 0's steps, not HTTP
        try:
            _build_engine(config)  # runs the worker's loop, then exits
        except NanoserveError as error:
            options.fail_for(error)
    try:
        source = resolve_model(model, float_weights=False)  # for its name: no weights converted
    except NanoserveError as error:
        options.fail_for(error)
    names = list(served_model_name or [_served_name(model, source.dir, source.gguf)])
    aliases = (model,) if model else ()
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_n=max_n, max_prompts=max_prompts,
                          max_tokens=max_tokens_limit, max_top_logprobs=max_top_logprobs,
                          max_waiting=max_waiting, trust_request_chat_template=trust_request_chat_template)
    engine_deaths: list[BaseException] = []

    def stop_on_engine_death(error: BaseException) -> None:
        engine_deaths.append(error)
        server.should_exit = True  # uvicorn's own exit path: stop accepting, close, return

    server_app = build_app(lambda: _build_engine(config), model_names=names, aliases=aliases,
                           api_key=api_key, limits=limits, seed=seed, on_engine_death=stop_on_engine_death,
                           reasoning=reasoning)
    uvicorn_config = uvicorn.Config(server_app, host=host, port=port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S, access_log=False,
                                    http=with_header_timeout(header_timeout_s))
    server = _draining_server(uvicorn_config, server_app, drain_s)
    # uvicorn re-raises the signal it caught once it has drained; make that a no-op so the
    # process leaves through the normal exit path with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if engine_deaths:  # a model that cannot load is the user's to fix: exit 2 naming it
        error = engine_deaths[0]
        if isinstance(error, NanoserveError):
            options.fail_for(error)
        typer.secho(f"Error: the engine stopped: {error!r} (the log above has the traceback)", err=True,
                    fg=typer.colors.RED)
        raise typer.Exit(code=1)


def _check_api_key(api_key: str | None) -> None:
    """An empty key would leave the server open while the operator thinks it is guarded; one no
    client can send exactly (surrounding spaces, which HTTP strips from a header value, or
    characters outside printable ASCII) would lock every client out. Both are refused here."""
    # click reads an empty environment variable as unset, so look at it here.
    if (api_key is not None and not api_key.strip()) or (api_key is None and API_KEY_ENV in os.environ):
        options.fail(f"--api-key (or ${API_KEY_ENV}) must not be empty; leave it unset for no key")
    if api_key is None:
        return
    if api_key != api_key.strip():
        options.fail(f"--api-key (or ${API_KEY_ENV}) must not start or end with whitespace: HTTP drops "
                     "it from the Authorization header, so no client could send the key as given")
    if not (api_key.isascii() and api_key.isprintable()) or " " in api_key:
        options.fail(f"--api-key (or ${API_KEY_ENV}) must be printable ASCII without spaces (as a "
                     "bearer token is): clients send the Authorization header as ASCII")


def _draining_server(config: uvicorn.Config, server_app: FastAPI, drain_s: float) -> uvicorn.Server:
    """uvicorn, plus: the first SIGTERM or SIGINT starts the app's bounded drain."""
    import uvicorn

    from nanoserve.server.app import start_drain

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                start_drain(server_app, drain_s)
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def _served_name(model: str | None, model_dir: Path, gguf: Path | None = None) -> str:
    """What clients call the model: a hub id as given (its snapshot folder is a commit hash),
    else a GGUF's file name without `.gguf` (as llama.cpp's server names it; its folder here
    is a cache entry), else the checkpoint's folder name."""
    from nanoserve.hub import parse_hub_id

    if model and not Path(model).exists() and (hub_id := parse_hub_id(model)) is not None:
        return hub_id.repo_id
    if gguf is not None:
        return gguf.stem
    return model_dir.name


def _build_engine(config: EngineConfig) -> Engine:
    """The engine of `config` as the user gave it: the engine resolves the model itself (a
    resolved folder alone would lose what it was resolved from, such as a GGUF file whose
    blocks `--dtype auto` runs)."""
    from nanoserve.engine import Engine

    return Engine(config)
