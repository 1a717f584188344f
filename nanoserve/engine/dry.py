"""DRY ("don't repeat yourself", llama.cpp's llama_sampler_dry, from koboldcpp): which tokens
would extend a repeat of the request's recent tokens, and by how much each is penalized.

Owns: `DryHistory`, one request's prompt and output tokens with, for every earlier position
j, the length of the longest run of tokens ending at j that equals the run ending at the
newest token (its repeat length). llama.cpp recomputes those lengths every step with a
Z-algorithm over the last `dry_penalty_last_n` tokens; here they are kept up to date one
token at a time (a token x extends the run ending at j - 1 to one ending at j wherever the
token at j is x), which gives the same lengths in one vectorized pass per new token.

A step's penalties (`penalties`) follow llama_sampler_dry_apply: the window is the last
`dry_penalty_last_n` tokens (-1: all of them); a repeat never reaches back past the most
recent sequence breaker (the longest breaker matching there), nor past the window's start;
the token after each position whose repeat is at least `dry_allowed_length` long would extend
that repeat, and takes `dry_multiplier * dry_base ** (length - dry_allowed_length)` off its
logit (the longest repeat it extends; the exponent clamped so the power stays finite in
float32), unless it is a one-token breaker itself.

Refuses: torch (the sampler uploads the cells), and work per step beyond the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from nanoserve.sampling_params import SamplingParams

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value, as llama.cpp clamps the exponent


class DryHistory:
    """One request's tokens and their repeat lengths against the newest one."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self.tokens = np.zeros(max(64, 2 * len(prompt_ids)), dtype=np.int64)
        self.repeats = np.zeros_like(self.tokens)  # repeats[j], j < size - 1: see the module
        self.size = len(prompt_ids)
        self.tokens[:self.size] = prompt_ids
        # The prompt's repeat lengths at once: the Z-function of the reversed prompt, whose
        # entry k is the common suffix of the prompt and its first size - k tokens.
        z = _z_function(list(prompt_ids)[::-1])
        self.repeats[:max(self.size - 1, 0)] = z[:0:-1]
        heads: dict[int, list[tuple[int, ...]]] = {}
        for head, tail in params.dry_breaker_token_ids:
            heads.setdefault(head, []).append(tail)
        self.breakers = heads
        self.breaker_heads = np.array(sorted(heads), dtype=np.int64)
        self.single_token_breakers = np.array(sorted(h for h, tails in heads.items() if () in tails),
                                              dtype=np.int64)

    def copy(self) -> DryHistory:
        twin = object.__new__(DryHistory)
        twin.__dict__.update(self.__dict__)
        twin.tokens, twin.repeats = self.tokens.copy(), self.repeats.copy()
        return twin

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._push(token)

    def _push(self, token: int) -> None:
        n = self.size
        if n == len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
            self.repeats = np.concatenate([self.repeats, np.zeros_like(self.repeats)])
        # Only the positions a later window can reach are kept current.
        window = self.params.dry_penalty_last_n
        low = 0 if window < 0 else max(0, n - window)
        # The run ending at j - 1 (0 before the first token), for every j in [low, n).
        before = np.concatenate([[0], self.repeats[:n]])[low:n]
        self.repeats[low:n] = np.where(self.tokens[low:n] == token, before + 1, 0)
        self.tokens[n] = token
        self.size = n + 1

    def penalties(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's (token ids, float32 penalties), each token once; empty when none."""
        none = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        params, size = self.params, self.size
        last_n = size if params.dry_penalty_last_n < 0 else min(params.dry_penalty_last_n, size)
        allowed = params.dry_allowed_length
        if last_n <= allowed:
            return none
        limit = self._repeat_limit(last_n)
        if limit < allowed:
            return none
        start = size - last_n
        # A repeat ending at window index i starts inside the window: at most i + 1 tokens.
        lengths = np.minimum(np.minimum(self.repeats[start:size - 1], np.arange(1, last_n)), limit)
        extending = lengths >= allowed
        tokens, lengths = self.tokens[start + 1:size][extending], lengths[extending]
        tokens, lengths = _longest_per_token(tokens, lengths)
        keep = ~np.isin(tokens, self.single_token_breakers)
        return tokens[keep], self._penalty(lengths[keep])

    def _repeat_limit(self, last_n: int) -> int:
        """How far back a repeat may reach: up to the most recent breaker in the window."""
        window = self.tokens[self.size - last_n:self.size]
        for i in (last_n - 1 - np.flatnonzero(np.isin(window, self.breaker_heads)))[::-1]:
            longest = max((len(tail) for tail in self.breakers[int(window[last_n - 1 - i])]
                           if len(tail) <= i and self._follows(i, tail)), default=-1)
            if longest >= 0:
                return int(i) - longest
        return last_n

    def _follows(self, distance: int, tail: tuple[int, ...]) -> bool:
        """Whether `tail` comes right after the token `distance` from the newest."""
        first = self.size - distance
        return tuple(self.tokens[first:first + len(tail)].tolist()) == tail

    def _penalty(self, lengths: np.ndarray) -> np.ndarray:
        params = self.params
        exponents = lengths - params.dry_allowed_length
        base = np.float32(params.dry_base)
        if base > np.float32(1.000001):
            exponents = np.minimum(exponents, int(np.float32(FLOAT_MAX_LOG) / np.float32(math.log(base))))
        return (np.float64(np.float32(params.dry_multiplier))
                * np.float64(base) ** exponents.astype(np.float64)).astype(np.float32)


def _z_function(values: list[int]) -> list[int]:
    """z[k]: the length of the longest common prefix of `values` and `values[k:]` (z[0] = 0)."""
    n = len(values)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and values[z[k]] == values[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def _longest_per_token(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unique, where = np.unique(tokens, return_inverse=True)
    longest = np.zeros(len(unique), dtype=np.int64)
    np.maximum.at(longest, where, lengths)
    return unique, longest
