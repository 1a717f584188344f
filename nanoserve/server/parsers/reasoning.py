"""Reasoning models: the thinking between the think tags, apart from the answer.

Owns: the parsers by vLLM's names (`qwen3`, `deepseek_r1`: both `<think>` ... `</think>`, each
tag one token; deepseek_r1 reads the output before the end tag as thinking even when the
start tag never came) and the automatic choice from the chat template where it is certain
(`ReasoningConfig`, from `serve --reasoning-parser` and `--reasoning-budget`);
`ReasoningPlan.for_prompt`, where a request's output begins, read from its prompt's tokens
(inside the block when the prompt opened it: a template that ends the generation prompt with
the start tag, or `continue_final_message`; answering at once when the prompt has just closed
it: `enable_thinking: false`), and the think block its grammar puts ahead of the answer (so
structured outputs and tool grammars start at the end tag, and a thinking budget forces the
end tag when it is spent); `ReasoningReader`, one choice's text into reasoning and content,
whole or streamed, and its count of reasoning tokens (the block's tokens, its tags included).
Refuses: compiling grammars (`nanoserve.engine.structured` does) and the chat's protocol fields
(`protocol`, `planning` read them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import StructuredOutputs, ThinkingPrefix

if TYPE_CHECKING:
    from nanoserve.tokenizer import Tokenizer

AUTO, OFF = "auto", "none"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    implicit_start: bool  # the output before the end tag is thinking even without the start tag
    start: str = "<think>"
    end: str = "</think>"


PARSERS = {"qwen3": ReasoningParser("qwen3", implicit_start=False),
           "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True)}
PARSER_CHOICES = (AUTO, OFF, *PARSERS)


def detect_parser(chat_template: str | None) -> ReasoningParser | None:
    """The parser a chat template certainly wants: one that writes both think tags, in
    DeepSeek's turn markers or in ChatML (Qwen3, QwQ); None when unsure."""
    if not chat_template or "<think>" not in chat_template or "</think>" not in chat_template:
        return None
    if "<｜Assistant｜>" in chat_template:
        return PARSERS["deepseek_r1"]
    if "<|im_start|>" in chat_template:
        return PARSERS["qwen3"]
    return None


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """A parser with its tags' token ids in the served model's vocabulary."""

    parser: ReasoningParser
    start_id: int
    end_id: int


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """`serve --reasoning-parser` (a name, auto: from the chat template, none: off) and
    `--reasoning-budget` (thinking tokens a request gets when it sets no thinking_token_budget)."""

    parser: str = AUTO
    budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.parser not in PARSER_CHOICES:
            raise InvalidRequestError(f"--reasoning-parser must be one of {', '.join(PARSER_CHOICES)}; "
                                      f"got {self.parser!r}", param="reasoning_parser")
        if self.budget_tokens is not None and self.budget_tokens < 0:
            raise InvalidRequestError(f"--reasoning-budget must be at least 0; got {self.budget_tokens}",
                                      param="reasoning_budget")

    def tags(self, tokenizer: Tokenizer) -> ThinkTags | None:
        """The parser for this model, or None (off, or auto and the template is not certain).
        A named parser whose tags are not single tokens of the model is an error."""
        if self.parser == OFF:
            return None
        parser = PARSERS.get(self.parser) or detect_parser(tokenizer.chat_template)
        if parser is None:
            return None
        start_id, end_id = (tokenizer.backend.token_to_id(tag) for tag in (parser.start, parser.end))
        if start_id is not None and end_id is not None:
            return ThinkTags(parser, start_id, end_id)
        if self.parser == AUTO:
            return None
        raise InvalidRequestError(f"--reasoning-parser {parser.name} needs {parser.start} and {parser.end} "
                                  "as tokens of the model's vocabulary; this model has no such tokens",
                                  param="reasoning_parser")


# Where the output begins: inside the think block; inside it, perhaps writing the start tag
# first (deepseek_r1); perhaps opening it (qwen3), or answering at once; or past it.
Opening = Literal["inside", "implicit", "may_open", "closed"]


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One request's think block: where its output begins, its budget, whether the reply
    shows the thinking (vLLM's include_reasoning)."""

    tags: ThinkTags
    opening: Opening
    budget_tokens: int | None = None
    include: bool = True

    @classmethod
    def for_prompt(cls, tags: ThinkTags, prompt_ids: Sequence[int], tokenizer: Tokenizer, *,
                   budget_tokens: int | None, include: bool) -> ReasoningPlan:
        last_start, last_end = _last_index(prompt_ids, tags.start_id), _last_index(prompt_ids, tags.end_id)
        if last_start > last_end:
            opening: Opening = "inside"
        elif last_end >= 0 and not tokenizer.decode(prompt_ids[last_end + 1:]).strip():
            opening = "closed"
        else:
            opening = "implicit" if tags.parser.implicit_start else "may_open"
        return cls(tags, opening, budget_tokens, include)

    def constraint(self, answer: StructuredOutputs | None) -> StructuredOutputs | None:
        """The grammar of the whole output: the think block ahead of `answer` when the answer
        is constrained or the thinking has a budget; None when neither."""
        if self.opening == "closed" or (answer is None and self.budget_tokens is None):
            return answer
        prefix = ThinkingPrefix(
            self.tags.end_id, self.tags.parser.end,
            start_token_id=None if self.opening == "inside" else self.tags.start_id,
            start_optional=self.opening == "implicit", may_skip=self.opening == "may_open",
            budget_tokens=self.budget_tokens)
        if answer is None:
            return StructuredOutputs(thinking=prefix, param="thinking_token_budget")
        return dataclasses.replace(answer, thinking=prefix)

    def reader(self) -> ReasoningReader:
        state = {"inside": "thinking", "implicit": "thinking", "may_open": "undecided",
                 "closed": "answer"}[self.opening]
        return ReasoningReader(self.tags, state, strip_start=self.opening == "implicit")


def _last_index(ids: Sequence[int], token_id: int) -> int:
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == token_id), -1)


@dataclass(slots=True)
class ReasoningReader:
    """One choice's text into (reasoning, content) deltas; `count` follows its tokens."""

    tags: ThinkTags
    state: str  # "undecided" (the start tag may open the reply), "thinking", "answer"
    strip_start: bool = False  # deepseek_r1: a start tag the model writes itself is no thinking
    held: str = ""  # text that may be part of a tag
    thought: bool = False  # the reply entered the think block
    num_reasoning_tokens: int = 0
    _token_state: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self._token_state = self.state
        self.thought = self.state == "thinking"

    def feed(self, text: str, *, final: bool) -> tuple[str, str]:
        """(reasoning, content) for the next piece of text; the tail that may be part of a tag
        waits for the next piece (or the end: `final`)."""
        self.held += text
        reasoning: list[str] = []
        while True:
            if self.state == "undecided" and not self._open(final):
                return "", ""
            if self.state == "thinking":
                if not self._enter(reasoning, final):
                    return "".join(reasoning), ""
                continue
            if self.state == "answer":
                content, self.held = self.held, ""
                return "".join(reasoning), content

    def _open(self, final: bool) -> bool:
        """Whether the undecided reply has decided: opened with the start tag, or answering."""
        start, text = self.tags.parser.start, self.held.lstrip()
        if text.startswith(start):
            self.state, self.held, self.thought = "thinking", text[len(start):], True
            return True
        if not final and start.startswith(text):
            return False
        self.state = "answer"
        return True

    def _enter(self, reasoning: list[str], final: bool) -> bool:
        """Take thinking text into `reasoning`; True once the end tag moved the reply on."""
        parser = self.tags.parser
        if self.strip_start:
            text = self.held.lstrip()
            if text.startswith(parser.start):
                self.held, self.strip_start = text[len(parser.start):], False
            elif final or not parser.start.startswith(text):
                self.strip_start = False
            else:
                return False
        end = self.held.find(parser.end)
        if end >= 0:
            reasoning.append(self.held[:end])
            self.held, self.state = self.held[end + len(parser.end):], "answer"
            return True
        keep = 0 if final else _partial_tag(self.held, parser.end)
        reasoning.append(self.held[:len(self.held) - keep])
        self.held = self.held[len(self.held) - keep:]
        return False

    def count(self, token_ids: Sequence[int]) -> None:
        """Follow the generated tokens: those of the think block count as reasoning tokens."""
        for token_id in token_ids:
            if self._token_state == "undecided":
                self._token_state = "thinking" if token_id == self.tags.start_id else "answer"
            if self._token_state == "thinking":
                self.num_reasoning_tokens += 1
                if token_id == self.tags.end_id:
                    self._token_state = "answer"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None when it never thought."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.thought else None), content


def _partial_tag(text: str, tag: str) -> int:
    """How many of the text's last characters could begin `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
