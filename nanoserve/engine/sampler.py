"""Per-request sampling for a whole step in one vectorized pass over the [rows, vocab] logits.

Owns: `SamplingRow` (what the engine knows about one row), `RowEdits` (one request's penalty
and logit_bias cells on the device, built once per request and grown by each new token),
`SamplingBatch` (the rows as per-row parameter tensors on the device, built once per step),
`BatchedSampler` (logits to token ids, and logprobs when asked), `score_tokens` (prompt
tokens' logprobs, by the same computation as sampled ones); the kept set of a sampled row and
its draw, with `uniform_from_counter`, the one source of randomness, are `engine.draw`'s.

Order of the filters, for every row (stated here only: `SamplingParams` and `engine.draw` point
here): a constrained row's grammar mask (below), then repetition penalty (prompt and generated
tokens), then frequency and presence penalties (counts of generated tokens), then DRY
(llama.cpp's, on prompt and generated tokens, after the penalties as in llama.cpp's chain;
`engine.dry`), then logit_bias, then the min_tokens mask (the ids that would stop the request
are -inf until `position >= min_tokens`) and the row's own bans (`bad_words`: a word's last
token is -inf where the output so far ends with the rest of it; `allowed_token_ids`: every
other id is -inf), then temperature, top_n_sigma, top_k, typical_p, top_p, min_p, p_less and
XTC (mirostat in place of the truncation filters). Each filter after temperature sees the
distribution the ones before it left, renormalized over their survivors: top_n_sigma keeps
the tokens whose scaled logit is at least max - n x std (std over the row's
finite scaled logits, as llama.cpp's --top-nsigma); top_k keeps the k most likely survivors;
typical_p keeps the survivors most typical of their own distribution (|-log q - H(q)| smallest
first, as transformers' TypicalLogitsWarper) until they hold typical_p of its mass; top_p then
holds top_p of the mass left, min_p keeps q >= min_p x the largest q left, and p_less keeps q >=
sum(q**2) of what all of them left (never above the largest q), and XTC last (after min_p, as in
llama.cpp's default chain; llama.cpp applies temperature after all of them, here it comes first,
so XTC reads the tempered shares). Mirostat rows skip top_k through XTC: their kept set is
mirostat's (`engine.draw`). So every filter keeps at least one token, and no combination of
values empties a row. Greedy rows (`SamplingParams.is_greedy`: temperature 0 or below
`MIN_TEMPERATURE`, or top_k 1) take the first argmax, ignore every filter, and never call
`uniform_from_counter`.

Constrained rows (structured outputs): before anything else, each such row's logits are
-inf wherever its grammar's bitmask (`GrammarMask`, filled on the host from the request's
matcher and uploaded once per step) forbids the token, so a forbidden token is never drawn,
greedy or sampled. Logprobs are read after this mask, as vLLM reads them (a constrained row's
logprobs are over the tokens its grammar allows); penalties and temperature still come after.
Rows without a grammar never see the mask: a step with none does no mask work at all.

How a sampled row draws, and how top_k and top_p avoid a full sort: `engine.draw`.

Refuses: reading anything back to the host (no .item(), .tolist(), bool(tensor) or
data-dependent shapes: the step's one readback belongs to the output processor), keeping
random-generator state per request, Python loops over rows while sampling (`build` loops
over rows on the host, once per step, to upload their parameters), and host work per step that
grows with a row's logit_bias, prompt or output (`RowEdits` reads each of them once).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nanoserve.engine.draw import (
    GROUP,
    DrawParams,
    MirostatMu,
    MirostatParams,
    draw_tokens,
    kept_mass,
    put_rows,
    rows_of,
    uniform_from_counter,
)
from nanoserve.engine.dry import DryHistory
from nanoserve.engine.structured import BITS_PER_WORD, RowGrammar, fill_bitmasks
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of a step, built by the engine."""

    params: SamplingParams
    seed: int  # resolved per request at admission (random if the user gave none)
    position: int  # index of the token being generated in this request's output (0 first)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated so far
    edits: RowEdits | None = None  # the request's own, kept across steps; None: built for this step
    grammar: RowGrammar | None = None  # the request's structured-output matcher, if constrained


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """One step's picks, still on the device; the output processor reads them back once."""

    token_ids: Tensor  # [rows] int64
    logprobs: Tensor | None  # [rows] float32, log_softmax of the raw (grammar-masked) logits, if asked
    top_ids: Tensor | None  # [rows, N] int64, N = the most alternatives any row asked (N >= 1)
    top_logprobs: Tensor | None  # [rows, N] float32, highest first, ties by token id


@dataclass(frozen=True, slots=True)
class Cells:
    """One kind of logit edit as a list of (row, token, value) cells, each token once per row."""

    rows: Tensor  # [E] int64
    cols: Tensor  # [E] int64
    values: Tensor  # [E] float32


@dataclass(frozen=True, slots=True)
class LogitEdits:
    """Penalties and logit_bias of one step, gathered from the rows' `RowEdits`."""

    repetition: Cells | None  # the penalty, on tokens in the prompt or the output
    frequency: Cells | None  # frequency_penalty * count, on tokens in the output
    presence: Tensor | None  # [E] presence_penalty on the cells of `frequency`
    bias: Cells | None
    dry: Cells | None = None  # DRY's penalty, subtracted


class RowEdits:
    """One request's sampling state, kept for the request's life: its penalty and logit_bias
    cells on the device, DRY's history (`dry`) and mirostat's mu (`mirostat`).

    Built once (the bias and the prompt's tokens are read here and never again); each step
    `catch_up` reads only the tokens generated since the last one, so a step's host work
    does not grow with the size of logit_bias, the prompt or the output (DRY's work per token
    grows with its window, `dry_penalty_last_n`, as llama.cpp's does).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device | str) -> None:
        self.params, self.vocab_size, self.device = params, vocab_size, device
        self.num_outputs_read = 0
        in_vocab = [(token, amount) for token, amount in params.logit_bias if token < vocab_size]
        self.bias_cols = self._longs([token for token, _ in in_vocab])
        self.bias = torch.tensor([amount for _, amount in in_vocab], dtype=torch.float32, device=device)
        self.seen: set[int] = set()
        self.seen_cols = self._longs([])
        if params.repetition_penalty != 1:
            self._see(prompt_ids)
        self.count_slots: dict[int, int] = {}
        self.count_cols = self._longs([])
        self.counts = self._longs([])
        self.allowed = allowed_mask(params.allowed_token_ids, vocab_size, device)
        self.dry = DryHistory(params, prompt_ids) if params.dry_active else None
        self.mirostat = MirostatMu(params.mirostat_tau, device) if params.mirostat else None

    def _longs(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _see(self, tokens: Iterable[int]) -> None:
        new = [t for t in dict.fromkeys(tokens) if t not in self.seen and 0 <= t < self.vocab_size]
        if new:
            self.seen.update(new)
            self.seen_cols = torch.cat([self.seen_cols, self._longs(new)])

    def _count(self, tokens: list[int]) -> None:
        tokens = [t for t in tokens if 0 <= t < self.vocab_size]
        new = [t for t in dict.fromkeys(tokens) if t not in self.count_slots]
        for token in new:
            self.count_slots[token] = len(self.count_slots)
        if new:
            self.count_cols = torch.cat([self.count_cols, self._longs(new)])
            self.counts = torch.cat([self.counts, self._longs([0] * len(new))])
        if tokens:
            slots = self._longs([self.count_slots[t] for t in tokens])
            self.counts = self.counts.index_add(0, slots, torch.ones_like(slots))

    def fork(self, output_ids: Sequence[int]) -> RowEdits:
        """These cells as they will be once `output_ids` (this one's tokens and more: a
        speculative row's drafts) are generated, leaving this one as it is. Its own object
        only when a penalty counts tokens; the bias alone never changes."""
        if self.params.repetition_penalty == 1 and not (self.params.frequency_penalty
                                                        or self.params.presence_penalty or self.dry):
            return self
        forked = copy.copy(self)  # the tensors are never changed in place, only replaced
        forked.seen, forked.count_slots = set(self.seen), dict(self.count_slots)
        forked.dry = self.dry.copy() if self.dry is not None else None
        forked.catch_up(output_ids)
        return forked

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Take in the tokens generated since the last call (output_ids only ever grows)."""
        fresh = list(output_ids[self.num_outputs_read:])
        self.num_outputs_read += len(fresh)
        if self.params.repetition_penalty != 1:
            self._see(fresh)
        if self.params.frequency_penalty or self.params.presence_penalty:
            self._count(fresh)
        if self.dry is not None:
            self.dry.extend(fresh)


def allowed_mask(allowed: Sequence[int] | None, vocab_size: int, device: torch.device | str) -> Tensor | None:
    """[vocab] bool, true for the ids a row may sample (vLLM's allowed_token_ids); None: any."""
    if allowed is None:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor([t for t in allowed if t < vocab_size], dtype=torch.int64, device=device)] = True
    return mask


def _gather(parts: list[tuple[int, Tensor, Tensor]]) -> Cells | None:
    """Rows' (row, cols, values) as one Cells, rows with no cells left out."""
    parts = [part for part in parts if part[1].numel()]
    if not parts:
        return None
    return Cells(torch.cat([torch.full_like(cols, row) for row, cols, _ in parts]),
                 torch.cat([cols for _, cols, _ in parts]), torch.cat([values for _, _, values in parts]))


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step as tensors on the device.

    The host-side fields come from the parameters alone, never from the logits, so deciding
    which stages run needs no readback.
    """

    vocab_size: int
    any_greedy: bool
    draw: DrawParams | None  # None when every row is greedy
    edits: LogitEdits | None
    masked: tuple[Tensor, Tensor] | None  # (rows, cols) forced to -inf by min_tokens and bad_words
    allowed: tuple[Tensor, Tensor] | None  # (rows, [r, vocab] masks): allowed_token_ids rows only
    want_logprobs: bool
    num_top_logprobs: int
    grammar: GrammarMask | None = None  # the constrained rows' bitmasks; None when no row has one

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], *, vocab_size: int,
              eos_token_ids: Collection[int], device: torch.device | str) -> SamplingBatch:
        drawing = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        return cls(
            vocab_size=vocab_size,
            any_greedy=len(drawing) < len(rows),
            draw=(DrawParams.build([rows[i].params for i in drawing], [rows[i].seed for i in drawing],
                                   [rows[i].position for i in drawing], drawing=drawing, num_rows=len(rows),
                                   vocab_size=vocab_size, device=device,
                                   mirostat=_mirostat([rows[i] for i in drawing], vocab_size, device))
                  if drawing else None),
            edits=_edits(rows, vocab_size, device),
            masked=_banned_cells(rows, vocab_size, eos_token_ids, device),
            allowed=_allowed_rows(rows, vocab_size, device),
            want_logprobs=bool(asked),
            num_top_logprobs=max(asked, default=0),
            grammar=GrammarMask.build(rows, vocab_size, device),
        )


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """The constrained rows' allowed tokens: bit j of int32 word w allows token 32 w + j."""

    rows: Tensor | None  # [c] int64, the constrained rows; None when every row is
    bitmask: Tensor  # [c, ceil(vocab / 32)] int32

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device | str) -> GrammarMask | None:
        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
        if not constrained:
            return None
        bitmask = fill_bitmasks([rows[i].grammar for i in constrained], vocab_size)
        return cls(
            rows=None if len(constrained) == len(rows) else torch.tensor(constrained, device=device),
            bitmask=torch.from_numpy(bitmask).to(device, non_blocking=True),
        )


def _mirostat(rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device | str) -> MirostatParams | None:
    """The drawing rows' mirostat parameters and mu; a row without its request's kept edits
    (`SamplingRow.edits` None) starts from mu's first value, so only position 0 has one."""
    chosen = [i for i, row in enumerate(rows) if row.params.mirostat]
    if not chosen:
        return None
    states = [(rows[i].edits or RowEdits(rows[i].params, (), vocab_size, device)).mirostat for i in chosen]
    params = [rows[i].params for i in chosen]

    def floats(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    positions = tuple(rows[i].position for i in chosen)
    return MirostatParams(
        rows=None if len(chosen) == len(rows) else torch.tensor(chosen, dtype=torch.int64, device=device),
        version_one=(torch.tensor([p.mirostat == 1 for p in params], device=device)
                     if any(p.mirostat == 1 for p in params) else None),
        mu=torch.stack([state.at(position) for state, position in zip(states, positions, strict=True)]),
        tau=floats([p.mirostat_tau for p in params]),
        eta=floats([p.mirostat_eta for p in params]),
        states=tuple(states),
        positions=positions,
    )


def _edits(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> LogitEdits | None:
    if not any(row.params.logit_bias or row.params.repetition_penalty != 1 or row.params.dry_active
               or row.params.frequency_penalty or row.params.presence_penalty for row in rows):
        return None
    kept = []
    for row in rows:
        edits = row.edits or RowEdits(row.params, row.prompt_ids, vocab_size, device)
        edits.catch_up(row.output_ids)
        kept.append(edits)

    def full(cols: Tensor, value: float) -> Tensor:
        return torch.full_like(cols, value, dtype=torch.float32)

    # frequency_penalty * count in float64, rounded once to float32, as a Python float would be.
    frequency = _gather([(i, e.count_cols, (e.counts.double() * e.params.frequency_penalty).float())
                         for i, e in enumerate(kept)])
    presence = _gather([(i, e.count_cols, full(e.count_cols, e.params.presence_penalty))
                        for i, e in enumerate(kept)])
    edits = LogitEdits(
        repetition=_gather([(i, e.seen_cols, full(e.seen_cols, e.params.repetition_penalty))
                            for i, e in enumerate(kept)]),
        frequency=frequency,
        presence=None if presence is None else presence.values,
        bias=_gather([(i, e.bias_cols, e.bias) for i, e in enumerate(kept)]),
        dry=_gather([(i, *_dry_cells(e.dry, vocab_size, device)) for i, e in enumerate(kept)
                     if e.dry is not None]),
    )
    return None if edits == LogitEdits(None, None, None, None) else edits


def _dry_cells(dry: DryHistory, vocab_size: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """DRY's penalties, less those of ids outside the vocabulary (an image's placeholder in the
    prompt may follow a repeat; it is never sampled)."""
    tokens, penalties = dry.penalties()
    sampled = tokens < vocab_size
    return torch.from_numpy(tokens[sampled]).to(device), torch.from_numpy(penalties[sampled]).to(device)


def _banned_cells(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Collection[int],
                  device: torch.device | str) -> tuple[Tensor, Tensor] | None:
    """(rows, cols) that are -inf this step: stop ids before min_tokens, and bad words' last
    tokens where the output ends with the rest of the word. Rows without either add nothing."""
    cells = []
    for i, row in enumerate(rows):
        banned = set(_bad_word_bans(row.params.bad_words_token_ids, row.output_ids))
        if row.position < row.params.min_tokens:
            # Only ids that would stop the request: with ignore_eos, eos is an ordinary token.
            banned |= set(row.params.stop_token_ids)
            banned |= set() if row.params.ignore_eos else set(eos_token_ids)
        cells += [(i, token) for token in sorted(banned) if 0 <= token < vocab_size]
    if not cells:
        return None
    both = torch.tensor(cells, dtype=torch.int64, device=device).T
    return both[0], both[1]


def _bad_word_bans(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> Iterable[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM's rule);
    a one-token word is always banned. Reads only the last few output ids."""
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix)
                          and list(output_ids[len(output_ids) - len(prefix):]) == list(prefix)):
            yield word[-1]


def _allowed_rows(rows: Sequence[SamplingRow], vocab_size: int,
                  device: torch.device | str) -> tuple[Tensor, Tensor] | None:
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return None
    masks = [(rows[i].edits.allowed if rows[i].edits is not None and rows[i].edits.allowed is not None
              else allowed_mask(rows[i].params.allowed_token_ids, vocab_size, device)) for i in limited]
    return torch.tensor(limited, dtype=torch.int64, device=device), torch.stack(masks)


class BatchedSampler:
    """Logits [rows, vocab] to one token per row, in one pass with no readback."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SampledTokens:
        raw = logits.float().contiguous()  # bf16 rows are widened; contiguous rows stay row-local
        if batch.grammar is not None:
            raw = _apply_grammar(raw, batch.grammar)
        return _with_logprobs(raw, _pick(_apply_edits(raw, batch), batch), batch)


def _apply_grammar(logits: Tensor, mask: GrammarMask) -> Tensor:
    """The logits with each constrained row's forbidden tokens at -inf (a new tensor)."""
    vocab = logits.shape[1]
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=logits.device)
    allowed = ((mask.bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    constrained = rows_of(logits, mask.rows).masked_fill(~allowed, -torch.inf)
    return put_rows(logits, mask.rows, constrained)


def _pick(logits: Tensor, batch: SamplingBatch) -> Tensor:
    draw = batch.draw
    if draw is None:
        return _argmax(logits)
    sampled = _sample(rows_of(logits, draw.rows), draw)
    if not batch.any_greedy:
        return sampled
    return _argmax(logits).index_copy(0, draw.rows, sampled)




def _apply_edits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    if batch.edits is None and batch.masked is None and batch.allowed is None:
        return logits
    edited = logits.clone()  # the raw logits stay untouched: logprobs are read from them
    if batch.edits is not None:
        _apply_penalties_and_bias(edited, batch.edits)
    if batch.masked is not None:
        edited.index_put_(batch.masked, torch.tensor(float("-inf"), device=edited.device))
    if batch.allowed is not None:
        rows, masks = batch.allowed
        edited.index_copy_(0, rows, edited.index_select(0, rows).masked_fill_(~masks, float("-inf")))
    return edited


def _apply_penalties_and_bias(edited: Tensor, edits: LogitEdits) -> None:
    """In the order repetition, frequency, presence, DRY, bias: each cell rounds as one formula would."""
    if (cells := edits.repetition) is not None:
        old = edited[cells.rows, cells.cols]
        edited.index_put_((cells.rows, cells.cols),
                          torch.where(old > 0, old / cells.values, old * cells.values))
    if (cells := edits.frequency) is not None:
        edited.index_put_((cells.rows, cells.cols),
                          edited[cells.rows, cells.cols] - cells.values - edits.presence)
    if (cells := edits.dry) is not None:
        edited.index_put_((cells.rows, cells.cols), edited[cells.rows, cells.cols] - cells.values)
    if (cells := edits.bias) is not None:
        edited.index_put_((cells.rows, cells.cols), edited[cells.rows, cells.cols] + cells.values)


def _argmax(logits: Tensor) -> Tensor:
    """The first index of each row's maximum, reading group maxima first."""
    rows, vocab = logits.shape
    if vocab % GROUP:
        return logits.argmax(-1)
    groups = logits.view(rows, vocab // GROUP, GROUP)
    best = groups.amax(-1).argmax(-1)  # the first group holding the maximum
    inside = groups.gather(1, best.view(rows, 1, 1).expand(rows, 1, GROUP)).squeeze(1)
    return best * GROUP + inside.argmax(-1)


def _sample(logits: Tensor, draw: DrawParams) -> Tensor:
    kept = kept_mass(logits, draw)
    tokens = draw_tokens(kept, uniform_from_counter(draw.seed, draw.position))
    if draw.mirostat is not None:
        draw.mirostat.advance(kept, tokens)
    return tokens


def _with_logprobs(raw: Tensor, token_ids: Tensor, batch: SamplingBatch) -> SampledTokens:
    if not batch.want_logprobs:
        return SampledTokens(token_ids, None, None, None)
    _, chosen, top_ids, top_logprobs = _logprobs_of(raw, token_ids, batch.num_top_logprobs)
    return SampledTokens(token_ids, chosen, top_ids, top_logprobs)


def _logprobs_of(raw: Tensor, token_ids: Tensor,
                 num_top: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Each row's log_softmax, the logprob of its token, and its top `num_top` (None for 0).
    The one computation behind sampled and prompt logprobs, so a token scored in the prompt
    gets the bits it gets when generated."""
    # From the model's own logits, before penalties and temperature (as OpenAI and vLLM report).
    # A row whose every logit is -inf has no distribution: its logprobs are -inf, not NaN.
    logprobs = torch.log_softmax(raw, dim=-1).nan_to_num_(nan=-torch.inf, neginf=-torch.inf)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_top == 0:
        return logprobs, chosen, None, None
    top_ids = _top_ids_ties_by_id(logprobs, num_top)
    top_logprobs = logprobs.gather(1, top_ids)
    # topk leaves the order of tied values to the device; list ties by token id.
    by_id = top_ids.argsort(dim=-1)
    top_ids, top_logprobs = top_ids.gather(1, by_id), top_logprobs.gather(1, by_id)
    by_value = top_logprobs.sort(dim=-1, descending=True, stable=True).indices
    return logprobs, chosen, top_ids.gather(1, by_value), top_logprobs.gather(1, by_value)


def _top_ids_ties_by_id(logprobs: Tensor, num_top: int) -> Tensor:
    """The ids of each row's `num_top` largest values, a tie at the cut going to the smaller
    ids. topk alone picks among values tied at the cut as the device likes, and which one it
    picks changes with k: a row asking 3 alternatives beside a row asking 5 (the batch takes
    5) listed other tokens than alone. Here the cut is made on an integer key that is unique
    per row: every value above the k-th first, then the tied ones by increasing id."""
    vocab = logprobs.shape[-1]
    kth = logprobs.topk(num_top, dim=-1).values[:, -1:]  # the values themselves never depend on ties
    ids = torch.arange(vocab, device=logprobs.device)
    key = torch.where(logprobs > kth, 2 * vocab - ids, torch.where(logprobs == kth, vocab - ids, -1))
    return key.topk(num_top, dim=-1).indices


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Prompt tokens scored by the logits of the position before each (prompt_logprobs), still
    on the device: row i is the logprob of `token_ids[i]`, its rank, and the row's top N."""

    logprobs: Tensor  # [rows] float32
    ranks: Tensor  # [rows] int64: tokens at least as likely as this one, itself included (vLLM's)
    top_ids: Tensor | None  # [rows, N] int64, most likely first, ties by token id; None for N = 0
    top_logprobs: Tensor | None  # [rows, N] float32


def score_tokens(logits: Tensor, token_ids: Tensor, num_top: int) -> PromptScores:
    """`token_ids[i]`'s logprob under row i of `logits` (raw: no edits apply to a prompt)."""
    logprobs, chosen, top_ids, top_logprobs = _logprobs_of(logits, token_ids, num_top)
    ranks = (logprobs >= chosen[:, None]).sum(dim=-1)
    return PromptScores(chosen, ranks, top_ids, top_logprobs)


__all__ = ["BatchedSampler", "PromptScores", "SampledTokens", "SamplingBatch", "SamplingRow", "score_tokens",
           "uniform_from_counter"]
