"""What a request asks of the sampler, validated once, on construction.

Owns: `SamplingParams`, a frozen record whose every field is checked in `__post_init__`, so a
bad value is refused (an `InvalidRequestError` naming the field, the value and the allowed
range) before the engine spends a step on it. Containers are normalized to tuples so the
record stays hashable. Refuses: importing torch (the scheduler imports this module and is
tested torch-free) and anything that needs the model, except `validate_for_vocab`, which the
engine calls once it knows the vocabulary size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from nanoserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_SEED = 2**63  # seeds live in int64 tensors on the device
MIN_TEMPERATURE = 1e-5  # below this, logits / temperature can overflow float32: greedy instead
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
MAX_LOGIT_BIAS_TOKENS = 1024  # OpenAI allows 300; a bias is built once per request, but not for free
# OpenAI allows 4 stop strings. Matching costs the same per token however many there are (one
# automaton), but building it and holding back a long prefix do not come free.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# Logits are divided by the repetition penalty in float32: much below this, a logit of a few
# hundred overflows to inf and the row degenerates (1e-40 is even 0 in float32).
MIN_REPETITION_PENALTY = 0.01
# llama-server's defaults for its own samplers (common/common.h, common_params_sampling).
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")
DRY_MAX_BREAKER_CHARS = 40  # llama.cpp truncates longer breakers; here they are refused
MAX_DRY_BREAKERS = 64
MIROSTAT_VERSIONS = (0, 1, 2)
# The samplers mirostat replaces (llama.cpp's chain with mirostat is temperature, then mirostat),
# with the value that leaves each off.
MIROSTAT_REPLACES = (("top_k", (-1, 0)), ("top_p", (1.0,)), ("min_p", (0.0,)), ("typical_p", (1.0,)),
                     ("top_n_sigma", (-1.0,)), ("p_less", (False,)), ("xtc_probability", (0.0,)))


def _refuse(param: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} must be {allowed}; got {value!r}", param=param)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _check_int(param: str, value: object, low: int, high: int | None, allowed: str) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise _refuse(param, value, allowed)


def _check_float(param: str, value: object, ok: bool, allowed: str) -> None:
    # `ok` is evaluated by the caller with `not (...)`-free comparisons, so NaN fails it.
    if not _is_number(value) or not math.isfinite(value) or not ok:
        raise _refuse(param, value, allowed)


def _in_range(value: object, low: float, high: float, *, open_low: bool = False) -> bool:
    if not _is_number(value):
        return False
    return (low < value if open_low else low <= value) and value <= high


def _token_ids(param: str, value: object) -> tuple[int, ...]:
    items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    if items is None or not all(_is_int(item) and item >= 0 for item in items):
        raise _refuse(param, value, "a list of non-negative integer token ids")
    return items


def _stop_strings(value: object) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise _refuse("stop", value, "a string or a list of strings")
    items = tuple(items)
    if len(items) > MAX_STOP_STRINGS:
        raise _refuse("stop", f"a list of {len(items)} strings", f"at most {MAX_STOP_STRINGS} strings")
    if not all(isinstance(item, str) and item for item in items):
        raise _refuse("stop", value, "a string or a list of non-empty strings")
    total = sum(map(len, items))
    if total > MAX_STOP_CHARS:
        raise _refuse("stop", f"stop strings of {total} characters in all",
                      f"at most {MAX_STOP_CHARS} characters in all")
    return items


def _words(param: str, value: object) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise _refuse(param, value, "a list of strings")
    items = tuple(items)
    if not all(isinstance(item, str) and item.strip() for item in items):
        raise _refuse(param, value, "a list of non-blank strings")
    return items


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    allowed = f"a map of token id to a bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    if not isinstance(pairs, Iterable) or isinstance(pairs, str):
        raise _refuse("logit_bias", value, allowed)
    pairs = list(pairs)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise _refuse("logit_bias", f"a map of {len(pairs)} tokens",
                      f"a map of at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    bias: dict[int, float] = {}
    for pair in pairs:
        token, amount = _bias_pair(pair, value, allowed)
        if token in bias:
            raise _refuse("logit_bias", value, allowed + " with each token id once")
        bias[token] = amount
    return tuple(sorted(bias.items()))  # sorted: equal maps make equal (and hashable) params


def _bias_pair(pair: object, whole: object, allowed: str) -> tuple[int, float]:
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise _refuse("logit_bias", whole, allowed)
    token, amount = pair
    if not _is_int(token) or token < 0:
        raise _refuse("logit_bias", whole, allowed + " (token ids are non-negative integers)")
    if not _in_range(amount, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT) or not math.isfinite(amount):
        raise _refuse("logit_bias", whole, allowed)
    return token, float(amount)


def _breakers(value: object) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    allowed = (f"a list of at most {MAX_DRY_BREAKERS} non-empty strings of at most "
               f"{DRY_MAX_BREAKER_CHARS} characters")
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise _refuse("dry_sequence_breakers", value, allowed)
    items = tuple(items)
    if len(items) > MAX_DRY_BREAKERS or not all(
            isinstance(item, str) and 0 < len(item) <= DRY_MAX_BREAKER_CHARS for item in items):
        raise _refuse("dry_sequence_breakers", value, allowed)
    return items


def keep_last_tokens(prompt_ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` ids (all of them when None)."""
    return prompt_ids if keep is None or len(prompt_ids) <= keep else prompt_ids[-keep:]


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class ThinkingPrefix:
    """A reasoning model's think block ahead of the answer: the output thinks (at most
    `budget_tokens` tokens, after which only the end tag may come), then takes the end tag
    token, then the answer. Where the output begins: inside the block (the prompt opened it),
    or, with `start_token_id`, at the start tag, which it may take first (`start_optional`) or
    must take unless `may_skip` lets it answer at once. `end_tag` is the end token's text,
    which the thinking may not spell out of other tokens either."""

    end_token_id: int
    end_tag: str
    start_token_id: int | None = None
    start_optional: bool = False
    may_skip: bool = False
    budget_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regex, a choice
    of strings, or a grammar (Lark, or llama.cpp's GBNF). Checked here for shape only; whether
    the grammar library can enforce it is `nanoserve.engine.structured`'s verdict, at admission.
    With `thinking`, the spec holds the answer after a think block (and none of the kinds
    leaves that answer free).

    `param` is the field the client sent it in (response_format, structured_outputs, tools...),
    so a refusal names that field; it is not part of the spec's identity.
    """

    json: str | Mapping | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    thinking: ThinkingPrefix | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) > 1 or (not given and self.thinking is None):
            raise _refuse(self.param, given or "nothing",
                          f"exactly one of {', '.join(STRUCTURED_KINDS)}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json, self.param))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice, self.param))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise _refuse(f"{self.param}.{kind}", value, "a non-empty string")

    @property
    def kind(self) -> str | None:
        """The answer's kind; None: a free answer after the think block."""
        return next((kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)), None)


def _schema_text(schema: object, param: str) -> str:
    """A JSON schema as JSON text (key order kept: it is the order properties come out in)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise _refuse(param, schema[:80], f"a JSON schema (the text is not JSON: {error})") from None
    if not isinstance(schema, Mapping | bool):
        raise _refuse(param, schema, "a JSON schema: an object (or true)")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _choices(value: object, param: str) -> tuple[str, ...]:
    items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str | Mapping) else ()
    if not items or not all(isinstance(item, str) and item for item in items):
        raise _refuse(f"{param}.choice", value, "a non-empty list of non-empty strings")
    return items


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    Filters apply in one fixed order, which `nanoserve.engine.sampler`'s docstring states (the
    penalties and masks, temperature, then the truncation filters through p_less), each on what
    the ones before it kept, renormalized. `is_greedy`
    requests take the argmax, ignore the filters and consume no randomness.

    `top_n_sigma`: keep the tokens whose temperature-scaled logit is at least max - n x the
    std of the row's finite scaled logits (llama.cpp's --top-nsigma); -1, llama.cpp's default,
    switches it off. `typical_p`: locally typical sampling (transformers' typical_p); 1 keeps
    every token. `p_less`: keep the tokens whose probability is at least the sum of the
    squared probabilities (p-less sampling, Tan et al. 2025): no parameter to tune.

    llama.cpp's samplers, with llama-server's names and defaults: DRY ("don't repeat yourself",
    `dry_multiplier` > 0 turns it on) subtracts `dry_multiplier * dry_base ** (n -
    dry_allowed_length)` from the logit of each token that would extend a repeat of n >=
    `dry_allowed_length` tokens of the last `dry_penalty_last_n` (-1: all, 0: off) prompt and
    output tokens, a repeat never reaching back past a `dry_sequence_breakers` string; the
    engine tokenizes the breakers (`with_dry_breakers`). XTC ("exclude top choices"): with
    probability `xtc_probability` (a keyed draw of its own, per (seed, position)), every token
    at or above `xtc_threshold` except the least likely of them is dropped (> 0.5: off).
    `mirostat` 1 or 2 (v1, v2): the kept set is cut each step to steer the chosen tokens'
    surprise (-log2 p) toward `mirostat_tau`, by `mirostat_eta` per step; it replaces top_k,
    top_p, min_p, typical_p, top_n_sigma, p_less and XTC (giving one of them too is refused).

    `structured_outputs`: the output must match a JSON schema, regex, choice or grammar
    (`StructuredOutputs`); each request's matcher masks its own row, and the request stops
    ("stop") when the grammar is complete. It cannot be combined with min_tokens (the grammar
    alone decides where the output may end), allowed_token_ids or bad_words (a ban could leave
    the grammar no token to take).

    `stop`: generation stops at the first stop string to be completed, and the returned text
    excludes it (`include_stop_str_in_output` keeps it, and the text of a stop token id);
    if two complete at the same character, the longer one is reported. A stop string counts
    only when a token past the first `min_tokens` completes it (it may start earlier).

    As in vLLM: `n` choices per prompt (`LLM.generate`, the server; choice i is `for_choice(i)`),
    `skip_special_tokens` leaves special tokens out of the text (shown, they are set apart by
    spaces unless `spaces_between_special_tokens` is false), `truncate_prompt_tokens`
    keeps only the prompt's last N tokens, `top_k` 0 or -1 is no limit, and `temperature`
    defaults to 1.0 (as in vLLM and OpenAI; `nanoserve generate` defaults to 0, greedy).

    `priority` (vLLM's): with the engine's scheduling_policy "priority", a lower value waits
    less and is preempted later; under "fcfs" (the default) it is accepted and changes nothing.

    `prompt_logprobs` (vLLM's): for every prompt position after the first, the logprob of the
    prompt's own token given the tokens before it, and the top-N alternatives (0: the token
    alone). They are the same values those tokens get when generated: the raw model
    distribution, before penalties, bias or temperature. A request asking for them takes no
    prefix-cache hits (a cached position has K/V but no logits), as in vLLM V1.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    cache_salt: str | None = None  # requests share cached prefix blocks only with the same salt
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # bad_words as token ids, each word with and without a leading space; the engine fills it
    # in from its tokenizer (`with_bad_words_token_ids`), as vLLM's update_from_tokenizer does.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    p_less: bool = False
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: under --scheduling-policy priority, lower values are admitted first and preempted
    # last; ignored under fcfs. Never changes a token.
    priority: int = 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_SEQUENCE_BREAKERS
    # Each breaker as (head token, tail token ids), as llama.cpp's get_overlapping_token_sequences
    # makes them; the engine fills it in from its tokenizer (`with_dry_breakers`).
    dry_breaker_token_ids: tuple[tuple[int, tuple[int, ...]], ...] = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "bad_words", _words("bad_words", self.bad_words))
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise _refuse("allowed_token_ids", self.allowed_token_ids, "null or a non-empty list")
            object.__setattr__(self, "allowed_token_ids", allowed)
        self._check_lengths()
        self._check_filters()
        self._check_penalties()
        self._check_llama_cpp_samplers()
        self._check_rest()

    def _check_lengths(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None, "an integer >= 1")
        _check_int("n", self.n, 1, None, "an integer >= 1")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None,
                       "null or an integer >= 1")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                   f"an integer in [0, max_tokens={self.max_tokens}]")

    def _check_filters(self) -> None:
        _check_float("temperature", self.temperature,
                     _in_range(self.temperature, 0.0, math.inf), "a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _refuse("top_k", self.top_k, "-1 or 0 (no limit, as vLLM) or an integer >= 1")
        _check_float("top_p", self.top_p, _in_range(self.top_p, 0.0, 1.0, open_low=True),
                     "a number in (0, 1]")
        _check_float("min_p", self.min_p, _in_range(self.min_p, 0.0, 1.0), "a number in [0, 1]")
        _check_float("typical_p", self.typical_p, _in_range(self.typical_p, 0.0, 1.0, open_low=True),
                     "a number in (0, 1] (1 keeps every token)")
        _check_float("top_n_sigma", self.top_n_sigma,
                     _is_number(self.top_n_sigma) and (self.top_n_sigma == -1 or self.top_n_sigma > 0),
                     "-1 (off) or a finite number > 0")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value, _in_range(value, -PENALTY_LIMIT, PENALTY_LIMIT),
                         f"a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        _check_float("repetition_penalty", self.repetition_penalty,
                     _in_range(self.repetition_penalty, MIN_REPETITION_PENALTY, PENALTY_LIMIT),
                     f"a number in [{MIN_REPETITION_PENALTY:g}, {PENALTY_LIMIT:g}]")

    def _check_llama_cpp_samplers(self) -> None:
        _check_float("dry_multiplier", self.dry_multiplier, _in_range(self.dry_multiplier, 0.0, math.inf),
                     "a finite number >= 0 (0 is off)")
        _check_float("dry_base", self.dry_base, _in_range(self.dry_base, 1.0, math.inf),
                     "a finite number >= 1")
        _check_int("dry_allowed_length", self.dry_allowed_length, 1, None, "an integer >= 1")
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n, -1, None,
                   "-1 (every token), 0 (off) or an integer >= 1")
        object.__setattr__(self, "dry_sequence_breakers", _breakers(self.dry_sequence_breakers))
        _check_float("xtc_probability", self.xtc_probability, _in_range(self.xtc_probability, 0.0, 1.0),
                     "a number in [0, 1] (0 is off)")
        _check_float("xtc_threshold", self.xtc_threshold, _in_range(self.xtc_threshold, 0.0, 1.0),
                     "a number in [0, 1] (above 0.5 is off, as in llama.cpp)")
        if not _is_int(self.mirostat) or self.mirostat not in MIROSTAT_VERSIONS:
            raise _refuse("mirostat", self.mirostat, "0 (off), 1 (mirostat) or 2 (mirostat 2.0)")
        _check_float("mirostat_tau", self.mirostat_tau, _in_range(self.mirostat_tau, 0.0, math.inf),
                     "a finite number >= 0")
        _check_float("mirostat_eta", self.mirostat_eta, _in_range(self.mirostat_eta, 0.0, math.inf),
                     "a finite number >= 0")
        if self.mirostat:
            for name, off in MIROSTAT_REPLACES:
                if getattr(self, name) not in off:
                    raise _refuse(name, getattr(self, name),
                                  f"{off[0]!r} (off) with mirostat {self.mirostat}: mirostat replaces it, "
                                  "as in llama.cpp's sampler chain")

    def _check_rest(self) -> None:
        _check_int("priority", self.priority, -MAX_SEED, MAX_SEED - 1, "an integer")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED - 1, "null or an integer in [0, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS,
                           f"null or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "p_less"):
            if not isinstance(getattr(self, name), bool):
                raise _refuse(name, getattr(self, name), "true or false")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise _refuse("cache_salt", self.cache_salt, "null or a non-empty string")
        self._check_structured()

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of a request's n: seed + index, so n seeded choices differ yet each
        reproduces; the prompt's logprobs are scored once, by choice 0."""
        if index == 0:
            return self
        if self.seed is None:
            return replace(self, prompt_logprobs=None)
        if self.seed + index >= MAX_SEED:
            raise InvalidRequestError(f"seed + n - 1 must stay below 2**63 (choice i uses seed + i); got "
                                      f"seed {self.seed} for choice {index}", param="seed")
        return replace(self, seed=self.seed + index, prompt_logprobs=None)

    def truncate_prompt(self, prompt_ids: list[int]) -> list[int]:
        """The prompt as the request sees it: its last `truncate_prompt_tokens` tokens, if set."""
        return keep_last_tokens(prompt_ids, self.truncate_prompt_tokens)

    def _check_structured(self) -> None:
        spec = self.structured_outputs
        if spec is None:
            return
        if not isinstance(spec, StructuredOutputs):
            raise _refuse("structured_outputs", spec, "a StructuredOutputs")
        if self.min_tokens:
            raise _refuse("min_tokens", self.min_tokens,
                          f"0 with {spec.param}: the grammar alone decides where the output ends")
        # A ban can leave a grammar no token to take (allowed_token_ids outside it, a bad word
        # it forces): the row's logits would all be -inf. Refused, never a silently cut answer.
        if self.allowed_token_ids is not None:
            raise _refuse("allowed_token_ids", list(self.allowed_token_ids),
                          f"null with {spec.param}: the grammar alone decides which tokens may come")
        if self.bad_words:
            raise _refuse("bad_words", list(self.bad_words),
                          f"empty with {spec.param}: a banned word the grammar needs would leave no token")

    @property
    def is_greedy(self) -> bool:
        """Greedy requests take the argmax and draw nothing: temperature 0 (or below
        `MIN_TEMPERATURE`, too small to divide logits by) or top_k 1."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def reads_output_values(self) -> bool:
        """Whether a draw depends on the values of the tokens generated so far (a penalty counts
        them, a bad word matches them), not only on how many there are."""
        return self.repetition_penalty != 1 or bool(self.frequency_penalty or self.presence_penalty
                                                    or self.bad_words_token_ids or self.dry_active
                                                    or self.carries_draw_state)

    @property
    def dry_active(self) -> bool:
        """Whether DRY edits any logit (llama.cpp's test in llama_sampler_dry_apply)."""
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def xtc_active(self) -> bool:
        """Whether XTC can drop a token (llama.cpp's test in llama_sample_xtc_apply)."""
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def carries_draw_state(self) -> bool:
        """Whether each draw moves the next one's cut (mirostat's mu): such a request's rows
        are never drafted ahead, since a draft row would need the mu of the draws before it."""
        return self.mirostat != 0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model cannot produce (called once the model is known)."""
        allowed = f"token ids in [0, {vocab_size})"
        bad_bias = [token for token, _ in self.logit_bias if token >= vocab_size]
        if bad_bias:
            raise _refuse("logit_bias", dict(self.logit_bias), f"{allowed}; {bad_bias} are not")
        bad_stop = [token for token in self.stop_token_ids if token >= vocab_size]
        if bad_stop:
            raise _refuse("stop_token_ids", self.stop_token_ids, f"{allowed}; {bad_stop} are not")
        bad_allowed = [token for token in self.allowed_token_ids or () if token >= vocab_size]
        if bad_allowed:
            raise _refuse("allowed_token_ids", self.allowed_token_ids, f"{allowed}; {bad_allowed} are not")

    def with_dry_breakers(self, overlaps: Callable[[str], Iterable[tuple[int, tuple[int, ...]]]]
                          ) -> SamplingParams:
        """These params with `dry_sequence_breakers` as token sequences: `overlaps(text)` gives
        each (head token, tail ids) whose head's text holds `text` or ends with a prefix of it
        (the tokenizer's `breaker_sequences`). Nothing is done unless DRY is on."""
        if not self.dry_active or self.dry_breaker_token_ids:
            return self
        sequences = {pair for breaker in self.dry_sequence_breakers for pair in overlaps(breaker)}
        return replace(self, dry_breaker_token_ids=tuple(sorted(sequences)))

    def with_bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These params with `bad_words` tokenized: each word alone and after a space."""
        if not self.bad_words:
            return self
        texts = [text for word in self.bad_words for text in (word.lstrip(), " " + word.lstrip())]
        words = {tuple(encode(text)) for text in texts}
        return replace(self, bad_words_token_ids=tuple(sorted(w for w in words if w)))
