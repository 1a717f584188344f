"""Structured outputs: grammars compiled once per spec, one matcher per constrained request.

Owns: `GrammarCompiler` (a `StructuredOutputs` spec to an llguidance grammar, checked against
the model's tokenizer at admission, cached by spec, compiles counted and timed), `RowGrammar`
(one request's matcher: its row of the step's token bitmask, the token taken, whether the
grammar is complete) and `fill_bitmasks` (the host-side bitmask of a step's constrained rows).
Like vLLM's v1/structured_output, this is the one place that knows the grammar library.

Why llguidance: a dependency-free wheel, where xgrammar requires triton and transformers; it
compiles a schema an order of magnitude faster, and its per-token mask is small beside a
decode step (results/README.md, "Measured design choices", has the figures).

How a step uses it: the sampling batch asks `fill_bitmasks` for the constrained rows' masks
(host work from the matchers' state, uploaded once); the sampler sets the masked logits to
-inf; after the step's one readback the output processor hands each row's token to
`RowGrammar.accept`, which says whether the grammar is complete.
JSON comes out with ", " and ": " between items and no other whitespace outside strings:
free whitespace would let a weak model pad forever (vLLM's disable_any_whitespace).
Refuses: touching logits (the sampler does), deciding stop rules other than "the grammar is
complete" (output does), and silently enforcing less than asked: a schema keyword the library
cannot enforce is a refusal naming it, never an unconstrained answer.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import StructuredOutputs, ThinkingPrefix

log = logging.getLogger("nanoserve")

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}
MAX_CACHED_GRAMMARS = 256
BITS_PER_WORD = 32  # llguidance's bitmask: bit j of int32 word w allows token 32 w + j
# Steps a compiled grammar is walked at compile time (each: the mask, then its lowest allowed
# token): a grammar that compiles but cannot be parsed (a JSON schema with no finite instance,
# which llguidance gives up on as too complex at its first token) is refused at admission
# rather than found mid-request.
PROBE_STEPS = 4


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a spec; a ValueError for what does not even parse."""
    if spec.thinking is None:
        return _answer_grammar(spec)
    answer = _named_answer(_answer_grammar(spec)) if spec.kind is not None else None
    top = {"name": "thinking", "lark_grammar": _thinking_lark(spec.thinking, answer is not None)}
    return json.dumps({"grammars": [top, *([answer] if answer else [])]})


def _thinking_lark(thinking: ThinkingPrefix, constrained: bool) -> str:
    """The think block, then the end tag token, then the answer (`@answer`, or free text).

    The tags are matched as tokens (`<[id]>`): llguidance keeps added tokens apart from text,
    and the thinking may not spell the end tag out of other tokens either, so the answer
    starts exactly where the one end token is. `max_tokens` bounds the thinking's lexeme:
    when the budget is spent only the end token is allowed (the budget forced)."""
    end = f"<[{thinking.end_token_id}]>"
    start = "" if thinking.start_token_id is None else f"<[{thinking.start_token_id}]>"
    if start and thinking.start_optional:
        start += "?"
    budget = "" if thinking.budget_tokens is None else f"[max_tokens={thinking.budget_tokens}]"
    tag = re.escape(thinking.end_tag).replace("/", "\\/")
    rules = [f"start: block answer{' | answer' if thinking.may_skip else ''}",
             f"block: {start} think {end}",
             f"think{budget}: THOUGHT",
             f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/",
             "answer: @answer" if constrained else "answer: ANSWER\nANSWER: /(?s:.*)/"]
    return "\n".join(rules)


def _named_answer(text: str) -> dict:
    """The answer's grammar as the sub-grammar `answer`: llguidance's JSON form or Lark text."""
    if text.lstrip().startswith("{"):
        grammars = json.loads(text)["grammars"]
        if len(grammars) == 1:
            return {**grammars[0], "name": "answer"}
    return {"name": "answer", "lark_grammar": text}


def _answer_grammar(spec: StructuredOutputs) -> str:
    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


@dataclass(slots=True)
class CompileStats:
    """Grammars compiled since start and the seconds they took; cache hits beside them."""

    compiles: int = 0
    compile_s: float = 0.0
    hits: int = 0


class GrammarCompiler:
    """Specs to compiled matchers, one compile per distinct spec (least recently used evicted).

    A compiled matcher is kept pristine; each request gets a deep copy (microseconds). Thread
    safe: the server's planning threads compile (at admission, off the engine thread) while the
    engine thread copies what they compiled.
    """

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # ~1 s to build: on first use
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the stats
        self._tokenizer_lock = threading.Lock()
        self.stats = CompileStats()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # built once, by whichever planning thread needs it first
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    def check(self, spec: StructuredOutputs) -> None:
        """Compile (or find) the spec's grammar; an InvalidRequestError naming the field if the
        library refuses it. Called at admission, before the request costs a step."""
        self._compiled(spec)

    def new_grammar(self, spec: StructuredOutputs) -> RowGrammar:
        return RowGrammar(self._compiled(spec).deep_copy())

    def _compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return self._cache[spec]
        # Compiled outside the lock: the engine thread only ever waits for a dict look-up,
        # never for a planning thread's compile (two racing compiles of one spec both count).
        matcher = self._compile(spec)
        with self._lock:
            self._cache[spec] = matcher
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        start_s = time.perf_counter()
        try:
            grammar = grammar_text(spec)
        except ValueError as error:
            raise _refusal(spec, str(error)) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - start_s
        if matcher.is_error():
            raise _refusal(spec, matcher.get_error())
        if (error := self._probe(matcher)) is not None:
            raise _refusal(spec, error)
        return matcher

    def _probe(self, matcher: llguidance.LLMatcher) -> str | None:
        """The library's error on a copy of `matcher` walked PROBE_STEPS tokens (each the lowest
        its mask allows), or None when it parses them."""
        walker = matcher.deep_copy()
        bitmask = np.zeros((1, -(-self._vocab_size // BITS_PER_WORD)), dtype=np.int32)
        for _ in range(PROBE_STEPS):
            llguidance.numpy.fill_next_token_bitmask(walker, bitmask, 0)
            if walker.is_error():
                return walker.get_error()
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
            if walker.is_stopped() or not allowed.size:
                return None
            if not walker.consume_token(int(allowed[0])) or walker.is_error():
                return walker.get_error() or "the grammar refuses every token its mask allows"
        return None


def _refusal(spec: StructuredOutputs, reason: str) -> InvalidRequestError:
    what = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
            "choice": "the choice", "grammar": "the grammar", None: "the thinking budget"}[spec.kind]
    # The library's messages can run over several lines with a caret line under the source.
    lines = [line.strip() for line in reason.splitlines() if line.strip().strip("^")]
    reason = " ".join(lines)[:300] or "no reason given"
    return InvalidRequestError(f"{what} cannot be enforced: {reason}", param=spec.param)


class RowGrammar:
    """One constrained request's matcher: where its output stands in the grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance on the token taken; True when the grammar is complete (the request stops)."""
        if not self.matcher.consume_token(token_id):
            # The mask forbids every token the matcher would refuse, so this is a bug; stop the
            # request rather than go on unconstrained.
            log.error("grammar refused token %d: %s", token_id, self.matcher.get_error())
            return True
        return self.matcher.is_stopped()


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_bitmasks(grammars: Sequence[RowGrammar], vocab_size: int) -> np.ndarray:
    """int32 [len(grammars), ceil(vocab / 32)]: each row's allowed next tokens, filled on the
    host from the matchers' state (in parallel threads, the GIL released)."""
    global _EXECUTOR
    words = -(-vocab_size // BITS_PER_WORD)
    bitmask = np.zeros((len(grammars), words), dtype=np.int32)
    if len(grammars) == 1:
        llguidance.numpy.fill_next_token_bitmask(grammars[0].matcher, bitmask, 0)
        return bitmask
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(
        _EXECUTOR, [(grammar.matcher, i) for i, grammar in enumerate(grammars)], bitmask)
    return bitmask
