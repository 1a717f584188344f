"""`nanoserve serve`: the OpenAI-compatible HTTP server on uvicorn.

Binds 127.0.0.1 unless told otherwise. One model loads on the engine thread after the socket
is up, so /health answers 503 until it is ready. Several models (--model repeated, or
--models-dir) are each served under its own name and load on their first request (router mode,
as llama-server's and Ollama's): see `_model_specs` for their names and how their KV budget is
split. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for at
most --drain-s seconds, then exits 0. A second SIGTERM or SIGINT during that drain ends it at
once (uvicorn's and vLLM's convention): in-flight streams get their error event, unary requests
a 503, and the process exits 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a
shell reports a process the signal killed, so a supervisor can tell a forced stop from a clean one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanoserve.config import EngineConfig
from nanoserve.errors import NanoserveError
from nanoserve_cli import options
from nanoserve_cli.app import app

if TYPE_CHECKING:
    from types import FrameType

    import uvicorn
    from fastapi import FastAPI

    from nanoserve.engine.core import Engine
    from nanoserve.multimodal.limits import ImageLimits
    from nanoserve.server.adapters import LoRAModule
    from nanoserve.server.bridges.models import ModelPolicy, ModelSpec
    from nanoserve.server.bridges.replicas import ReplicaPlan
    from nanoserve.server.tenants import Tenancy

API_KEY_ENV = "NANOSERVE_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_SEED = 2**63  # as nanoserve.sampling_params.MAX_SEED; the cli imports no engine code up front


def parse_seconds_or_off(value: str) -> float:
    """`off` (infinity), or seconds >= 0."""
    if value.strip().lower() == "off":
        return float("inf")
    try:
        seconds = float(value)
    except ValueError:
        raise typer.BadParameter(f"seconds >= 0, or off; got {value!r}") from None
    if not 0 <= seconds < float("inf"):
        raise typer.BadParameter(f"must be seconds >= 0, or off; got {value!r}")
    return seconds


@app.command()
@options.engine_options(omit=("model",))
def serve(
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", help="Hugging Face model directory, .gguf file, or hub id ORG/NAME[@REVISION] "
        "(a GGUF repository: ORG/NAME:FILE.gguf or ORG/NAME:Q4_K_M); default: SmolLM2-135M-Instruct. "
        "Repeatable: several models, each served under its name (a GGUF's file stem, a folder's name, "
        "a hub id) and loaded on its first request.")] = None,
    models_dir: Annotated[Path | None, typer.Option(
        help="Serve every model in DIR (each .gguf file and each folder with a config.json), beside "
             "any --model, each under its name and loaded on its first request.")] = None,
    max_loaded_models: Annotated[int | None, typer.Option(
        min=1, help="Several models only: most loaded at once (default 4, llama-server's); one more "
                    "unloads the least recently used idle one. The KV cache budget is split evenly "
                    "among this many (or the models, if fewer).")] = None,
    idle_unload_s: Annotated[float | None, typer.Option(
        parser=parse_seconds_or_off, metavar="SECONDS|off",
        help="Several models only: a model idle this long is unloaded (default 300, Ollama's keep-alive; "
             "a request's keep_alive on Ollama's API overrides it for that model); off: never.")] = None,
    model_wait_timeout_s: Annotated[float | None, typer.Option(
        min=0.0, help="Several models only: a request for a model that is not loaded, while "
                      "--max-loaded-models are and each has requests in flight, waits this long for "
                      "one to finish (default 60), then gets 503 saying so.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 exposes the server to the network.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="Name clients send as `model` (repeatable; the first is listed). Default: the model "
             "directory's name. One model only: several are each served under their own name.")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        help=f"Require 'Authorization: Bearer KEY' on /v1 and the tokenizer routes (or set ${API_KEY_ENV}). "
             "Repeatable: each key is a tenant, named api-key-1, api-key-2, ... in /metrics.")] = None,
    api_keys_file: Annotated[Path | None, typer.Option(
        help="A file of keys, one 'name key' a line (# comments), each a tenant of that name; re-read "
             "on SIGHUP (a file that no longer reads keeps the keys in use).")] = None,
    prefix_cache_scope: Annotated[str | None, typer.Option(
        help="tenant: no tenant's cached prefix serves another's (as if each sent its own cache_salt); "
             "shared: one cache for all. Default: tenant with more than one key, else shared.")] = None,
    max_concurrent_requests_per_tenant: Annotated[int | None, typer.Option(
        help="Generation requests one API key may have in flight; past it: 429 + Retry-After.")] = None,
    *,
    engine: options.EngineOptions,
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
    tool_call_parser: Annotated[str, typer.Option(
        help="How the model writes tool calls (vLLM's names): hermes, llama3_json, mistral, qwen3_coder, "
             "deepseek_v3, deepseek_v31; auto: from the chat template's markers (hermes when it has "
             'none). In tool_choice "auto" a call is grammar-constrained from its opening marker on.')]
    = "auto",
    lora_modules: Annotated[list[str] | None, typer.Option(
        help="A LoRA adapter to serve, name=path (a PEFT adapter folder or a GGUF LoRA file) or vLLM's "
             'JSON {"name": ..., "path": ..., "base_model_name": ...}; repeatable. A request picks it '
             "by `model`; /v1/models lists it with the base model as its parent.")] = None,
    enable_lora: Annotated[bool, typer.Option(
        "--enable-lora", help="Serve LoRA adapters (implied by --lora-modules and "
                              "--enable-lora-runtime-updates).")] = False,
    max_loras: Annotated[int, typer.Option(
        min=1, help="Most distinct LoRA adapters in one step; requests of others wait their turn.")] = 1,
    max_cpu_loras: Annotated[int | None, typer.Option(
        min=1, help="LoRA adapters kept loaded; beyond it the least recently used idle one is unloaded "
                    "(and loaded again on its next request). Default: max(--max-loras, 8).")] = None,
    max_lora_rank: Annotated[int, typer.Option(min=1, help="Highest LoRA rank an adapter may have.")] = 16,
    enable_lora_runtime_updates: Annotated[bool, typer.Option(
        "--enable-lora-runtime-updates", help="Serve POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (vLLM's): clients then load files by path; off: they answer 404.")] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error or critical.")] = "info",
    seed: Annotated[int | None, typer.Option(
        min=0, max=MAX_SEED - 1, help="Seed for requests that give none: the same requests, in the same "
                                      "order, then sample the same tokens. Default: a random seed each.")]
    = None,
    allowed_media_domains: Annotated[list[str] | None, typer.Option(
        help="A host whose http(s) image URLs the server fetches (repeatable; vLLM's name). Default: "
             "none, so images come as data: URLs only.")] = None,
    limit_mm_per_prompt: Annotated[str, typer.Option(
        help="Most images one prompt may carry: a count, or vLLM's JSON {\"image\": N}.")] = "8",
    max_image_pixels: Annotated[int, typer.Option(
        min=1, help="Most pixels (width x height) one image may have; larger ones are a 400.")] = 4096 * 4096,
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp", min=1,
        help="Serve from N engine processes (vLLM's data parallelism), each on its own share of the cores "
             "(--threads: each rank's threads) with its own KV and prefix cache; a request goes to the "
             "replica holding the longest cached prefix of its prompt, else the least loaded. Composes "
             "with -tp (-dp 2 -tp 2: four ranks).")] = 1,
) -> None:
    """Serve one model, or several (each under its name, loaded on demand), over OpenAI's
    completions, chat completions and Responses APIs and Anthropic's Messages API.

    Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
    POST /v1/messages, GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize
    (behind --api-key or --api-keys-file, each key a tenant), and GET /health,
    GET /metrics (Prometheus), GET /version, GET /docs (OpenAPI). Request fields the server does
    not honour are refused with a 400 naming them (README: "Request fields").
    """
    # Until uvicorn installs its own handlers, a stop signal leaves at once with 128 + its
    # number: Python's default SIGINT raises KeyboardInterrupt inside whatever import is running
    # (torch's C extensions turn it into another error and a traceback, exit 1).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: _exit_forced(number))
    import uvicorn

    from nanoserve.loading.default_model import resolve_model
    from nanoserve.server.app import DRAIN_GRACE_S, ServerLimits, build_app
    from nanoserve.server.connections import with_header_timeout
    from nanoserve.server.images import MediaPolicy
    from nanoserve.server.parsers.reasoning import ReasoningConfig
    from nanoserve.server.parsers.tool_formats import check_parser

    several = models_dir is not None or len(model or []) > 1
    engine = dataclasses.replace(engine, model=None if several else (model or [None])[0])
    tenancy = _tenancy(api_key, api_keys_file, prefix_cache_scope, max_concurrent_requests_per_tenant)
    try:
        reasoning = ReasoningConfig(reasoning_parser, reasoning_budget)
    except NanoserveError as error:
        options.fail_for(error)
    try:
        check_parser(tool_call_parser)
    except ValueError as error:
        options.fail(str(error))
    if log_level.lower() not in LOG_LEVELS:
        options.fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    modules = _lora_modules(lora_modules or [])
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        options.fail(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
    enable_lora = enable_lora or bool(modules) or enable_lora_runtime_updates
    if enable_lora and data_parallel_size > 1:
        options.fail("--lora-modules, --enable-lora and --enable-lora-runtime-updates are not served "
                     "with --data-parallel-size above 1 yet")
    policy = _model_policy(several, max_loaded_models, idle_unload_s, model_wait_timeout_s)
    if several:
        _check_one_model_options(served_model_name, enable_lora, data_parallel_size)
    image_limits = _image_limits(limit_mm_per_prompt, max_image_pixels)
    config = engine.config(enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                           max_cpu_loras=max_cpu_loras, image_limits=image_limits)
    replicas = _replica_plan(config, data_parallel_size)
    # Logging first: resolving the model may download or convert it, and says so as it starts.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options.serve_as_torchrun_rank(config)
    if several:
        specs = _model_specs(model or [], models_dir, engine, policy.max_loaded, image_limits)
    else:
        try:
            source = resolve_model(engine.model, float_weights=False)  # for its name: no weights converted
        except NanoserveError as error:
            options.fail_for(error)
        names = list(served_model_name or [_served_name(engine.model, source.dir, source.gguf)])
        aliases = (engine.model,) if engine.model else ()
        _check_lora_modules(modules, source.dir, names, aliases, max_lora_rank)
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_n=max_n, max_prompts=max_prompts,
                          max_tokens=max_tokens_limit, max_top_logprobs=max_top_logprobs,
                          max_waiting=max_waiting, trust_request_chat_template=trust_request_chat_template,
                          media=MediaPolicy(frozenset(allowed_media_domains or ())))
    engine_deaths: list[BaseException] = []

    def stop_on_engine_death(error: BaseException) -> None:
        engine_deaths.append(error)
        server.should_exit = True  # uvicorn's own exit path: stop accepting, close, return

    common = {"tenancy": tenancy, "limits": limits, "seed": seed, "reasoning": reasoning,
              "tool_call_parser": tool_call_parser}
    if several:
        server_app = build_app(models=specs, model_policy=policy, **common)
    else:
        server_app = build_app(lambda: _build_engine(config), model_names=names, aliases=aliases,
                               on_engine_death=stop_on_engine_death, replicas=replicas, lora_modules=modules,
                               lora_runtime_updates=enable_lora_runtime_updates, **common)
    uvicorn_config = uvicorn.Config(server_app, host=host, port=port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S, access_log=False,
                                    http=with_header_timeout(header_timeout_s))
    server = _draining_server(uvicorn_config, server_app, drain_s)
    # uvicorn re-raises the signal it caught once it has drained; make that a no-op so the
    # process leaves through the normal exit path with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if api_keys_file is not None:
        from nanoserve.server.app import reload_keys

        signal.signal(signal.SIGHUP, lambda *_: reload_keys(server_app))
    server.run()
    if server.forced_by is not None:
        _exit_forced(server.forced_by)
    if engine_deaths:  # a model that cannot load is the user's to fix: exit 2 naming it
        error = engine_deaths[0]
        if isinstance(error, NanoserveError):
            options.fail_for(error)
        typer.secho(f"Error: the engine stopped: {error!r} (the log above has the traceback)", err=True,
                    fg=typer.colors.RED)
        raise typer.Exit(code=1)


def _model_policy(several: bool, max_loaded: int | None, idle_unload_s: float | None,
                  wait_timeout_s: float | None) -> ModelPolicy | None:
    """When several models load and unload (the defaults where not given); None with one model,
    where giving any of these exits 2: one model is loaded for good."""
    given = {"max_loaded": max_loaded, "idle_unload_s": idle_unload_s, "wait_timeout_s": wait_timeout_s}
    given = {name: value for name, value in given.items() if value is not None}
    if not several:
        if given:
            options.fail("--max-loaded-models, --idle-unload-s and --model-wait-timeout-s apply to several "
                         "models (--model repeated, or --models-dir); one model is loaded for good")
        return None
    from nanoserve.server.bridges.models import ModelPolicy

    return ModelPolicy(**given)


def _check_one_model_options(served_model_name: list[str] | None, enable_lora: bool,
                             data_parallel_size: int) -> None:
    """Exit 2 naming an option that serves one model only, given beside several."""
    if served_model_name:
        options.fail("--served-model-name names one model; with several (--model repeated, or "
                     "--models-dir) each is served under its own name")
    if enable_lora:
        options.fail("--lora-modules, --enable-lora and --enable-lora-runtime-updates are not served "
                     "beside several models yet")
    if data_parallel_size > 1:
        options.fail("--data-parallel-size above 1 is not served beside several models yet")


def _model_specs(values: list[str], models_dir: Path | None, engine: options.EngineOptions,
                 max_loaded: int, image_limits: ImageLimits | None = None) -> tuple[ModelSpec, ...]:
    """The several models to serve: each --model, then each model in --models-dir, under its
    name (`_served_name`: a GGUF's file stem, a folder's name, a hub id); a --model's own
    spelling is accepted too. Exit 2 naming the option on a model that cannot be found or on
    two models of one name. Nothing loads here.

    The KV budget rule: the budget one engine would get (--kv-cache-gb, or a share of the free
    memory read as it loads, capped on the CPU) is split evenly among the engines that may be
    loaded at once, min(--max-loaded-models, number of models), so they fit side by side."""
    from nanoserve.loading.default_model import resolve_model
    from nanoserve.server.bridges.models import ModelSpec

    given = [(value, "--model") for value in values]
    given += [(str(path), "--models-dir") for path in _models_in(models_dir)] if models_dir else []
    share = min(max_loaded, len(given))
    kv_budget = ({"kv_cache_gb": engine.kv_cache_gb / share} if engine.kv_cache_gb is not None
                 else {"kv_cache_fraction": EngineConfig().kv_cache_fraction / share})
    specs, taken = [], {}
    for value, option in given:
        try:
            source = resolve_model(value, float_weights=False)  # for its name: no weights converted
        except NanoserveError as error:
            options.fail(f"{option}: {error}")
        name = _served_name(value, source.dir, source.gguf)
        aliases = (value,) if value != name else ()
        for spelling in (name, *aliases):
            if spelling in taken:
                options.fail(f"{option}: two models are served as {spelling!r} ({taken[spelling]} and "
                             f"{value}); serve one of them from elsewhere or under another file name")
            taken[spelling] = value
        images = {} if image_limits is None else {"image_limits": image_limits}  # None: the default limits
        config = engine.config(model=value, **kv_budget, **images)
        specs.append(ModelSpec((name,), functools.partial(_build_engine, config), aliases, config))
    return tuple(specs)


def _models_in(models_dir: Path) -> list[Path]:
    """Every model in `models_dir`: each .gguf file and each folder with a config.json (hidden
    entries skipped), in name order; exit 2 naming --models-dir when there is none."""
    if not models_dir.is_dir():
        options.fail(f"--models-dir {models_dir} is not a directory")
    found = sorted(path for path in models_dir.iterdir() if not path.name.startswith(".") and (
        (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file()))
    if not found:
        options.fail(f"--models-dir {models_dir} holds no model: no .gguf file and no folder with a "
                     "config.json")
    return found


def _image_limits(limit_mm_per_prompt: str, max_image_pixels: int) -> ImageLimits:
    """`--limit-mm-per-prompt` (a count or vLLM's {"image": N}) and `--max-image-pixels`, or exit 2."""
    from nanoserve.multimodal.limits import ImageLimits

    try:
        value = json.loads(limit_mm_per_prompt)
    except ValueError:
        value = None
    if isinstance(value, dict) and set(value) == {"image"}:
        value = value["image"]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        options.fail(f'--limit-mm-per-prompt must be a count >= 0 or {{"image": N}}; got '
                     f"{limit_mm_per_prompt!r}")
    return ImageLimits(max_images_per_prompt=value, max_pixels=max_image_pixels)


def _replica_plan(config: EngineConfig, size: int) -> ReplicaPlan | None:
    """The data-parallel replicas to start (None: one engine in this process), or exit 2 naming
    --data-parallel-size."""
    if size == 1:
        return None
    from nanoserve.server.bridges.replicas import ReplicaPlan

    plan = ReplicaPlan(config, size)
    try:
        plan.check()
    except NanoserveError as error:
        options.fail_for(error)
    return plan


def _tenancy(api_keys: list[str] | None, keys_file: Path | None, cache_scope: str | None,
             max_per_tenant: int | None) -> Tenancy:
    """The keys and what the server keeps apart between them, or exit 2 naming what is wrong."""
    from nanoserve.server.tenants import Tenancy, TenancyError, tenants_from_options

    option = "--api-key"
    if not api_keys and API_KEY_ENV in os.environ:  # read here: click reads an empty one as unset
        api_keys, option = [os.environ[API_KEY_ENV]], f"--api-key (or ${API_KEY_ENV})"
    try:
        return Tenancy(tuple(tenants_from_options(api_keys or [], option)), keys_file, cache_scope,
                       max_per_tenant)
    except TenancyError as error:
        options.fail(str(error))


def _lora_modules(entries: list[str]) -> tuple[LoRAModule, ...]:
    """The --lora-modules entries, or exit 2 naming the one that does not parse."""
    from nanoserve.server.adapters import parse_lora_module

    try:
        modules = tuple(parse_lora_module(entry) for entry in entries)
    except ValueError as error:
        options.fail(f"invalid value for --lora-modules: {error}")
    return modules


def _check_lora_modules(modules: tuple[LoRAModule, ...], model_dir: Path, names: list[str],
                        aliases: tuple[str, ...], max_rank: int) -> None:
    """Each adapter read whole and checked against the model's config before the model loads:
    exit 2 naming --lora-modules (the engine reads them again when it starts)."""
    from nanoserve.errors import InvalidRequestError
    from nanoserve.loading.adapters import read_adapter
    from nanoserve.loading.weights import read_config
    from nanoserve.server.adapters import AdapterRegistry

    if not modules:
        return
    try:
        AdapterRegistry(frozenset((*names, *aliases)), names[0], modules)
        model_config = read_config(model_dir)
        for module in modules:
            read_adapter(module.path, model_config, max_rank)
    except InvalidRequestError as error:
        options.fail(f"invalid value for --lora-modules: {error.message}")
    except NanoserveError as error:
        options.fail_for(error)


def _draining_server(config: uvicorn.Config, server_app: FastAPI, drain_s: float) -> uvicorn.Server:
    """uvicorn, plus: the first SIGTERM or SIGINT starts the app's bounded drain, a second one
    ends it at once (`forced_by` names that signal)."""
    import uvicorn

    from nanoserve.server.app import start_drain, stop_now

    class DrainingServer(uvicorn.Server):
        forced_by: int | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                start_drain(server_app, drain_s)
                super().handle_exit(sig, frame)
                return
            # Not uvicorn's own: it forces only on a second SIGINT, and then cuts every stream
            # without its error event.
            if self.forced_by is None:
                self.forced_by = sig
                logging.getLogger("nanoserve.server").warning(
                    "second %s: stopping now, in-flight requests end with an error", signal.Signals(sig).name)
                if stop_now(server_app, then=self.force):
                    return
            self.force()

        def force(self) -> None:
            self.force_exit = True

    return DrainingServer(config)


def _exit_forced(sig: int) -> None:
    """Leave at once with 128 + the signal's number. Not through interpreter shutdown: the
    engine thread may be in the middle of a step in native code, and it dies with the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + sig)


def _served_name(model: str | None, model_dir: Path, gguf: Path | None = None) -> str:
    """What clients call the model: a hub id as given (its snapshot folder is a commit hash),
    else a GGUF's file name without `.gguf` (as llama.cpp's server names it; its folder here
    is a cache entry), else the checkpoint's folder name."""
    from nanoserve.loading.hub import parse_hub_id

    if model and not Path(model).exists() and (hub_id := parse_hub_id(model)) is not None:
        return hub_id.repo_id
    if gguf is not None:
        return gguf.stem
    return model_dir.name


def _build_engine(config: EngineConfig) -> Engine:
    """The engine of `config` as the user gave it: the engine resolves the model itself (a
    resolved folder alone would lose what it was resolved from, such as a GGUF file whose
    blocks `--dtype auto` runs)."""
    from nanoserve.engine.core import Engine

    return Engine(config)
