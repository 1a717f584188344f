"""How a sampled row keeps its tokens and draws one: the filters after temperature (in the
order `engine.sampler` states), as integer mass, and the one source of randomness.

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

llama.cpp's XTC and mirostat, on the same integer mass. XTC comes last among the filters (as in
llama.cpp's default chain, after min_p): where its own keyed coin (`uniform_from_counter` on a
key mixed from the seed, at the row's position) falls at or under xtc_probability, every kept
token whose share of the kept mass is at least xtc_threshold, except the least likely of them
(ties with it all stay), is dropped, provided at least two are. Mirostat replaces the other
filters (SamplingParams refuses them together): v2 keeps the tokens whose surprise -log2 p is
at most mu (at least the most likely token); v1 estimates the Zipf exponent s from the 100 most
likely tokens and keeps the k most likely, k = (e * 2**mu / (1 - V**-e)) ** (1 / s), e = s - 1.
After the draw, mu moves by eta x (tau - the drawn token's surprise over the kept set). Each
request keeps its mu by position (`MirostatMu`, on the device): the draw at position p reads
mu[p] and writes mu[p + 1], so a position drawn again (after preemption) reads what it read
the first time, and mu is a function of the request's own logits and tokens alone.

Refuses: reading anything back to the host, keeping random-generator state per request, and
Python loops over rows (the sampler, `engine.sampler`, builds the per-row parameters once a
step and calls `kept_mass` on the drawing rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

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
MIROSTAT_M = 100  # llama.cpp's m: mirostat v1 estimates s from this many most likely tokens
# Mirostat v1's fixed-point sum of t_i x log(p_i / p_i+1): each term is below 128 (float32's
# smallest positive p is 2**-149), so dividing by this keeps the terms in [-1, 1].
_ZIPF_TERM_SCALE = 256.0


def _signed64(value: int) -> int:
    """The int64 with the same bits as an unsigned 64-bit constant (torch has no uint64 math)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _signed64(0x9E3779B97F4A7C15)  # SplitMix64's increment
_MIX_1 = _signed64(0xBF58476D1CE4E5B9)
_MIX_2 = _signed64(0x94D049BB133111EB)
_XTC_KEY = _signed64(0xD1B54A32D192ED03)  # mixed into the seed: XTC's coin is a stream of its own


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


class MirostatMu:
    """One request's mirostat mu by position, as 0-d float32 tensors on the device."""

    def __init__(self, tau: float, device: torch.device | str) -> None:
        # llama.cpp starts mu at 2 tau, in float32.
        self.by_position = {0: torch.tensor(2.0 * tau, dtype=torch.float32, device=device)}

    def at(self, position: int) -> Tensor:
        if position not in self.by_position:
            raise ValueError(f"no mirostat mu for position {position}: the draw before it never ran")
        return self.by_position[position]

    def record(self, position: int, mu: Tensor) -> None:
        """The mu the draw at `position - 1` left; older ones are never read again."""
        self.by_position[position] = mu
        for old in [p for p in self.by_position if p < position - 1]:
            del self.by_position[old]


@dataclass(frozen=True, slots=True)
class MirostatParams:
    """The mirostat rows of a step (into the drawing rows) and their requests' mu."""

    rows: Tensor | None  # [m] int64 into the drawing rows; None when all of them
    version_one: Tensor | None  # [m] bool, true for v1; None when every row is v2
    mu: Tensor  # [m] float32, each row's mu at its position
    tau: Tensor  # [m] float32
    eta: Tensor  # [m] float32
    states: tuple[MirostatMu, ...]
    positions: tuple[int, ...]

    def advance(self, kept: Tensor, tokens: Tensor) -> None:
        """Each row's next mu from its drawn token's surprise over the kept mass (no readback)."""
        part = rows_of(kept, self.rows)
        chosen = part.gather(1, rows_of(tokens, self.rows)[:, None]).squeeze(1)
        surprise = (chosen.double() / part.sum(-1).double()).log2().neg().float()
        mu = self.mu - self.eta * (surprise - self.tau)
        for state, position, value in zip(self.states, self.positions, mu.unbind(), strict=True):
            state.record(position + 1, value)


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
    xtc_rows: Tensor | None  # [x] int64 into the n: rows with XTC on; None when all n are
    xtc_probability: Tensor | None  # [x] float64; None when no row has XTC
    xtc_threshold: Tensor | None  # [x] float64
    mirostat: MirostatParams | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int], *,
              drawing: list[int], num_rows: int, vocab_size: int, device: torch.device | str,
              mirostat: MirostatParams | None = None) -> DrawParams:
        """The drawing rows' parameters (`params`, `seeds`, `positions` of rows `drawing` of a
        step of `num_rows` rows)."""
        temps = [p.temperature for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # >= vocab: no cut
        windowed = [i for i, k in enumerate(top_k) if k]
        nucleus = [i for i, (k, p) in enumerate(zip(top_k, params, strict=True)) if not k and p.top_p < 1]
        p_less = [i for i, p in enumerate(params) if p.p_less]
        xtc = [i for i, p in enumerate(params) if p.xtc_active]

        def upload(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def subset(chosen: list[int], out_of: int) -> Tensor | None:
            return None if len(chosen) == out_of else upload(chosen, torch.int64)

        return cls(
            rows=subset(drawing, num_rows),
            temperature=upload(temps, torch.float32) if any(t != 1 for t in temps) else None,
            min_p=upload([p.min_p for p in params], torch.float32),
            top_p=upload([p.top_p for p in params], torch.float64),
            seed=upload(list(seeds), torch.int64),
            position=upload(list(positions), torch.int64),
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
            xtc_rows=subset(xtc, len(params)) if xtc else None,
            xtc_probability=upload([params[i].xtc_probability for i in xtc], torch.float64) if xtc else None,
            xtc_threshold=upload([params[i].xtc_threshold for i in xtc], torch.float64) if xtc else None,
            mirostat=mirostat,
        )

def rows_of(tensor: Tensor, rows: Tensor | None) -> Tensor:
    """The given rows of `tensor`; all of them (no copy) when `rows` is None."""
    return tensor if rows is None else tensor.index_select(0, rows)

def raise_rows(values: Tensor, rows: Tensor | None, floor: Tensor) -> Tensor:
    """`values` raised to at least `floor` on the given rows (all rows when None)."""
    if rows is None:
        return torch.maximum(values, floor)
    return values.index_put((rows,), torch.maximum(values.index_select(0, rows), floor))


def kept_mass(logits: Tensor, draw: DrawParams) -> Tensor:
    """Each drawing row's kept probabilities as integers (see `_mass`); 0 where dropped."""
    scaled = logits if draw.temperature is None else logits / draw.temperature[:, None]
    if draw.shape is not None and draw.shape.rows is None and draw.shape.top_k is None:
        probs = _shaped_probs(scaled, None, draw.shape)  # every row's p is its survivors' softmax
    else:
        # A row whose every logit is -inf gives NaN; it keeps nothing and falls to token 0.
        probs = torch.softmax(scaled, dim=-1).nan_to_num_(0.0)
        if draw.shape is not None:
            probs = _shaped_probs(scaled, probs, draw.shape)
    threshold = _thresholds(probs, draw)
    if (mirostat := draw.mirostat) is not None:
        threshold = raise_rows(threshold, mirostat.rows,
                               _mirostat_cut(rows_of(probs, mirostat.rows), mirostat))
    keep = probs >= threshold[:, None]
    if draw.any_p_less:
        keep = _p_less_keep(probs, keep, draw.p_less_rows)
    if draw.xtc_probability is not None:
        keep = _xtc_keep(probs, keep, draw)
    # In place from here: probs is this function's own tensor, and fresh [rows, vocab] buffers
    # cost page faults on CPU.
    return probs.mul_(keep).mul_(2.0**MASS_BITS).long()  # as _mass: exact, a power of two


def _shaped_probs(scaled: Tensor, probs: Tensor | None, shape: ShapeParams) -> Tensor:
    """`probs` with each shaped row replaced by the softmax over its top_n_sigma, top_k and
    typical_p survivors. top_k and top_p apply again to that p, as thresholds: top_k then keeps
    every survivor (there are at most k), and top_p and min_p read the renormalized mass.
    `probs` may be None when every row is shaped and none has top_k: nothing reads it."""
    scaled_rows = rows_of(scaled, shape.rows)
    alive = torch.ones_like(scaled_rows, dtype=torch.bool)
    if shape.n_sigma is not None:
        part = rows_of(scaled_rows, shape.sigma_rows)
        alive = put_rows(alive, shape.sigma_rows, part >= _sigma_cut(part, shape.n_sigma)[:, None])
    if shape.typical_p is not None:
        part_alive = rows_of(alive, shape.typical_rows).clone()
        if shape.top_k is not None:
            part_probs = rows_of(rows_of(probs, shape.rows), shape.typical_rows)
            part_alive &= part_probs >= _top_k_floor(part_probs, shape)[:, None]
        part = rows_of(scaled_rows, shape.typical_rows).masked_fill(~part_alive, -torch.inf)
        alive = put_rows(alive, shape.typical_rows, part_alive & _typical_keep(part, shape.typical_p))
    fresh = torch.softmax(scaled_rows.masked_fill(alive.logical_not_(), -torch.inf), dim=-1).nan_to_num_(0.0)
    return put_rows(probs, shape.rows, fresh)


def put_rows(values: Tensor, rows: Tensor | None, new: Tensor) -> Tensor:
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


def draw_tokens(kept: Tensor, u: Tensor) -> Tensor:
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
        threshold = raise_rows(threshold, draw.window_rows,
                                _top_k_cut(rows_of(probs, draw.window_rows), draw))
    if draw.any_nucleus:
        nucleus = rows_of(probs, draw.nucleus_rows)
        cut = _top_p_by_radix(nucleus, _mass(nucleus), rows_of(draw.top_p, draw.nucleus_rows))
        threshold = raise_rows(threshold, draw.nucleus_rows, cut)
    return threshold


def _p_less_keep(probs: Tensor, keep: Tensor, rows: Tensor | None) -> Tensor:
    """p-less last: of what the other filters kept (q = p / P over it), keep q >= sum(q**2),
    that is p >= sum(p**2) / P. Both sums are exact (integer mass, fixed-point squares), and
    the cut is capped at the largest p so rounding never empties a uniform row."""
    part, part_keep = rows_of(probs, rows), rows_of(keep, rows)
    kept = part * part_keep
    total = _mass(kept).sum(-1).double() * 2.0**-MASS_BITS
    cut = torch.minimum(_fixed_sum_(kept.double().square()) / total, part.amax(-1).double())
    return put_rows(keep, rows, part_keep & (part.double() >= cut[:, None]))


def _xtc_keep(probs: Tensor, keep: Tensor, draw: DrawParams) -> Tensor:
    """XTC last: where the row's coin falls at or under xtc_probability and at least two kept
    tokens hold xtc_threshold of the kept mass each, all of those but the least likely go."""
    rows = draw.xtc_rows
    part_keep = rows_of(keep, rows)
    mass = _mass(rows_of(probs, rows) * part_keep)
    total = mass.sum(-1).double()
    above = part_keep & (mass.double() >= draw.xtc_threshold[:, None] * total[:, None])
    least = torch.where(above, mass, torch.iinfo(torch.int64).max).amin(-1)
    seed, position = rows_of(draw.seed, rows), rows_of(draw.position, rows)
    coin = uniform_from_counter(_mix64(seed ^ _XTC_KEY), position)
    applies = (coin <= draw.xtc_probability) & (above.sum(-1) >= 2)
    return put_rows(keep, rows, part_keep & ~(above & (mass > least[:, None]) & applies[:, None]))


def _mirostat_cut(probs: Tensor, mirostat: MirostatParams) -> Tensor:
    """Each mirostat row's smallest kept p: 2**-mu (v2, never above the largest p) or the k-th
    largest p (v1)."""
    cut = torch.minimum(torch.exp2(-mirostat.mu.double()).float(), probs.amax(-1))
    if mirostat.version_one is None:
        return cut
    ordered = probs.sort(dim=-1, descending=True).values
    return torch.where(mirostat.version_one, _mirostat_v1_cut(ordered, mirostat.mu), cut)


def _mirostat_v1_cut(ordered: Tensor, mu: Tensor) -> Tensor:
    """The k-th largest p, k from the Zipf exponent s estimated on the top MIROSTAT_M p
    (llama_sampler_mirostat_apply), the sums exact in any order (fixed point)."""
    vocab = ordered.shape[-1]
    top = ordered[:, :MIROSTAT_M].double()
    i = torch.arange(top.shape[-1] - 1, dtype=torch.float64, device=top.device)
    t = torch.log((i + 2) / (i + 1))
    # A zero p (a masked token) has no ratio: its term is left out.
    terms = (t * torch.log(top[:, :-1] / top[:, 1:])).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    t_squared = sum(math.log((j + 2) / (j + 1)) ** 2 for j in range(top.shape[-1] - 1))  # on the host
    s_hat = _fixed_sum_(terms.div_(_ZIPF_TERM_SCALE)) * _ZIPF_TERM_SCALE / t_squared
    epsilon = s_hat - 1
    k = (epsilon * torch.exp2(mu.double()) / (1 - float(vocab) ** -epsilon)) ** (1 / s_hat)
    k = k.nan_to_num(1.0, posinf=float(vocab)).clamp(1, vocab).long()
    return ordered.gather(1, (k - 1)[:, None]).squeeze(1)


def _top_k_cut(probs: Tensor, draw: DrawParams) -> Tensor:
    """The k-th largest p of each windowed row, raised to its top_p cut where it has one."""
    window = probs.topk(draw.window, dim=-1).values  # sorted, largest first
    kth = window.gather(1, (draw.top_k - 1)[:, None]).squeeze(1)
    if draw.window_top_p is None:
        return kth
    top_p = rows_of(draw.top_p, draw.window_rows)
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
