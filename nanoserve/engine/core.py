"""The step loop: add_request / step / abort over the ranks the executor starts
(`engine.executor`: weights, kernel choice, KV cache, the workers; `Engine` holds it, the
scheduler and the output processor).

Each step, one readback (a draft model's drafts too come back in it):

    schedule   drafts proposed for each decoding request (prompt lookup, `spec_decode`, or the
               draft model's K greedy forwards, `draft_model`, whose picks stay on the device),
               then `Scheduler.schedule`:
               which requests, how many tokens, drafts as extra rows
    prepare    flat input ids, positions, cache slots; decode rows (drafts too) in one group;
               a token still pending from the step in flight, and a draft model's drafts, are
               copied in on the device
    forward    logits of every sampled row: a decode's newest token and each of its drafts
               (and of each prompt row a prompt_logprobs request scores, read back with them)
    sample     one token per row on the device, row i of a drafting request keyed and penalized
               as if drafts[:i] were already its output
    collect    the readback (with a draft model's drafts beside the tokens they are checked
               against); per request, the run the verification accepts (drafts equal to
               what was sampled, then the first that differs), judged token by token by the
               stop rules; then `Scheduler.update_after_step` (tokens appended, accepted drafts
               computed, rejected drafts' blocks freed)

Deferred output (`async_scheduling`, vLLM's --async-scheduling) reorders the same phases:
`step()` launches step N+1 (schedule .. sample; `Scheduler.commit` counts its tokens computed
and its new tokens pending) and only then collects step N, whose tokens were copied to the host
behind its own kernels, so on a GPU the host's stop rules and text for step N run while step
N+1 computes. Without it, `step()` launches and collects the same step:

    call k:   [schedule prepare forward sample](N+1)   [collect](N)     -> outputs of step N
    off:      [schedule prepare forward sample](N)     [collect](N)     -> outputs of step N

Step N+1's decode inputs for step N's tokens come from step N's device tensor, never a host
list. A request step N ends by a stop token or string was scheduled once too often: its row in
step N+1 is discarded at collect (its request is no longer the live one of that id), and its
blocks were freed when step N finished it. One ending by max_tokens is known ahead and not
scheduled again. A step is collected at once, even with deferred output on, when a request it
samples needs its new token on the host before its next step (`needs_token_on_host`): with
speculation on (drafts come from the tokens), a grammar (its matcher takes each token), or a
penalty or bad word that counts the output. On CPU, kernels run in the calling thread, so
there step N+1's forward and sampling run in one forward thread while the caller collects
step N (torch releases the GIL inside its kernels; the host's bookkeeping touches no tensor the
forward uses), and `step()` returns when both are done. Deferred output is off by default on
every device (`ASYNC_SCHEDULING_DEFAULT`) until a side-by-side measurement shows it pays.

Every phase's time and readbacks are counted in `EngineStats` (with deferred output, the
discarded overshoot rows and the readbacks made with no later step launched), so `profile`
reads them without touching the engine. `LLM` (llm.py) is the offline and streaming front
over this class. `add_request` admits through the engine's `admission` (`admission.InputProcessor`,
the checks and input preparation the server's front runs too), then queues the request.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function

from nanoserve import __version__, native
from nanoserve.config import ASYNC_SCHEDULING_DEFAULT, EngineConfig
from nanoserve.engine.admission import InputProcessor
from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.draft_model import DraftModel
from nanoserve.engine.executor import Executor, check_start
from nanoserve.engine.images import EngineImages, ImageData
from nanoserve.engine.model_runner import DeviceDrafts, ModelRunner, PreparedStep
from nanoserve.engine.output import HostTokens, OutputProcessor, ReadbackCounter, RequestOutput, TokenBatch
from nanoserve.engine.prefix_store import PrefixStore, check_prefix_cache_dir, checkpoint_identity
from nanoserve.engine.proposers import Drafter, DraftModelProposer, NgramProposer
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.spec_decode import (
    MAX_SPECULATIVE_TOKENS,
    SpecConfig,
    accepted_prefix,
)
from nanoserve.engine.structured import GrammarCompiler
from nanoserve.errors import InvalidRequestError
from nanoserve.loading.adapters import read_adapter
from nanoserve.loading.default_model import ModelSource, resolve_model
from nanoserve.loading.pooling import checkpoint_pooling
from nanoserve.loading.weights import load_weights, read_config
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.linear import KERNELS, QUANTIZED_KERNELS, LinearKernel, left_out
from nanoserve.model.lora import Adapter, AdapterSet, LoRARequest, load_adapter
from nanoserve.multimodal.inputs import ImageInput
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.worker.startup import Startup

log = logging.getLogger("nanoserve")

PHASES = ("schedule", "prepare", "forward", "sample", "collect")


@dataclass(slots=True)
class EngineStats:
    """Counters since start; per-phase seconds and readbacks summed over steps."""

    steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Speculative decoding: drafts verified, drafts accepted, tokens emitted by drafting rows.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    # Deferred output: sampled rows of requests already finished when their step was resolved
    # (the one step too many), and readbacks made with no later step launched ahead of them.
    discarded_tokens: int = 0
    blocking_readbacks: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    phase_readbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))

    @property
    def total_s(self) -> float:
        return sum(self.phase_s.values())


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        """Check the options (`Startup.decide`: device, dtype, threads, the checkpoint; then the
        tokenizer, the task and a draft model), start every rank (the executor: rank 0 here,
        the others' workers with tensor parallelism), then the scheduler, the runner and the
        output processor."""
        self.config = config
        check_prefix_cache_dir(config)
        self.spec = SpecConfig.from_engine(config)
        self.spec.check(draft_model=config.draft_model)
        startup = Startup.decide(config)
        self.device, self.dtype, self.threads = startup.device, startup.dtype, startup.threads
        self.native_summary = startup.native_summary
        self.weight_notes = startup.notes  # start-up lines on how the weights were loaded
        self.source = startup.source
        self.model_dir = self.source.dir
        self.startup_phases = startup.phases  # how long each phase of this start took
        with startup.phases.timed("tokenizer"):
            self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.pooling_method = config.pooling or checkpoint_pooling(self.model_dir) or "last"
        if config.task == "generate" and not read_config(self.model_dir).has_lm_head:
            raise InvalidRequestError(
                f"{self.model_dir} is a base-model checkpoint with no output head (an embedding model): it "
                "can only pool; start it with task 'embed' (--task embed)", param="task")
        self.draft_source = self._resolve_draft_model() if self.spec.method == "draft" else None
        self.executor = Executor(config, startup)
        try:
            with startup.phases.timed("scheduler and runner"):
                self._build_above_the_ranks()
            log.info(startup.phases.summary)
        except BaseException:
            self.executor.close()
            raise

    def _build_above_the_ranks(self) -> None:
        """What rank 0 holds over the ranks the executor started: the draft model, the block pool,
        the scheduler, the runner, the adapters, the output processor, the step's state."""
        config, executor = self.config, self.executor
        self.tp = executor.group
        self.model_config, self.weights_nbytes = executor.model_config, executor.weights_nbytes
        self.weight_format, self.kernel_choice = executor.weight_format, executor.kernel_choice
        self.max_model_len = executor.plan.max_positions
        # With tensor parallelism, `model` is rank 0's shard (its config the shard's) and the
        # runner's model is every rank's (`ShardedModel`).
        self.model, self.kv_cache = executor.model, executor.kv_cache
        num_blocks = executor.plan.num_blocks
        self.draft = self._load_draft_model(self.draft_source, num_blocks) if self.draft_source else None
        self.drafter = self._drafter()
        self.pool = BlockPool(num_blocks, config.block_size)
        self.prefix_store = self._open_prefix_store()
        self.scheduler = Scheduler(
            config.scheduler_config(max_model_len=self.max_model_len, kv_window=self.model_config.kv_window,
                                    device_type=self.device.type),
            self.pool, cold=self.prefix_store,
        )
        # A vision-language model's image side (None: text only). An image token the vocabulary
        # lacks takes the first id that neither the model nor the tokenizer holds.
        self.images = EngineImages.load(self.model_dir, config.image_limits, dtype=self.dtype,
                                        device=self.device, kernel=self.kernel_choice.kernel,
                                        threads=self.threads,
                                        mmproj=Path(config.mmproj) if config.mmproj else None,
                                        token_id=self.tokenizer.backend.token_to_id,
                                        id_outside_vocab=max(self.vocab_size, self.tokenizer.vocab_size))
        self._check_image_fits_a_step()
        self.runner = ModelRunner(executor.runner_model, self.kv_cache,
                                  eos_token_ids=self.tokenizer.eos_token_ids, device=self.device,
                                  image_embeddings=None if self.images is None else self.images.embeddings)
        self.loras = self._adapter_set()
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), vocab_size=self.vocab_size,
                                        eos_token_ids=self.tokenizer.eos_token_ids)
        # The checks and preparation of a request's inputs, over this engine's facts.
        self.admission = InputProcessor(self.tokenizer, self.grammars, vocab_size=self.vocab_size,
                                        max_model_len=self.max_model_len, num_blocks=self.pool.num_blocks,
                                        block_size=self.pool.block_size, task=config.task,
                                        pooling_method=self.pooling_method,
                                        hidden_size=self.model_config.hidden_size,
                                        tensor_parallel=self.tp is not None, images=self.images)
        self.readbacks = ReadbackCounter()
        self.stats = EngineStats()
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else ASYNC_SCHEDULING_DEFAULT.get(self.device.type, False))
        self._in_flight: LaunchedStep | None = None  # deferred output: launched, not yet resolved
        # Deferred output on CPU: one thread runs a step's forward while the caller collects the last.
        self._forward_thread = (ThreadPoolExecutor(1, thread_name_prefix="nanoserve-forward")
                                if self.async_scheduling and self.device.type == "cpu" else None)
        # Profiling only: wait for the GPU at each phase's end so its time lands in that phase,
        # and name each phase in a torch.profiler trace (a few microseconds a phase).
        self.sync_phases = False
        self.label_phases = False
        self._ids = itertools.count()
        log.info(self.native_summary)
        for note in self.weight_notes:
            log.info(note)
        log.info(self.kernel_summary)
        log.info(self.kv_cache_summary)

    def _check_image_fits_a_step(self) -> None:
        """A bidirectional image is computed in one step (`scheduler.whole_images`): refuse a step
        budget it cannot fit, as vLLM refuses one below its largest multimodal item."""
        vision = self.images.encoder.config if self.images is not None else None
        budget = self.scheduler.config.max_num_batched_tokens
        if vision is not None and vision.bidirectional and budget < vision.rows_per_tile:
            raise InvalidRequestError(f"max_num_batched_tokens is {budget}; this model's images are "
                                      f"{vision.rows_per_tile} tokens each, computed in one step: raise it "
                                      f"to at least {vision.rows_per_tile}", param="max_num_batched_tokens")

    def close(self) -> None:
        """Write the prefix cache's blocks to its directory (if it has one) and stop the
        tensor-parallel workers (a no-op with one rank); the engine takes no step after."""
        if self.prefix_store is not None:
            self.prefix_store.close()
        self.executor.close()

    def _open_prefix_store(self) -> PrefixStore | None:
        """The prefix cache's disk tier (`--prefix-cache-dir`), under a namespace of everything
        that decides a block's bits; it hears of the pool's evictions."""
        config = self.config
        if config.prefix_cache_dir is None:
            return None
        source = self.source
        files = ([source.gguf] if source.gguf is not None
                 else [*sorted(source.dir.glob("*.safetensors")), source.dir / "config.json"])
        shape = self.model_config
        identity = {"nanoserve": __version__, "checkpoint": checkpoint_identity(files),
                    "dtype": str(self.dtype), "quantize": config.quantize,
                    "weight_format": self.weight_format, "linear_kernel": self.kernel_choice.kernel.name,
                    "kv_cache_dtype": self.kv_cache.cache_dtype,
                    "block_size": config.block_size, "batch_invariant": config.batch_invariant,
                    "native": native.library() is not None, "device": self.device.type,
                    "shape": [shape.num_layers, shape.num_kv_heads, shape.head_dim]}
        store = PrefixStore(Path(config.prefix_cache_dir), identity,
                            int(config.prefix_cache_dir_max_gb * 1e9), self.kv_cache)
        self.pool.on_evict = store.save
        store.keyed_blocks = self.pool.cached_blocks
        return store

    def _adapter_set(self) -> AdapterSet | None:
        config = self.config
        if not config.enable_lora:
            return None
        if self.tp is not None:
            raise InvalidRequestError("LoRA adapters are not supported with tensor parallelism yet",
                                      param="enable_lora")
        return AdapterSet(config.max_loras, config.max_lora_rank, config.max_cpu_loras)

    def add_lora(self, lora_request: LoRARequest) -> Adapter:
        """Load an adapter (vLLM's add_lora), checked whole against the base model first; the one
        loaded already when its name, id and path match. Beyond max_cpu_loras the least recently
        used adapter no live request holds is unloaded."""
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora)",
                                      param="lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest; got {lora_request!r}",
                                      param="lora_request")
        kernel = self._adapter_kernel()
        in_use = [request.adapter for request in self.requests.values() if request.adapter is not None]
        return self.loras.add(lora_request, lambda request, serial: load_adapter(
            request, read_adapter(request.lora_path, self.model_config, self.loras.max_lora_rank),
            self.model_config, serial=serial, pack=functools.partial(kernel.pack, threads=self.threads),
            matmul=functools.partial(kernel.apply, threads=self.threads), dtype=self.dtype,
            device=self.device, native=self.model.native_lora), in_use)

    def _adapter_kernel(self) -> LinearKernel:
        """The kernel of adapters' float matrices: the model's, unless that one runs GGUF blocks
        (floats then take its torch fallback, many times slower per call than the native float
        kernel; results/bench_lora.csv); then the native float kernel where it runs here."""
        kernel = self.kernel_choice.kernel
        if kernel.name in QUANTIZED_KERNELS and self.device.type == "cpu" and "native" not in left_out(
                self.device) and self.dtype in (torch.float32, torch.bfloat16):
            return KERNELS["native"]
        return kernel

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; requests running with it keep it until they finish."""
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters", param="lora_name")
        self.loras.remove(name)

    def list_loras(self) -> list[Adapter]:
        return [] if self.loras is None else list(self.loras.adapters.values())

    def _drafter(self) -> Drafter | None:
        if not self.spec.enabled:
            return None
        proposer = (DraftModelProposer(self.draft) if self.draft is not None
                    else NgramProposer(vocab_size=self.vocab_size))
        return Drafter(self.spec, proposer)

    def _resolve_draft_model(self) -> ModelSource:
        """The draft model's checkpoint, refused before any weights load unless its vocabulary
        is the model's."""
        source = resolve_model(self.config.draft_model)
        draft_vocab, vocab = read_config(source.dir).vocab_size, read_config(self.model_dir).vocab_size
        if draft_vocab != vocab:
            raise InvalidRequestError(
                f"the draft model {self.config.draft_model} has a vocabulary of {draft_vocab} tokens and the "
                f"model {vocab}: a draft must share the model's tokenizer", param="draft_model")
        return source

    def _load_draft_model(self, source: ModelSource, num_blocks: int) -> DraftModel:
        """The draft model of speculative_method 'draft', in the model's dtype and kernel, with a
        KV cache of as many blocks as the model's (smaller, as the model is) plus room for each
        sequence's drafts."""
        cfg = self.config
        check_start("the draft model loads")
        draft_config, weights = load_weights(source.dir, dtype=self.dtype, device=self.device)
        max_positions = self.max_model_len + MAX_SPECULATIVE_TOKENS
        model = DecoderLM(draft_config, weights, batch_invariant=cfg.batch_invariant,
                          linear_kernel=self.kernel_choice.kernel, max_positions=max_positions,
                          threads=self.threads)
        blocks = num_blocks + cfg.max_num_seqs * (-(-MAX_SPECULATIVE_TOKENS // cfg.block_size) + 1)
        kv_cache = KVCache(draft_config, blocks, cfg.block_size, self.dtype, self.device)
        runner = ModelRunner(model, kv_cache, eos_token_ids=self.tokenizer.eos_token_ids, device=self.device)
        log.info(f"draft model: {source.dir.name}, {weights.nbytes() / 1e6:.1f} MB, {blocks} KV blocks")
        return DraftModel(runner, BlockPool(blocks, cfg.block_size))

    @property
    def kernel_summary(self) -> str:
        choice = self.kernel_choice
        mode = "batch-invariant" if self.config.batch_invariant and choice.batch_invariant else "plain"
        cached = ", cached verdict" if choice.from_cache else ", measured at this start"
        return (f"linear kernel: {choice.kernel.name} ({mode} forward, {self.threads} threads{cached}): "
                f"{choice.reason}")

    @property
    def kv_cache_summary(self) -> str:
        blocks, size = self.kv_cache.num_blocks, self.kv_cache.block_size
        return (f"KV cache: {blocks} blocks x {size} tokens = {blocks * size} tokens "
                f"({self.kv_cache.nbytes / 2**30:.2f} GiB, {self.kv_cache.cache_dtype} "
                f"on {self.device})")

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every live request by id: the scheduler's registry, the only one."""
        return self.scheduler.requests

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, parent_id: str | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None,
                    images: Sequence[ImageData] | Sequence[ImageInput] | None = None) -> str:
        """Queue a request; `parent_id` names the client request it is one choice of (the
        scheduler's fair share divides steps between parents; None: a parent of its own);
        `lora_request` the adapter it runs with (loaded now if it is not resident); `pooling`
        makes it an embedding request: its prompt is computed, pooled into one vector (its one
        output) and it ends, sampling nothing (`params` then give only its priority and cache salt);
        `images` the files (bytes) or PIL images a vision-language model's text prompt places, one
        per placeholder (`<image>` for SmolVLM)."""
        admitted = self.admission.process(prompt, params, pooling, images)
        adapter = self.add_lora(lora_request) if lora_request is not None else None
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_ids, params = admitted.prompt_ids, admitted.params
        text = admitted.pooling is None  # an embedding request has no text
        output_state = self.outputs.new_state(params, prompt_ids) if text else None
        spec = params.structured_outputs
        grammar = self.grammars.new_grammar(spec) if spec is not None else None
        request = Request(request_id, prompt_ids, params, admitted.seed, parent_id=parent_id,
                          output_state=output_state, grammar=grammar, adapter=adapter,
                          pooling=admitted.pooling, images=admitted.images)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt_ids)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        if self.drafter is not None:
            self.drafter.proposer.release(self.requests)
        return self.outputs.aborted(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then resolve the one in flight (deferred output), or this one.

        Returns the outputs resolved in this call: with deferred output, those of the step
        launched by the previous call.
        """
        timer = PhaseTimer(self.stats, self.readbacks, sync_cuda=self.sync_phases, label=self.label_phases)
        in_flight, self._in_flight = self._in_flight, None
        start_s = time.perf_counter()
        launched = self._launch(timer, in_flight)
        outputs = []
        if in_flight is not None:
            outputs += self._resolve(timer, in_flight, next_launched=launched is not None)
        if launched is not None:
            launched.wait()
            if launched.deferred:
                self._in_flight = launched
            else:
                outputs += self._resolve(timer, launched, next_launched=False)
            self._pace_prefill(launched.plan, time.perf_counter() - start_s)
        return outputs

    def _pace_prefill(self, plan: SchedulerOutput, step_s: float) -> None:
        """Report a step of prompt chunks and nothing else (a lone prefill) to the prefill pace:
        what a step of prompt tokens costs this machine, measured, not assumed. With deferred
        output the call also collected the step before: an overestimate, so smaller steps."""
        pace = self.scheduler.pace
        if pace is not None and all(not chunk.is_decode for chunk in plan.chunks):
            pace.observe([(chunk.start, chunk.num_tokens) for chunk in plan.chunks], step_s)

    def _launch(self, timer: PhaseTimer, in_flight: LaunchedStep | None) -> LaunchedStep | None:
        """Schedule, prepare, forward and sample a step; its tokens stay on the device. On CPU,
        when a step is in flight to be collected meanwhile, the forward and sampling run in the
        forward thread (torch releases the GIL inside its kernels)."""
        with timer("schedule"):
            device_drafts = self._propose_drafts()
            plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        with timer("prepare"):
            prepared = self.runner.prepare(plan.chunks, in_flight.tokens if in_flight is not None else None,
                                           device_drafts)
        step = LaunchedStep(plan, deferred=self._defers(plan))
        if step.deferred:
            self.scheduler.commit(plan)
        self._count_step(plan)
        if step.deferred and in_flight is not None and self._forward_thread is not None:
            # Its own timer: phase seconds only, as the readbacks meanwhile are the collector's.
            worker_timer = PhaseTimer(self.stats, None, sync_cuda=False, label=self.label_phases)
            step.computing = self._forward_thread.submit(self._compute, worker_timer, prepared, True)
        else:
            step.tokens = self._compute(timer, prepared, step.deferred)
        return step

    def _compute(self, timer: PhaseTimer, prepared: PreparedStep, deferred: bool) -> TokenBatch | None:
        with timer("forward"):
            forwarded = self.runner.forward(prepared)
        with timer("sample"):
            tokens = self.runner.sample(forwarded, prepared)
            if deferred and tokens is not None:
                tokens.start_readback()
        return tokens

    def _defers(self, plan: SchedulerOutput) -> bool:
        """Whether a step is resolved one step late: only with deferred output on, and only if
        no request it samples needs its new token on the host before its next step."""
        return self.async_scheduling and not any(
            needs_token_on_host(chunk.request, self.spec) for chunk in plan.chunks if chunk.samples)

    def _resolve(self, timer: PhaseTimer, step: LaunchedStep, *, next_launched: bool) -> list[RequestOutput]:
        with timer("collect"):
            if not next_launched and step.tokens is not None:
                self.stats.blocking_readbacks += 1
            return self._collect(step.plan, step.tokens)

    def _propose_drafts(self) -> DeviceDrafts | None:
        """This step's drafts for every decoding request (`engine.proposers`)."""
        return self.drafter.propose(self.scheduler.running) if self.drafter is not None else None

    def _collect(self, plan: SchedulerOutput, token_batch: TokenBatch | None) -> list[RequestOutput]:
        """The step's one readback; each request's run (one token, or a verified speculative
        run) judged by the stop rules token by token; then the update."""
        host = token_batch.to_host(self.readbacks) if token_batch is not None else HostTokens([], [], [])
        drafts = {chunk.request.request_id: chunk.draft_ids for chunk in plan.chunks if chunk.draft_ids}
        drafts.update(host.drafts)  # a draft model's, seen here first
        for request_id, draft_ids in host.drafts.items():
            self.drafter.proposer.confirm(request_id, draft_ids)
        planned = {chunk.request.request_id: chunk.request for chunk in plan.chunks if chunk.samples}
        for scored in host.prompt:  # before the runs: a request's first output carries them
            request = self.requests.get(scored.request_id)
            if request is None:  # aborted while its step was in flight (deferred output)
                continue
            request.prompt_logprobs[scored.position] = scored.entry.narrowed(request.params.prompt_logprobs)
        new_tokens, outputs = [], []
        for request_id, token_ids, logprobs in host.runs():
            if request_id not in planned:
                raise RuntimeError(f"a sampled row names {request_id!r}, which its step does not sample")
            request = planned[request_id]
            if self.requests.get(request_id) is not request:
                # Finished (or aborted) after this step was launched: the overshoot of deferred
                # output. The id may even be a new request's by now: the token is nobody's.
                self.stats.discarded_tokens += len(token_ids)
                continue
            if request_id in drafts:
                token_ids, logprobs = self._verified(request, drafts[request_id], token_ids, logprobs)
            judged, output = self.outputs.judge_run(request, token_ids, logprobs)
            new_tokens += judged
            outputs.append(output)
        outputs += self._pooled_outputs(plan, host.pooled)
        self.scheduler.update_after_step(plan, new_tokens)
        for output in outputs:
            if output.embedding is not None:  # its blocks registered for the prefix cache first
                self.scheduler.finish(self.requests[output.request_id], RequestStatus.FINISHED_STOPPED)
        self.stats.generation_tokens += len(new_tokens)
        if self.drafter is not None:
            self.drafter.proposer.release(self.requests)
        return outputs

    def _pooled_outputs(self, plan: SchedulerOutput, pooled: dict[str, list[float]]) -> list[RequestOutput]:
        """Each embedding request's vector, pooled by this step; one aborted while its step was in
        flight (deferred output) gets none."""
        planned = {chunk.request.request_id: chunk.request for chunk in plan.chunks if chunk.pools}
        return [self.outputs.pooled(planned[request_id], vector) for request_id, vector in pooled.items()
                if self.requests.get(request_id) is planned[request_id]]

    def _verified(self, request: Request, drafts: tuple[int, ...], token_ids: list[int],
                  logprobs: list) -> tuple[list[int], list]:
        """The run a verification emits: the accepted drafts, then the first token that
        differs (or the one after the last draft)."""
        accepted = accepted_prefix(drafts, token_ids)
        if request.draft_state is not None:
            request.draft_state.record(len(drafts), accepted)
        self.stats.spec_draft_tokens += len(drafts)
        self.stats.spec_accepted_tokens += accepted
        self.stats.spec_emitted_tokens += accepted + 1
        return token_ids[:accepted + 1], logprobs[:accepted + 1]

    def _count_step(self, plan: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.prompt_tokens += sum(
            max(0, min(c.start + c.num_tokens, len(c.request.prompt_ids)) - c.start)
            for c in plan.chunks)
        if all(chunk.is_decode for chunk in plan.chunks):
            self.stats.decode_steps += 1

    @torch.inference_mode()
    def prompt_logits(self, prompts: Sequence[str | Sequence[int]],
                      images: Sequence[Sequence[ImageData]] | None = None) -> torch.Tensor:
        """Last-position float32 logits of each prompt (with `images[i]` its images), computed alone
        (for parity and benches)."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits runs each prompt alone; the engine has requests in flight")
        rows = []
        for index, prompt in enumerate(prompts):
            request_id = self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                          images=images[index] if images is not None else None)
            captured = self._run_prefill_capturing_logits(self.requests[request_id])
            self.abort(request_id)
            rows.append(captured)
        return torch.stack(rows)

    def _run_prefill_capturing_logits(self, request: Request) -> torch.Tensor:
        while True:
            plan = self.scheduler.schedule()
            logits = self.runner.forward(self.runner.prepare(plan.chunks)).logits
            self.scheduler.update_after_step(plan, [])  # computed, but nothing sampled
            if request.num_uncomputed_tokens == 0:
                return logits[-1].float().cpu()


def needs_token_on_host(request: Request, spec: SpecConfig) -> bool:
    """Whether a request's next step must wait for its newest token on the host: to propose
    drafts from it, to advance its grammar's matcher, or to count it in a penalty or a bad word."""
    return spec.enabled or request.grammar is not None or request.params.reads_output_values


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward and sampling are launched: its plan and its tokens on the device."""

    plan: SchedulerOutput
    deferred: bool  # resolved after the next step is launched (its plan committed at launch)
    tokens: TokenBatch | None = None
    computing: Future | None = None  # the forward thread's work, until `wait`

    def wait(self) -> None:
        """Until the forward and sampling are done, when they ran in the forward thread."""
        if self.computing is not None:
            self.tokens, self.computing = self.computing.result(), None


class PhaseTimer:
    """Adds each phase's wall time and readbacks to `EngineStats`.

    On CUDA it can wait for the device at each phase's end, so time lands in the right phase;
    and it can name each phase for a torch.profiler trace (`nanoserve.<phase>`).
    """

    def __init__(self, stats: EngineStats, readbacks: ReadbackCounter | None, *, sync_cuda: bool,
                 label: bool) -> None:
        self.stats = stats
        self.readbacks = readbacks
        self.sync = sync_cuda
        self.label = label
        self._phase = ""
        self._start_s = 0.0
        self._start_readbacks = 0
        self._record: record_function | None = None

    def __call__(self, phase: str) -> PhaseTimer:
        self._phase = phase
        return self

    def __enter__(self) -> None:
        if self.label:
            self._record = record_function(f"nanoserve.{self._phase}")
            self._record.__enter__()
        self._start_readbacks = self.readbacks.count if self.readbacks is not None else 0
        self._start_s = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.stats.phase_s[self._phase] += time.perf_counter() - self._start_s
        if self.readbacks is not None:
            self.stats.phase_readbacks[self._phase] += self.readbacks.count - self._start_readbacks
        if self._record is not None:
            self._record.__exit__(*exc)
            self._record = None
