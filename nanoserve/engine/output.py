"""From sampled tokens on the device to what callers see: one readback per step.

Owns: `TokenBatch` (the step's sampled tokens, still on the device, and the request owning
each row; the prompt tokens a prefill scored for prompt_logprobs; the vectors embedding
requests pooled), the readback counter,
the stop rules (EOS, stop token ids, stop strings, max_tokens), incremental detokenization,
and `RequestOutput`, the record a caller receives.
Refuses: reading a tensor back more than once per step; changing request state beyond its text
(the verdict on each token goes to `Scheduler.update_after_step`, which applies it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from nanoserve.engine.request import NewToken, OutputState, Request, RequestStatus
from nanoserve.engine.sampler import PromptScores, SampledTokens
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the top-N alternatives, most likely first
    rank: int | None = None  # a prompt token's rank in its distribution (1: the most likely)

    def narrowed(self, num_top: int) -> TokenLogprob:
        return TokenLogprob(self.token_id, self.logprob, self.top[:num_top], self.rank)


@dataclass(frozen=True, slots=True)
class PromptPosition:
    """A prompt token scored this step: `entry` is prompt token `position` of `request_id`."""

    request_id: str
    position: int
    entry: TokenLogprob


@dataclass(slots=True)
class HostTokens:
    """One step's sampled tokens after the readback: plain Python, one entry per row."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt: list[PromptPosition] = field(default_factory=list)  # prompt_logprobs scored this step
    drafts: dict[str, list[int]] = field(default_factory=dict)  # a draft model's drafts, verified this step
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embedding requests' vectors

    def rows(self) -> Iterator[tuple[str, int, TokenLogprob | None]]:
        return zip(self.request_ids, self.token_ids, self.logprobs, strict=True)

    def runs(self) -> Iterator[tuple[str, list[int], list[TokenLogprob | None]]]:
        """Consecutive rows of one request as one run (a speculative chunk's rows are adjacent)."""
        for request_id, rows in itertools.groupby(self.rows(), key=lambda row: row[0]):
            rows = list(rows)
            yield request_id, [row[1] for row in rows], [row[2] for row in rows]


class ReadbackCounter:
    """Counts device-to-host transfers, so 'one readback per step' is a measured figure."""

    def __init__(self) -> None:
        self.count = 0

    def read(self, tensor: torch.Tensor) -> list:
        self.count += 1
        return tensor.tolist()


@dataclass(slots=True)
class PromptTokens:
    """Prompt tokens a step's prefill rows scored (prompt_logprobs): on the device, and for row i
    the request and the prompt position it scored, with that position's token id."""

    scores: PromptScores
    request_ids: list[str]
    positions: list[int]
    token_ids: list[int]

    def columns(self) -> torch.Tensor:
        """[rows, 2 + 2N] float32: logprob, rank, top ids, top logprobs (ranks and ids exact)."""
        s = self.scores
        parts = [s.logprobs.unsqueeze(1), s.ranks.unsqueeze(1).float()]
        if s.top_ids is not None:
            parts += [s.top_ids.float(), s.top_logprobs]
        return torch.cat(parts, dim=1)

    @property
    def width(self) -> int:
        """Values per row in `columns`."""
        return 2 + (2 * self.scores.top_ids.shape[1] if self.scores.top_ids is not None else 0)

    def from_host(self, values: list[float]) -> list[PromptPosition]:
        width = self.width
        n = (width - 2) // 2
        positions = []
        for i, (request_id, position, token_id) in enumerate(
                zip(self.request_ids, self.positions, self.token_ids, strict=True)):
            row = values[i * width:(i + 1) * width]
            top = tuple(zip(map(int, row[2:2 + n]), row[2 + n:], strict=True))
            positions.append(PromptPosition(request_id, position,
                                            TokenLogprob(token_id, row[0], top, int(row[1]))))
        return positions


@dataclass(slots=True)
class DraftTokens:
    """The drafts a step verified that the host has not seen (a draft model's, filled into their
    input rows on the device): `token_ids[i]` is a draft of `request_ids[i]`, in row order."""

    token_ids: torch.Tensor
    request_ids: list[str]

    def from_host(self, values: list) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request_id, token_id in zip(self.request_ids, values, strict=True):
            drafts.setdefault(request_id, []).append(int(token_id))
        return drafts


@dataclass(slots=True)
class PooledVectors:
    """The vectors a step's embedding requests pooled: row i of `vectors` ([k, hidden] float32,
    on the device) is `request_ids[i]`'s."""

    vectors: torch.Tensor
    request_ids: list[str]

    def from_host(self, values: list[float]) -> dict[str, list[float]]:
        width = self.vectors.shape[1]
        return {request_id: values[i * width:(i + 1) * width]
                for i, request_id in enumerate(self.request_ids)}


@dataclass(slots=True)
class TokenBatch:
    """A step's sampled tokens on the device, and the request id of each row; and the prompt
    tokens its prefill rows scored, if any asked (a step may score without sampling); and the
    drafts it verified that are known on the device only (a draft model's), so the host learns
    them in the same transfer as the tokens they are checked against; and the vectors its
    embedding requests pooled, in the same transfer too.

    `start_readback` (deferred output, on CUDA) queues the copy to host memory behind the
    step's kernels, so `to_host` later waits for this step's copy alone, not for the step
    launched after it.
    """

    sampled: SampledTokens | None
    request_ids: list[str]
    prompt: PromptTokens | None = None
    drafts: DraftTokens | None = None
    pooled: PooledVectors | None = None
    _copy: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @property
    def _ids_only(self) -> bool:
        return (self.prompt is None and self.pooled is None and self.sampled is not None
                and self.sampled.logprobs is None)

    def _packed(self) -> torch.Tensor:
        """Everything the host needs in one tensor: the token ids alone, or every block (ids
        beside logprobs, then the scored prompt tokens, then the pooled vectors) flattened; then
        the device-only drafts."""
        drafts = [] if self.drafts is None else [self.drafts.token_ids]
        if self._ids_only:
            return torch.cat([self.sampled.token_ids, *drafts]) if drafts else self.sampled.token_ids
        blocks = [] if self.sampled is None else [_sampled_columns(self.sampled)]
        if self.prompt is not None:
            blocks.append(self.prompt.columns())
        if self.pooled is not None:
            blocks.append(self.pooled.vectors)
        blocks += [draft_ids.float() for draft_ids in drafts]  # exact in float32, as token ids are
        return torch.cat([block.flatten() for block in blocks])

    def start_readback(self) -> None:
        on_device = (self.sampled.token_ids if self.sampled is not None
                     else self.prompt.scores.logprobs if self.prompt is not None else self.pooled.vectors)
        if on_device.device.type != "cuda" or self._copy is not None:
            return
        packed = self._packed()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copy = (host, event)

    def to_host(self, readbacks: ReadbackCounter) -> HostTokens:
        """Bring tokens (and logprobs, if any row asked; prompt logprobs too) back in exactly
        one transfer."""
        if self._copy is not None:
            host, event = self._copy
            event.synchronize()
            packed = host
        else:
            packed = self._packed()
        values = readbacks.read(packed)
        drafts = {}
        if self.drafts is not None:
            cut = len(values) - len(self.drafts.request_ids)
            values, drafts = values[:cut], self.drafts.from_host(values[cut:])
        if self._ids_only:
            return HostTokens(self.request_ids, values, [None] * len(self.request_ids), drafts=drafts)
        s, host = self.sampled, HostTokens([], [], [])
        if s is not None:
            width = 1 if s.logprobs is None else 2 + (2 * s.top_ids.shape[1] if s.top_ids is not None else 0)
            cut = width * len(self.request_ids)
            host = _sampled_from_host(self.request_ids, values[:cut], width, s.logprobs is not None)
            values = values[cut:]
        if self.prompt is not None:
            cut = self.prompt.width * len(self.prompt.request_ids)
            host.prompt, values = self.prompt.from_host(values[:cut]), values[cut:]
        if self.pooled is not None:
            host.pooled = self.pooled.from_host(values)
        host.drafts = drafts
        return host


def _sampled_columns(s: SampledTokens) -> torch.Tensor:
    """[rows, 1 or 2 + 2N] float32: token id, then logprob and top ids and logprobs if asked.
    Token ids are exact in float32 below 2**24, far above any vocabulary."""
    parts = [s.token_ids.unsqueeze(1).float()]
    if s.logprobs is not None:
        parts.append(s.logprobs.unsqueeze(1).float())
    if s.top_ids is not None:
        parts += [s.top_ids.float(), s.top_logprobs.float()]
    return torch.cat(parts, dim=1)


def _sampled_from_host(request_ids: list[str], values: list[float], width: int,
                       with_logprobs: bool) -> HostTokens:
    rows = [values[i * width:(i + 1) * width] for i in range(len(request_ids))]
    tokens = [int(row[0]) for row in rows]
    if not with_logprobs:
        return HostTokens(request_ids, tokens, [None] * len(request_ids))
    n = (width - 2) // 2
    logprobs = [TokenLogprob(int(row[0]), row[1],
                             tuple(zip(map(int, row[2:2 + n]), row[2 + n:], strict=True))) for row in rows]
    return HostTokens(request_ids, tokens, logprobs)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: a text delta and the tokens behind it."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: str | int | None  # the stop string or stop token id that matched
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache supplied
    # prompt_logprobs, on a request's first output only: entry p scores prompt token p (0: None;
    # None too where token p is an image's placeholder outside the vocabulary)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (its one output)


def _own_logprobs(logprobs: Sequence[TokenLogprob | None], wanted: int | None) -> list[TokenLogprob] | None:
    """What this request asked for of its rows' logprobs: a step reads back the most any of
    its rows asked for, so a neighbour's request must not widen (or create) this one's."""
    if wanted is None or not logprobs or logprobs[0] is None:
        return None
    return [entry.narrowed(wanted) for entry in logprobs]


class OutputProcessor:
    """Judges each new token by the stop rules and turns it into text; changes no request state
    but the text state (`Request.output_state`): the scheduler applies the verdict."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> OutputState:
        """`prompt_ids` seed the detokenizer, so the first token's text reads as it will in
        the full text (its leading space kept)."""
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=prompt_ids,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        return OutputState(detokenizer, StopStringMatcher(params.stop), stop_ids)

    def judge(self, request: Request, token_id: int,
              logprob: TokenLogprob | None) -> tuple[NewToken, RequestOutput]:
        """What `token_id`, sampled for `request` and not yet appended, means: whether it ends
        the request (for `Scheduler.update_after_step`) and the delta the caller receives."""
        new_tokens, output = self.judge_run(request, [token_id], [logprob])
        return new_tokens[0], output

    def judge_run(self, request: Request, token_ids: Sequence[int],
                  logprobs: Sequence[TokenLogprob | None]) -> tuple[list[NewToken], RequestOutput]:
        """`judge` for a run of tokens one step produced for one request (a speculative run),
        token by token: the first that ends the request ends the run, and the rest are dropped.
        One delta for the whole run."""
        new_tokens: list[NewToken] = []
        text, status, stop_reason = "", None, None
        for token_id in token_ids:
            num_output = len(request.output_ids) + len(new_tokens) + 1
            delta, status, stop_reason = self._advance(request, token_id, num_output)
            text += delta
            new_tokens.append(NewToken(request.request_id, token_id, status))
            if status is not None:
                break
        kept = [token.token_id for token in new_tokens]
        logprobs = list(logprobs[:len(kept)])
        output = RequestOutput(
            request_id=request.request_id,
            text=text,
            token_ids=kept,
            logprobs=_own_logprobs(logprobs, request.params.logprobs),
            finished=status is not None,
            finish_reason=status.value if status is not None else None,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids) + len(kept),
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=list(request.prompt_logprobs) if request.scores_prompt else None,
        )
        return new_tokens, output

    def _advance(self, request: Request, token_id: int,
                 num_output: int) -> tuple[str, RequestStatus | None, str | int | None]:
        """Stop rules, in order: stop token (EOS unless ignored), stop string, the grammar's end,
        max_tokens.

        `token_id` is output token number `num_output`. Neither a stop token nor a stop string
        completed by one of the first min_tokens tokens ends the request.
        """
        params, state = request.params, request.output_state
        past_min_tokens = num_output > params.min_tokens
        # A constrained request's matcher takes the token now, after the step's one readback.
        grammar_done = request.grammar is not None and request.grammar.accept(token_id)
        if token_id in state.stop_token_ids and past_min_tokens:
            text = state.stop_matcher.flush()
            if params.include_stop_str_in_output:
                text += state.detokenizer.push([token_id]) + state.detokenizer.flush()
            return text, RequestStatus.FINISHED_STOPPED, token_id
        text = state.detokenizer.push([token_id])
        if num_output >= params.max_tokens or grammar_done:
            text += state.detokenizer.flush()  # release a held-back partial character
        # Text before min_tokens goes through the hold-back too, unarmed: a stop string that
        # completes there is plain text, but one straddling the boundary is still found.
        text, stopped = state.stop_matcher.feed(text, armed=past_min_tokens)
        if stopped:
            if params.include_stop_str_in_output:
                text += state.stop_matcher.matched
            return text, RequestStatus.FINISHED_STOPPED, state.stop_matcher.matched
        if grammar_done:  # the output is complete: a "stop", even on the last allowed token
            return text + state.stop_matcher.flush(), RequestStatus.FINISHED_STOPPED, None
        if num_output >= params.max_tokens:
            return text + state.stop_matcher.flush(), RequestStatus.FINISHED_LENGTH, None
        return text, None, None

    def pooled(self, request: Request, vector: list[float]) -> RequestOutput:
        """An embedding request's one output: its vector; it ends here ("stop")."""
        return RequestOutput(request.request_id, "", [], None, True, RequestStatus.FINISHED_STOPPED.value,
                             None, len(request.prompt_ids), 0, request.num_cached_tokens, embedding=vector)

    def aborted(self, request: Request) -> RequestOutput:
        return RequestOutput(request.request_id, "", [], None, True, "abort", None,
                             len(request.prompt_ids), len(request.output_ids), request.num_cached_tokens)
