"""Speculative decoding: who proposes drafts, how many, and how a verified run is read.

Owns: the options (`SpecConfig`), the prompt-lookup (n-gram) proposer, each request's drafting
state (`DraftState`, kept on the request: its n-gram index and its back-off when acceptance
falls), and `accepted_prefix`, the one rule of verification. The engine asks each decoding
request's `DraftState` for drafts after every step (or, with method "draft", whether it is
drafting, and asks `draft_model.DraftModel` for the drafts); the scheduler budgets them.
Refuses: sampling, stop rules and K/V bookkeeping. The verification itself is ordinary
sampling: the request's last token and its K drafts run as one chunk of K+1 rows, each row
sampled exactly as it would be without speculation (same (seed, position) key, penalties
counting the drafts before it), so a draft is accepted only where it equals the token the
engine would have produced anyway. With batch invariance (the default) a row's logits are the
same bits in a chunk as in a decode step, so speculation changes no token and no logprob.

Plain Python over integers (no torch), like the scheduler.

How prompt lookup proposes (as vLLM's `ngram` method and llama.cpp's lookup decoding): for n
from `ngram_max` down to `ngram_min`, find the most recent earlier occurrence of the request's
last n tokens in its prompt and output; the (up to) K tokens that followed it are the drafts.
Each request keeps a dict from every n-gram it has seen to where it last ended, grown by the
new tokens only, so a proposal costs O(ngram_max) dict lookups whatever the context length.

How many drafts a request carries (`SpecConfig.allot`; policy "cost", the default): a draft row
costs compute, and on a CPU whose kernels are compute-bound from one row a step's time grows
with its rows (`step_cost.StepCost.step_ms`), so a draft pays only if it is likely to be accepted.
Each request keeps an estimate `a` of how often a draft of its is accepted given the drafts
before it were (`DraftState.acceptance`: the accepted share of its last verifications, moving
back towards 1 a little each step it does not draft, which is how a request that stopped
drafting tries again). Its i-th draft is then worth a^i expected tokens. With B requests
decoding, a step with n draft rows is expected to emit T = B + (the worth of its drafts)
tokens in time c(B + n); the step takes the drafts, most likely first, that make T / c(B + n)
largest, and none if no choice beats B / c(B). So at 1 slot a request whose drafts are
accepted half the time still drafts (three drafts make a step of four rows, barely dearer
than two), and at 16 slots, where the rows fill whole groups of the kernels (four rows at a
time) and one more row costs a group, drafts run only when enough of them, accepted nearly
always, fill a group: speculation is never expected to lose. Policy "always"
drafts as many as it can (the proposer's and the scheduler's limits only), and
`disable_by_batch_size` (vLLM's --speculative-disable-by-batch-size) turns drafting off while
that many requests decode.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.engine.step_cost import PROFILED
from nanoserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig

# A draft id the host does not know: a draft model's draft, which stays on the device until the
# verification's readback (the model runner fills its input row from the proposal tensor).
ON_DEVICE = -1
MAX_SPECULATIVE_TOKENS = 16  # more drafts than this never pays: acceptance falls geometrically
METHODS = ("ngram", "draft")
POLICIES = ("cost", "always")
# The weight of the newest verification in a request's acceptance estimate: half, so a request
# that stops repeating its context stops drafting within a step or two.
ACCEPTANCE_WEIGHT = 0.5
# Each step a request decodes without drafts, its estimate moves this share of the way back to
# 1: from 0 it is back at 0.5 after 22 steps (drafting again at 1 slot), at 0.8 after 51.
ACCEPTANCE_RECOVERY = 1 / 32
# After a verification that accepts nothing, a request stops drafting for 1, 2, 4 ... steps,
# at most this many; any accepted draft resets it. A text that never repeats pays one wasted
# row now and then, not K rows every step.
MAX_BACKOFF_STEPS = 32


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How many drafts a request may carry per step, and where they come from."""

    num_tokens: int = 0  # K; 0 is off
    method: str = "ngram"
    ngram_min: int = 2
    ngram_max: int = 4
    policy: str = "cost"
    disable_by_batch_size: int | None = None  # no drafts while this many requests decode

    @classmethod
    def from_engine(cls, config: EngineConfig) -> SpecConfig:
        return cls(config.speculative_tokens, config.speculative_method, config.speculative_ngram_min,
                   config.speculative_ngram_max, config.speculative_policy,
                   config.speculative_disable_by_batch_size)

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def allot(self, candidates: Sequence[tuple[float, int]], decoding: int) -> list[int]:
        """How many drafts each candidate carries this step, given its (acceptance estimate,
        most drafts it can use) and the number of requests decoding (the module docstring)."""
        if self.disable_by_batch_size is not None and decoding >= self.disable_by_batch_size:
            return [0] * len(candidates)
        if self.policy == "always":
            return [min(limit, self.num_tokens) for _, limit in candidates]
        return cheapest_drafts(candidates, decoding, self.num_tokens)

    def check(self, *, draft_model: str | None) -> None:
        """Refuse what cannot run, naming the field (the CLI maps it to the option)."""
        if not 0 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]; got {self.num_tokens}",
                param="speculative_tokens")
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"speculative_method must be one of {', '.join(METHODS)}; got {self.method!r}",
                param="speculative_method")
        if self.method == "draft" and draft_model is None:
            raise InvalidRequestError("speculative_method 'draft' needs a draft model: set draft_model "
                                      "(--draft-model)", param="speculative_method")
        if self.method != "draft" and draft_model is not None:
            raise InvalidRequestError(f"draft_model is used only by speculative_method 'draft', not "
                                      f"{self.method!r}", param="draft_model")
        if self.policy not in POLICIES:
            raise InvalidRequestError(
                f"speculative_policy must be one of {', '.join(POLICIES)}; got {self.policy!r}",
                param="speculative_policy")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidRequestError(
                f"speculative_disable_by_batch_size must be at least 1 (or unset); got "
                f"{self.disable_by_batch_size}", param="speculative_disable_by_batch_size")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(
                f"speculative_ngram_min must be in [1, speculative_ngram_max={self.ngram_max}]; "
                f"got {self.ngram_min}", param="speculative_ngram_min")


def cheapest_drafts(candidates: Sequence[tuple[float, int]], decoding: int, max_drafts: int,
                    cost: Callable[[int], float] = PROFILED.step_ms) -> list[int]:
    """Drafts per candidate that make the step's expected tokens per unit of time largest.

    Candidate r's i-th draft is worth acceptance_r ** i tokens; drafts are taken most likely
    first, and the step keeps the longest run of them whose T / c(rows) is the best seen,
    where T = `decoding` + their worth and rows = `decoding` + their number.
    """
    counts = [0] * len(candidates)
    heap = [(-acceptance, r, 1) for r, (acceptance, limit) in enumerate(candidates)
            if min(limit, max_drafts) > 0 and acceptance > 0]
    heapq.heapify(heap)
    tokens, rows = float(decoding), decoding
    best, taken = tokens / cost(rows), []
    best_len = 0
    while heap:
        worth, r, i = heapq.heappop(heap)
        tokens, rows = tokens - worth, rows + 1
        taken.append(r)
        if tokens / cost(rows) > best:
            best, best_len = tokens / cost(rows), len(taken)
        acceptance, limit = candidates[r]
        if i < min(limit, max_drafts):
            heapq.heappush(heap, (-acceptance ** (i + 1), r, i + 1))
    for r in taken[:best_len]:
        counts[r] += 1
    return counts


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a request's tokens last ended, for n in [n_min, n_max].

    `ends[gram]` is the index just past the latest occurrence of `gram` that is not the
    current suffix: the index runs one token behind, so the suffix finds an earlier copy.
    """

    n_min: int
    n_max: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    first_ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # the earliest copy

    def extend(self, new_tokens: list[int]) -> None:
        """Take in the tokens that followed the ones already indexed."""
        for token in new_tokens:
            self._index_suffix()
            self.tokens.append(token)

    def _index_suffix(self) -> None:
        tokens, end = self.tokens, len(self.tokens)
        for n in range(self.n_min, min(self.n_max, end) + 1):
            gram = tuple(tokens[end - n:end])
            self.ends[gram] = end
            self.first_ends.setdefault(gram, end)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier copy of the longest matching suffix;
        the earliest copy's when the latest is too near the end to have k (a loop of short period)."""
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            gram = tuple(tokens[end - n:])
            start = self.ends.get(gram)
            if start is not None:
                drafts = tokens[start:start + k]
                if len(drafts) < k:
                    drafts = max(drafts, tokens[self.first_ends[gram]:self.first_ends[gram] + k], key=len)
                return drafts
        return []


@dataclass(slots=True)
class DraftState:
    """One request's drafting (kept on the request): its n-gram index, its back-off and its
    acceptance estimate.

    After a verification that accepts nothing, drafting pauses for 1, 2, 4 ... steps (at most
    `MAX_BACKOFF_STEPS`); any accepted draft resets it. `acceptance` estimates the chance that
    a draft is accepted given that the ones before it were (starting at 1: a request's first
    drafts are tried).
    """

    index: NgramIndex
    backoff_steps: int = 0  # how long the last pause was (0: none since the last acceptance)
    paused_for: int = 0  # steps left before drafting again
    acceptance: float = 1.0

    @classmethod
    def for_config(cls, config: SpecConfig) -> DraftState:
        return cls(NgramIndex(config.ngram_min, config.ngram_max))

    @property
    def num_indexed(self) -> int:
        return len(self.index.tokens)

    def ready(self) -> bool:
        """Whether to draft this step (a step of a pause counts down here)."""
        if self.paused_for:
            self.paused_for -= 1
            return False
        return True

    def propose(self, new_tokens: list[int], k: int) -> list[int]:
        """Drafts to follow the request's tokens (by prompt lookup), given those since the last call."""
        self.index.extend(new_tokens)
        return self.index.propose(k) if self.ready() else []

    def idle(self) -> None:
        """A step decoded without drafts: the estimate moves back towards 1 (to try again)."""
        self.acceptance += (1 - self.acceptance) * ACCEPTANCE_RECOVERY

    def record(self, drafted: int, accepted: int) -> None:
        """A verification's outcome."""
        if accepted:
            self.backoff_steps = 0
        elif drafted:
            self.backoff_steps = min(2 * self.backoff_steps or 1, MAX_BACKOFF_STEPS)
            self.paused_for = self.backoff_steps
        if drafted:
            # Drafts after the first rejected one were never tried: they say nothing.
            share = accepted / min(accepted + 1, drafted)
            self.acceptance += (share - self.acceptance) * ACCEPTANCE_WEIGHT


def accepted_prefix(drafts: tuple[int, ...] | list[int], sampled: list[int]) -> int:
    """How many drafts the verification accepts: the leading ones equal to what was sampled.

    `sampled[i]` is the token the engine draws after the drafts before i; the run emitted is
    `sampled[:accepted + 1]`, whose last token is the first that differs (or the bonus one).
    """
    accepted = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
