"""Per-request sampling for a whole step in one vectorized pass over the [rows, vocab] logits.

Owns: `SamplingRow` (what the engine knows about one row), `RowEdits` (one request's penalty
and logit_bias cells on the device, built once per request and grown by each new token),
`SamplingBatch` (the rows as per-row parameter tensors on the device, built once per step),
`BatchedSampler` (logits to token ids, and logprobs when asked), `score_tokens` (prompt
tokens' logprobs, by the same computation as sampled ones) and `uniform_from_counter`, the one
source of randomness.

Order of the filters, for every row: repetition penalty (prompt and generated tokens), then
frequency and presence penalties (counts of generated tokens), then logit_bias, then the
min_tokens mask (the ids that would stop the request are -inf until `position >= min_tokens`)
and the row's own bans (`bad_words`: a word's last token is -inf where the output so far ends
with the rest of it; `allowed_token_ids`: every other id is -inf), then temperature,
top_n_sigma, top_k, typical_p, top_p, min_p and p_less. Each filter after temperature sees the
distribution the ones before it left, renormalized over their survivors: top_n_sigma keeps
the tokens whose scaled logit is at least max - n x std (std over the row's
finite scaled logits, as llama.cpp's --top-nsigma); top_k keeps the k most likely survivors;
typical_p keeps the survivors most typical of their own distribution (|-log q - H(q)|
smallest first, as transformers' TypicalLogitsWarper) until they hold typical_p of its mass;
top_p then holds top_p of the mass left, min_p keeps q >= min_p x the largest q left, and
p_less keeps q >= sum(q**2) of what all of them left (never above the largest q). So
every filter keeps at least one token, and no combination of values empties a row. Greedy rows
(`SamplingParams.is_greedy`: temperature 0 or below `MIN_TEMPERATURE`, or top_k 1) take the
first argmax, ignore every filter, and never call `uniform_from_counter`.

Constrained rows (structured outputs): before anything else, each such row's logits are
-inf wherever its grammar's bitmask (`GrammarMask`, filled on the host from the request's
matcher and uploaded once per step) forbids the token, so a forbidden token is never drawn,
greedy or sampled. Logprobs are read after this mask, as vLLM reads them (a constrained row's
logprobs are over the tokens its grammar allows); penalties and temperature still come after.
Rows without a grammar never see the mask: a step with none does no mask work at all.

How a sampled row draws: top_k, top_p and min_p are thresholds on the row's softmax
probabilities p, so without top_n_sigma or typical_p the kept set is {p >= threshold} (ties at
the threshold are all kept, and the argmax always is). A row with top_n_sigma or typical_p
("shaped") first masks what those two (and top_k, which comes between them) drop, and its p
becomes the softmax over the survivors; the thresholds then apply to that p. Rows without
either mode never enter that stage, so their bits are what they were before it existed.
Kept probabilities become integers (p * 2**MASS_BITS, exact in int64; a token below 2**-60 is
never drawn), and one uniform, a pure function of (seed, position) computed on the
device (`uniform_from_counter`), picks the first token in vocabulary order whose running sum
passes `u * total` (group sums of 64 first, then inside the chosen group). The only float
reductions are softmax and log_softmax, whose kernels work row by row on CPU and CUDA; every
sum after them is over integers, exact in any order (the entropy of typical_p and the mean and
std of top_n_sigma, and p_less's sum of squares, are sums of fixed-point integers,
`FIXED_BITS` bits after the point). So a
row gives bit-identically the same token and logprobs in any batch, at any index, beside any
neighbours, which is what makes batching and preemption invisible to a seeded request.

How top_k and top_p avoid a full sort: top_k reads the k-th largest p from one `torch.topk` of
the largest k any row asked. top_p on top of top_k finds its cut inside that window. top_p
alone (no top_k) finds its cut with a three-pass radix select over the bits of p, counting
integer mass per bucket (`scatter_add`): O(vocab) per pass, exact, no sort. A cheap
"does the top-64 window already cover top_p?" check cannot skip the exact path without
reading the answer back to the host, so such rows always pay for the radix select. typical_p
finds its cut with the same radix select, over keys that rise as |-log q - H| falls.

Refuses: reading anything back to the host (no .item(), .tolist(), bool(tensor) or
data-dependent shapes: the step's one readback belongs to the output processor), keeping
random-generator state per request, Python loops over rows while sampling (`build` loops
over rows on the host, once per step, to upload their parameters), and host work per step that
grows with a row's logit_bias, prompt or output (`RowEdits` reads each of them once).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nanoserve.engine.structured import BITS_PER_WORD, RowGrammar, fill_bitmasks
from nanoserve.sampling_params import SamplingParams

MASS_BITS = 60  # p * 2**60 is exact in float32 and sums of softmax mass stay below 2**63
# Two-level argmax and draw: read per-group maxima or sums first, then one group. The argmax
# beats torch.argmax on CPU (results/README.md, "Measured design choices"), and the draw needs
# no [rows, vocab] running sum.
GROUP = 64
# Radix passes over the 31 bits of a non-negative float32: (shift, digit width), high bits first.
RADIX_PASSES = ((21, 10), (11, 10), (0, 11))
# Fixed-point sums for typical_p's entropy and top_n_sigma's std: terms in [-1, 1] scaled by
# 2**40 sum exactly in int64 over up to 2**22 tokens, to about 2**-40 per term.
FIXED_BITS = 40
_INF_BITS = 0x7F800000  # the int32 bits of float32 +inf: the largest non-NaN non-negative key


def _signed64(value: int) -> int:
    """The int64 with the same bits as an unsigned 64-bit constant (torch has no uint64 math)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _signed64(0x9E3779B97F4A7C15)  # SplitMix64's increment
_MIX_1 = _signed64(0xBF58476D1CE4E5B9)
_MIX_2 = _signed64(0x94D049BB133111EB)


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


class RowEdits:
    """One request's penalty and logit_bias cells on the device, kept for the request's life.

    Built once (the bias and the prompt's tokens are read here and never again); each step
    `catch_up` reads only the tokens generated since the last one, so a step's host work
    does not grow with the size of logit_bias, the prompt or the output.
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
                                                        or self.params.presence_penalty):
            return self
        forked = copy.copy(self)  # the tensors are never changed in place, only replaced
        forked.seen, forked.count_slots = set(self.seen), dict(self.count_slots)
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
class ShapeParams:
    """top_n_sigma and typical_p of the shaped rows (those with either), one entry per such row.

    Each mode runs only over the rows that use it; the index tensors follow `DrawParams`' rule
    (None: every row of the level above, no gather).
    """

    rows: Tensor | None  # [s] int64 into the drawing rows: the shaped ones
    sigma_rows: Tensor | None  # [g] int64 into the s: rows with top_n_sigma
    n_sigma: Tensor | None  # [g] float64; None when no row has top_n_sigma
    typical_rows: Tensor | None  # [t] int64 into the s: rows with typical_p < 1
    typical_p: Tensor | None  # [t] float64; None when no row has typical_p < 1
    window: int  # the largest top_k of the typical rows, 0 if none: top_k comes before typical_p
    top_k: Tensor | None  # [t] int64, 0 where a typical row has no top_k; None when window is 0

    @classmethod
    def build(cls, params: list[SamplingParams], top_k: list[int],
              upload: Callable[[list, torch.dtype], Tensor],
              subset: Callable[[list[int], int], Tensor | None]) -> ShapeParams | None:
        shaped = [i for i, p in enumerate(params) if p.top_n_sigma > 0 or p.typical_p < 1]
        if not shaped:
            return None
        sigma = [j for j, i in enumerate(shaped) if params[i].top_n_sigma > 0]
        typical = [j for j, i in enumerate(shaped) if params[i].typical_p < 1]
        typical_k = [top_k[shaped[j]] for j in typical]
        window = max(typical_k, default=0)
        return cls(
            rows=subset(shaped, len(params)),
            sigma_rows=subset(sigma, len(shaped)) if sigma else None,
            n_sigma=(upload([params[shaped[j]].top_n_sigma for j in sigma], torch.float64)
                     if sigma else None),
            typical_rows=subset(typical, len(shaped)) if typical else None,
            typical_p=(upload([params[shaped[j]].typical_p for j in typical], torch.float64)
                       if typical else None),
            window=window,
            top_k=upload(typical_k, torch.int64) if window else None,
        )


@dataclass(frozen=True, slots=True)
class DrawParams:
    """The parameters of the rows that draw (not greedy), one entry per such row.

    Every stage runs only over the rows that use it: `rows`, `window_rows` and `nucleus_rows`
    pick them (None: all of them, no gather). They come from the parameters alone, never from
    the logits, so choosing them needs no readback, and a row's result never depends on which
    other rows shared a stage.
    """

    rows: Tensor | None  # [n] int64, the drawing rows' places in the step
    temperature: Tensor | None  # [n] float32; None when every one is 1
    min_p: Tensor  # [n] float32
    top_p: Tensor  # [n] float64, 1 where the row keeps every token
    seed: Tensor  # [n] int64
    position: Tensor  # [n] int64
    window: int  # width of the top_k window: the largest top_k asked, 0 if none
    window_rows: Tensor | None  # [w] int64 into the n: rows with a top_k
    top_k: Tensor | None  # [w] int64
    window_top_p: Tensor | None  # [w] bool: top_p < 1 too, so the cut lies inside the window
    any_nucleus: bool  # some row has top_p < 1 without top_k: the radix select runs
    nucleus_rows: Tensor | None  # [m] int64 into the n, those rows; None when all n are
    shape: ShapeParams | None  # the rows with top_n_sigma or typical_p; None when none has
    p_less_rows: Tensor | None  # [l] int64 into the n: rows with p_less; None when all n are
    any_p_less: bool

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], drawing: list[int], vocab_size: int,
              device: torch.device | str) -> DrawParams:
        params = [rows[i].params for i in drawing]
        temps = [p.temperature for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # >= vocab: no cut
        windowed = [i for i, k in enumerate(top_k) if k]
        nucleus = [i for i, (k, p) in enumerate(zip(top_k, params, strict=True)) if not k and p.top_p < 1]
        p_less = [i for i, p in enumerate(params) if p.p_less]

        def upload(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def subset(chosen: list[int], out_of: int) -> Tensor | None:
            return None if len(chosen) == out_of else upload(chosen, torch.int64)

        return cls(
            rows=subset(drawing, len(rows)),
            temperature=upload(temps, torch.float32) if any(t != 1 for t in temps) else None,
            min_p=upload([p.min_p for p in params], torch.float32),
            top_p=upload([p.top_p for p in params], torch.float64),
            seed=upload([rows[i].seed for i in drawing], torch.int64),
            position=upload([rows[i].position for i in drawing], torch.int64),
            window=max(top_k),
            window_rows=subset(windowed, len(params)) if windowed else None,
            top_k=upload([top_k[i] for i in windowed], torch.int64) if windowed else None,
            window_top_p=(upload([params[i].top_p < 1 for i in windowed], torch.bool)
                          if any(params[i].top_p < 1 for i in windowed) else None),
            any_nucleus=bool(nucleus),
            nucleus_rows=subset(nucleus, len(params)) if nucleus else None,
            shape=ShapeParams.build(params, top_k, upload, subset),
            p_less_rows=subset(p_less, len(params)) if p_less else None,
            any_p_less=bool(p_less),
        )


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
            draw=DrawParams.build(rows, drawing, vocab_size, device) if drawing else None,
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


def _edits(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> LogitEdits | None:
    if not any(row.params.logit_bias or row.params.repetition_penalty != 1
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
    )
    return None if edits == LogitEdits(None, None, None, None) else edits


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
    constrained = _rows(logits, mask.rows).masked_fill(~allowed, -torch.inf)
    return _put_rows(logits, mask.rows, constrained)


def _pick(logits: Tensor, batch: SamplingBatch) -> Tensor:
    draw = batch.draw
    if draw is None:
        return _argmax(logits)
    sampled = _sample(_rows(logits, draw.rows), draw)
    if not batch.any_greedy:
        return sampled
    return _argmax(logits).index_copy(0, draw.rows, sampled)


def _rows(tensor: Tensor, rows: Tensor | None) -> Tensor:
    """The given rows of `tensor`; all of them (no copy) when `rows` is None."""
    return tensor if rows is None else tensor.index_select(0, rows)


def _raise_rows(values: Tensor, rows: Tensor | None, floor: Tensor) -> Tensor:
    """`values` raised to at least `floor` on the given rows (all rows when None)."""
    if rows is None:
        return torch.maximum(values, floor)
    return values.index_put((rows,), torch.maximum(values.index_select(0, rows), floor))


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
    """In the order repetition, frequency, presence, bias: each cell rounds as one formula would."""
    if (cells := edits.repetition) is not None:
        old = edited[cells.rows, cells.cols]
        edited.index_put_((cells.rows, cells.cols),
                          torch.where(old > 0, old / cells.values, old * cells.values))
    if (cells := edits.frequency) is not None:
        edited.index_put_((cells.rows, cells.cols),
                          edited[cells.rows, cells.cols] - cells.values - edits.presence)
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
    return _draw(_kept_mass(logits, draw), uniform_from_counter(draw.seed, draw.position))


def _kept_mass(logits: Tensor, draw: DrawParams) -> Tensor:
    """Each drawing row's kept probabilities as integers (see `_mass`); 0 where dropped."""
    scaled = logits if draw.temperature is None else logits / draw.temperature[:, None]
    if draw.shape is not None and draw.shape.rows is None and draw.shape.top_k is None:
        probs = _shaped_probs(scaled, None, draw.shape)  # every row's p is its survivors' softmax
    else:
        # A row whose every logit is -inf gives NaN; it keeps nothing and falls to token 0.
        probs = torch.softmax(scaled, dim=-1).nan_to_num_(0.0)
        if draw.shape is not None:
            probs = _shaped_probs(scaled, probs, draw.shape)
    keep = probs >= _thresholds(probs, draw)[:, None]
    if draw.any_p_less:
        keep = _p_less_keep(probs, keep, draw.p_less_rows)
    # In place from here: probs is this function's own tensor, and fresh [rows, vocab] buffers
    # cost page faults on CPU.
    return probs.mul_(keep).mul_(2.0**MASS_BITS).long()  # as _mass: exact, a power of two


def _shaped_probs(scaled: Tensor, probs: Tensor | None, shape: ShapeParams) -> Tensor:
    """`probs` with each shaped row replaced by the softmax over its top_n_sigma, top_k and
    typical_p survivors. top_k and top_p apply again to that p, as thresholds: top_k then keeps
    every survivor (there are at most k), and top_p and min_p read the renormalized mass.
    `probs` may be None when every row is shaped and none has top_k: nothing reads it."""
    scaled_rows = _rows(scaled, shape.rows)
    alive = torch.ones_like(scaled_rows, dtype=torch.bool)
    if shape.n_sigma is not None:
        part = _rows(scaled_rows, shape.sigma_rows)
        alive = _put_rows(alive, shape.sigma_rows, part >= _sigma_cut(part, shape.n_sigma)[:, None])
    if shape.typical_p is not None:
        part_alive = _rows(alive, shape.typical_rows).clone()
        if shape.top_k is not None:
            part_probs = _rows(_rows(probs, shape.rows), shape.typical_rows)
            part_alive &= part_probs >= _top_k_floor(part_probs, shape)[:, None]
        part = _rows(scaled_rows, shape.typical_rows).masked_fill(~part_alive, -torch.inf)
        alive = _put_rows(alive, shape.typical_rows, part_alive & _typical_keep(part, shape.typical_p))
    fresh = torch.softmax(scaled_rows.masked_fill(alive.logical_not_(), -torch.inf), dim=-1).nan_to_num_(0.0)
    return _put_rows(probs, shape.rows, fresh)


def _put_rows(values: Tensor, rows: Tensor | None, new: Tensor) -> Tensor:
    """`values` with the given rows replaced by `new` (all of them when None)."""
    return new if rows is None else values.index_copy(0, rows, new)


def _top_k_floor(probs: Tensor, shape: ShapeParams) -> Tensor:
    """Each typical row's k-th largest p, 0 where it has no top_k: top_k before typical_p."""
    kth = probs.topk(shape.window, dim=-1).values.gather(1, (shape.top_k - 1).clamp(min=0)[:, None])
    return kth.squeeze(1) * (shape.top_k > 0)


def _fixed_sum_(terms: Tensor) -> Tensor:
    """The float64 row sums of terms in [-1, 1], summed as fixed-point integers: exact in any
    order. Consumes `terms` (scaled and rounded in place: fresh [rows, vocab] buffers cost page
    faults on CPU, and these sums run over whole rows)."""
    fixed = terms.mul_(2.0**FIXED_BITS).round_()
    return torch.sum(fixed, -1, dtype=torch.int64).double() * 2.0**-FIXED_BITS


def _sigma_cut(scaled: Tensor, n_sigma: Tensor) -> Tensor:
    """max - n x std of each row's finite logits (float64). The distances below the max are
    scaled into [0, 1] by a power of two, so the fixed-point sums keep their precision.
    Two float64 buffers in all: the scaled distances, then (in place) their spread."""
    infinite = scaled.isfinite().logical_not_()
    count = scaled.shape[-1] - infinite.sum(-1).double()
    top = scaled.amax(-1)
    below = torch.sub(top[:, None], scaled).masked_fill_(infinite, 0.0)
    unit = torch.exp2(-torch.frexp(below.amax(-1)).exponent.double())  # below * unit <= 1
    scaled_below = below.double().mul_(unit[:, None])
    mean = _fixed_sum_(scaled_below.clone()) / count
    spread = scaled_below.sub_(mean[:, None]).masked_fill_(infinite, 0.0)
    std = (_fixed_sum_(spread.square_()) / count).sqrt() / unit
    return top.double() - n_sigma * std


def _typical_keep(logits: Tensor, typical_p: Tensor) -> Tensor:
    """The most typical tokens (|-log q - H| smallest first) holding typical_p of q's mass."""
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    entropy = -_fixed_sum_((q * log_q).nan_to_num_(0.0)).float()  # 0 x -inf is NaN: no term
    # In place from here, log_q and q are this function's own.
    shifted = log_q.neg_().sub_(entropy[:, None]).abs_().nan_to_num_(torch.inf)
    # float32 >= 0 orders like its bits; subtracting them from +inf's bits reverses the order.
    keys = shifted.view(torch.int32).neg_().add_(_INF_BITS).clamp_(min=0)
    return keys >= _radix_cut(keys, q.mul_(2.0**MASS_BITS).long(), typical_p)[:, None]


def _draw(kept: Tensor, u: Tensor) -> Tensor:
    """The first token whose running kept mass passes u * total, group sums first."""
    rows, vocab = kept.shape
    width = GROUP if vocab % GROUP == 0 else vocab
    groups = kept.view(rows, vocab // width, width)
    sums = groups.sum(-1)
    running = sums.cumsum(-1)
    total = running[:, -1]
    target = torch.minimum((u * total.double()).long(), total - 1)  # floor: both are >= 0
    group = torch.searchsorted(running, target[:, None], right=True)  # [rows, 1]
    before = (running - sums).gather(1, group).squeeze(1)
    inside = groups.gather(1, group[:, :, None].expand(rows, 1, width)).squeeze(1).cumsum(-1)
    offset = torch.searchsorted(inside, (target - before)[:, None], right=True)
    return (group * width + offset).squeeze(1)


def _mass(probs: Tensor) -> Tensor:
    """Probabilities as exact integers: scaling by a power of two rounds nothing."""
    return (probs * 2.0**MASS_BITS).long()


def _thresholds(probs: Tensor, draw: DrawParams) -> Tensor:
    """Each row's smallest kept probability: the largest of its top_k, top_p and min_p cuts."""
    threshold = draw.min_p * probs.amax(-1)
    if draw.top_k is not None:
        threshold = _raise_rows(threshold, draw.window_rows,
                                _top_k_cut(_rows(probs, draw.window_rows), draw))
    if draw.any_nucleus:
        nucleus = _rows(probs, draw.nucleus_rows)
        cut = _top_p_by_radix(nucleus, _mass(nucleus), _rows(draw.top_p, draw.nucleus_rows))
        threshold = _raise_rows(threshold, draw.nucleus_rows, cut)
    return threshold


def _p_less_keep(probs: Tensor, keep: Tensor, rows: Tensor | None) -> Tensor:
    """p-less last: of what the other filters kept (q = p / P over it), keep q >= sum(q**2),
    that is p >= sum(p**2) / P. Both sums are exact (integer mass, fixed-point squares), and
    the cut is capped at the largest p so rounding never empties a uniform row."""
    part, part_keep = _rows(probs, rows), _rows(keep, rows)
    kept = part * part_keep
    total = _mass(kept).sum(-1).double() * 2.0**-MASS_BITS
    cut = torch.minimum(_fixed_sum_(kept.double().square()) / total, part.amax(-1).double())
    return _put_rows(keep, rows, part_keep & (part.double() >= cut[:, None]))


def _top_k_cut(probs: Tensor, draw: DrawParams) -> Tensor:
    """The k-th largest p of each windowed row, raised to its top_p cut where it has one."""
    window = probs.topk(draw.window, dim=-1).values  # sorted, largest first
    kth = window.gather(1, (draw.top_k - 1)[:, None]).squeeze(1)
    if draw.window_top_p is None:
        return kth
    top_p = _rows(draw.top_p, draw.window_rows)
    return torch.maximum(kth, _top_p_in_window(probs, window, kth, top_p) * draw.window_top_p)


def _mass_needed(top_p: Tensor, total: Tensor) -> Tensor:
    """The integer mass the kept set must reach: ceil(top_p * total), at least 1."""
    return torch.minimum(torch.ceil(top_p * total.double()).long(), total).clamp(min=1)


def _top_p_in_window(probs: Tensor, window: Tensor, kth: Tensor, top_p: Tensor) -> Tensor:
    """top_p after top_k: the cut lies inside the window, whose order is largest first."""
    window_mass = _mass(window)
    # Tokens tied with the k-th may sit outside the window; they are kept, so count them all.
    ties = (probs == kth[:, None]).sum(-1)
    above = (window_mass * (window > kth[:, None])).sum(-1)
    total = above + ties * _mass(kth)
    need = _mass_needed(top_p, total)
    first = torch.searchsorted(window_mass.cumsum(-1), need[:, None]).clamp(max=window.shape[1] - 1)
    return torch.maximum(window.gather(1, first).squeeze(1), kth)


def _top_p_by_radix(probs: Tensor, mass: Tensor, top_p: Tensor) -> Tensor:
    """The largest p whose {probs >= p} holds top_p of the mass: a radix select, no sort.

    Non-negative float32s order like their bits, so three passes over 10, 10 and 11 bits of
    those bits, each summing integer mass per bucket, find the cut exactly.
    """
    return _radix_cut(probs.view(torch.int32), mass, top_p).view(torch.float32)


def _radix_cut(bits: Tensor, mass: Tensor, fraction: Tensor) -> Tensor:
    """The largest int32 key whose {bits >= key} holds `fraction` of the mass (keys in [0, 2**31))."""
    total = mass.sum(-1)
    spare = total - _mass_needed(fraction, total)  # mass the kept set may leave out, below the cut
    # Two scratch buffers for every pass: fresh [rows, vocab] tensors cost page faults on CPU.
    digits, slots = torch.empty_like(bits), torch.empty_like(mass)
    prefix = torch.zeros_like(total)
    for shift, width in RADIX_PASSES:
        torch.bitwise_right_shift(bits, shift, out=digits)  # int32: half the bytes of int64
        if shift + width < 31:  # the top pass has no prefix yet: every digit is in range
            digits.sub_((prefix << width).to(torch.int32)[:, None])
        # Slot 0 gathers everything below the chosen prefix, slot 2**width + 1 all above it.
        slots.copy_(digits.clamp_(-1, 1 << width).add_(1))
        prefix = _radix_digit(slots, mass, spare, prefix, width)
    return prefix.to(torch.int32)


def _radix_digit(slots: Tensor, mass: Tensor, spare: Tensor, prefix: Tensor, width: int) -> Tensor:
    hist = torch.zeros(slots.shape[0], (1 << width) + 2, dtype=torch.int64, device=slots.device)
    # under[d]: the mass below the region plus that of digits < d, rising with d. The mass
    # above the region is under `need`, so under[2**width] and beyond never fit in `spare`.
    under = hist.scatter_add_(1, slots, mass).cumsum(-1)
    # The cut's digit is the largest d whose mass strictly under it fits in `spare`.
    fitting = torch.searchsorted(under, spare[:, None], right=True).squeeze(1)
    return (prefix << width) | (fitting - 1)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical shift of int64 bits: torch's >> is arithmetic, so mask the copied sign bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 tensors (multiplication wraps like uint64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def uniform_from_counter(seed: Tensor, position: Tensor) -> Tensor:
    """float64 in [0, 1): output number `position` of SplitMix64 seeded with `seed`.

    A pure function of (seed, position), computed on the device: no generator state, so a row
    draws the same number whatever batch it is in and however often it was preempted.
    """
    state = seed + (position + 1) * _GOLDEN_GAMMA
    return _shift_right(_mix64(state), 11).double() * 2.0**-53


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
