"""Text in and out: encode/decode, chat templates, streaming detokenization, stop strings.

Owns: `Tokenizer` (a `tokenizers.Tokenizer` plus what tokenizer_config.json and
generation_config.json say about BOS, EOS and the chat template), `IncrementalDetokenizer`
(per-request, UTF-8 safe, O(1) work per token) and `StopStringMatcher` (per-request).
Refuses: finding or converting model files (loading.default_model, loading.gguf) and deciding when
generation ends (output); the matcher only reports that a stop string appeared.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoserve.errors import InvalidRequestError, ModelNotFoundError

REPLACEMENT_CHAR = "\ufffd"
# A template that indexes a content part's 'type' renders parts itself (`line['type'] == 'image'`).
_READS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")
# Prompt tokens that seed a detokenizer's context (vLLM seeds with 5 as well).
PROMPT_CONTEXT_TOKENS = 5
DRY_MAX_TAIL_TOKENS = 20  # llama.cpp's MAX_SEQ_LEN for a DRY breaker's tail


class Tokenizer:
    """A model's tokenizer: ids for text, text for ids, and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        special_tokens: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        # Every special token of tokenizer_config.json, by its config key (unk_token, pad_token,
        # additional_special_tokens...): HF hands them all to the chat template.
        self.special_tokens = dict(special_tokens or {})
        self._extra_eos_token_ids = frozenset(extra_eos_token_ids)
        self._compiled_template: Template | None = None
        self._byte_level = _decodes_byte_level(backend)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and generation_config.json (if present)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{path} has no tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        return cls(
            tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_chat_template(config, path),
            extra_eos_token_ids=_as_id_list(generation.get("eos_token_id")),
            special_tokens=_special_tokens(config),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the tokenizer's EOS and generation_config's."""
        own = {self.eos_token_id} - {None}
        return frozenset(own) | self._extra_eos_token_ids

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. `add_bos` None: the special tokens the config asks for (BOS first
        when add_bos_token, EOS last when add_eos_token); True: BOS; False: the text's ids alone.

        A chat goes through `encode_chat`, not here: its template places BOS itself.
        """
        return self.encode_pieces([text], add_bos=add_bos)[0]

    def encode_pieces(self, pieces: Sequence[str], *, add_bos: bool | None = None) -> list[list[int]]:
        """Token ids of each piece of a text cut where something that is not text goes (an image's
        rows), each piece encoded alone, as a special token between two pieces would leave them
        (and as llama.cpp's mtmd tokenizes the text around its media marker); the special tokens
        `encode` adds to a whole text (`add_bos` as there) go around them all: BOS before the
        first piece, EOS after the last."""
        ids = [self.backend.encode(piece, add_special_tokens=False).ids for piece in pieces]
        wants_bos = self.add_bos_token if add_bos is None else add_bos
        if wants_bos and self.bos_token_id is not None:
            ids[0].insert(0, self.bos_token_id)
        if add_bos is None and self.add_eos_token and self.eos_token_id is not None:
            ids[-1].append(self.eos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """The text of `token_ids`. `spaces_between_special_tokens` (vLLM's, true by default there;
        it matters only while special tokens are shown): each special token and the text runs
        around it are joined by a space, as transformers' and vLLM's slow detokenizers join them;
        false joins them with nothing, as this (fast) tokenizer does."""
        ids = list(token_ids)
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for token in ids:
            if token in self._special_ids:
                pieces += [self.backend.decode(run)] if run else []
                pieces.append(self.backend.decode([token], skip_special_tokens=False))
                run = []
            else:
                run.append(token)
        pieces += [self.backend.decode(run)] if run else []
        return " ".join(pieces)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, added in self.backend.get_added_tokens_decoder().items() if added.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for, as logprobs report them; a piece may be part of
        a character, so its decoded text cannot say."""
        piece = self.id_to_token(token_id) or ""
        if self._byte_level and all(char in BYTE_LEVEL_CHARS for char in piece):
            return bytes(BYTE_LEVEL_CHARS[char] for char in piece)
        if SENTENCEPIECE_BYTE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode()

    @functools.cached_property
    def _token_texts(self) -> list[str]:
        """Every token's own text, special tokens shown (llama.cpp's detokenize(.., true))."""
        return self.backend.decode_batch([[i] for i in range(self.backend.get_vocab_size())],
                                         skip_special_tokens=False)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a tokenizer lives as long as its engine)
    def breaker_sequences(self, text: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """DRY's sequence breaker `text` as (head token, tail ids) pairs, as llama.cpp's
        get_overlapping_token_sequences makes them: every token whose text holds `text` (no
        tail), and every token whose text ends with a prefix of it (the tail: the rest of
        `text`, tokenized, at most `DRY_MAX_TAIL_TOKENS` ids)."""
        pairs: dict[tuple[int, tuple[int, ...]], None] = {}
        for token, word in enumerate(self._token_texts):
            if text in word:
                pairs[(token, ())] = None
                continue
            for start in (i for i, char in enumerate(word) if char == text[0]):
                overlap = len(word) - start  # < len(text): text is not in word
                if word[start:] == text[:overlap]:
                    tail = self.encode(text[overlap:], add_bos=False)[:DRY_MAX_TAIL_TOKENS]
                    pairs[(token, tuple(tail))] = None
        return tuple(pairs)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None, *, chat_template: str | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for a chat, rendered by the model's own jinja2 template (or
        `chat_template`, one given for this call).

        `continue_final_message` (vLLM's and HF's name) leaves the last message open, so the
        model continues it instead of starting a new turn: the text ends where its content ends.
        `template_kwargs` are more variables for the template (vLLM's chat_template_kwargs,
        `tools`, `documents`); they cannot replace the ones this method sets.
        """
        _check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        fixed = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        if tools is not None:
            fixed["tools"] = tools
        clash = sorted(set(template_kwargs or {}) & set(fixed))
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(clash)}",
                                      param="chat_template_kwargs")
        template = self._template() if chat_template is None else _compile_template(chat_template)
        try:
            rendered = template.render({**self.special_tokens, "tools": None, **(template_kwargs or {}),
                                        **fixed})
        except TemplateError as err:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {err}", param="messages"
            ) from err
        if not continue_final_message:
            return rendered
        final = messages[-1]["content"]
        final_text = final if isinstance(final, str) else "".join(part.get("text", "") for part in final)
        return _open_final_message(rendered, final_text)

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """Token ids of a chat, ready to generate the assistant's reply: the template rendered,
        then encoded with no BOS added (unless `add_special_tokens`), since the template writes
        BOS itself where the model wants one. `generate --chat`, `LLM.chat` and the server's
        chat endpoint all encode a chat here."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tools=tools,
                                        chat_template=chat_template, template_kwargs=template_kwargs)
        return self.encode(text, add_bos=None if add_special_tokens else False)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _template(self) -> Template:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead of messages",
                param="messages",
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = _chat_environment().from_string(self.chat_template)
            except TemplateError as err:
                raise InvalidRequestError(
                    f"the model's chat template does not compile: {err}", param="messages"
                ) from err
        return self._compiled_template


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Template:
    """A chat template given with a request, compiled once for the requests that repeat it."""
    try:
        return _chat_environment().from_string(source)
    except TemplateError as err:
        raise InvalidRequestError(f"the chat template does not compile: {err}",
                                  param="chat_template") from err


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    # HF writes special tokens either as a string or as a serialized AddedToken.
    return token.get("content") if isinstance(token, Mapping) else token


def _chat_template(config: dict[str, Any], path: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # HF's named templates: [{"name", "template"}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """`*_token` entries (strings or serialized AddedTokens) and additional_special_tokens."""
    tokens: dict[str, Any] = {
        key: _token_content(value) for key, value in config.items()
        if key.endswith("_token") and isinstance(value, (str, Mapping))
    }
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [_token_content(token) for token in extra]
    return tokens


def _decodes_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """Whether pieces are GPT-2 style byte-level text; otherwise they are SentencePiece style."""
    decoder = backend.decoder
    return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: each piece character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


BYTE_LEVEL_CHARS = _byte_level_chars()
SENTENCEPIECE_SPACE = "\u2581"
SENTENCEPIECE_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _open_final_message(rendered: str, final_content: str) -> str:
    """`rendered` cut right after the last message's content (HF's continue_final_message)."""
    end = rendered.rfind(final_content.strip())
    if not final_content.strip() or end < 0:
        raise InvalidRequestError(
            "continue_final_message needs the last message's content in the rendered chat",
            param="continue_final_message",
        )
    return rendered[: end + len(final_content.strip())]


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidRequestError(f"messages[{i}].role must be a string", param="messages")
        if not isinstance(message.get("content"), str) and not _is_parts(message.get("content")):
            raise InvalidRequestError(f"messages[{i}].content must be a string (or a list of text and image "
                                      "parts)", param="messages")


def template_reads_parts(chat_template: str | None) -> bool:
    """Whether a chat template renders a message's content parts itself (SmolVLM's: it is then
    handed text and image parts, as transformers does) rather than a string with the image
    placeholders in it."""
    return bool(chat_template) and _READS_PARTS.search(chat_template) is not None


def _is_parts(content: Any) -> bool:
    """Content as a vision-language template reads it: {"type": "text", "text"} and {"type": "image"}."""
    return isinstance(content, list) and all(
        isinstance(part, Mapping) and (part.get("type") == "image"
                                       or (part.get("type") == "text" and isinstance(part.get("text"), str)))
        for part in content)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's signature, so templates that pass any of these render; jinja2's own tojson
    # HTML-escapes <, > and &, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment HF renders chat templates in, so the same prompt comes out."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class IncrementalDetokenizer:
    """Turns one request's token ids into text deltas as they arrive.

    Each push decodes only a window: the tokens of the last emitted delta (for context, so
    decoders that strip a leading space see the same neighbours as a full decode) plus the
    new ones. Before the first delta the context is the prompt's tail: SentencePiece-style
    decoders (Metaspace, Strip) drop the space of a decode's first token, which would eat the
    space before the first generated word. Text that ends in U+FFFD is an unfinished UTF-8
    character and is held back until a later token completes it; `flush` releases it when
    generation ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), spaces_between_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._window: list[int] = list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]
        self._context_len = len(self._window)  # leading window tokens whose text was already emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """The newly completed text after appending `token_ids` ("" while incomplete)."""
        if not token_ids:  # nothing new: keep the context the next token's text depends on
            return ""
        self._window.extend(token_ids)
        new_text = self._pending_text()
        if new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return new_text

    def flush(self) -> str:
        """Whatever is held back, replacement characters included; call when generation ends."""
        new_text = self._pending_text()
        self._advance()
        return new_text

    def _pending_text(self) -> str:
        context_text = self._decode(self._window[: self._context_len])
        return self._decode(self._window)[len(context_text) :]

    def _advance(self) -> None:
        self._window = self._window[self._context_len :]
        self._context_len = len(self._window)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      spaces_between_special_tokens=self._spaces_between_special_tokens)


@dataclass(frozen=True, slots=True)
class StopAutomaton:
    """One Aho-Corasick automaton over a request's stop strings, built once, shared by every
    matcher of those strings (the n choices of a request): its states are the trie's nodes,
    node 0 the root, each the prefix of some stop string it spells.

    Per node: `children` (char to node), `fail` (the node of its longest proper suffix that is
    a node), `depth` (its length), `hold` (the length of its longest suffix that is a *proper*
    prefix of some stop string: the tail a matcher must hold back) and `longest_stop` (the
    longest stop string that ends with it, "" if none: the one reported when a text first
    reaches it). Reading a character costs amortized O(1), whatever the number of strings.
    """

    children: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    hold: tuple[int, ...]
    longest_stop: tuple[str, ...]

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def build(stops: tuple[str, ...]) -> StopAutomaton:
        children: list[dict[str, int]] = [{}]
        ending: list[str] = [""]
        for stop in stops:
            node = 0
            for char in stop:
                if char not in children[node]:
                    children.append({})
                    ending.append("")
                    children[node][char] = len(children) - 1
                node = children[node][char]
            ending[node] = stop
        fail, depth, order = [0] * len(children), [0] * len(children), _breadth_first(children)
        for node in order:
            for char, child in children[node].items():
                fail[child] = _step(children, fail, fail[node], char) if node else 0
                depth[child] = depth[node] + 1
        hold, longest = [0] * len(children), [""] * len(children)
        for node in order[1:]:  # a node's fail link is shallower, so already filled
            hold[node] = depth[node] if children[node] else hold[fail[node]]
            longest[node] = ending[node] or longest[fail[node]]
        return StopAutomaton(tuple(children), tuple(fail), tuple(hold), tuple(longest))

    def next(self, node: int, char: str) -> int:
        return _step(self.children, self.fail, node, char)


def _step(children: Sequence[dict[str, int]], fail: Sequence[int], node: int, char: str) -> int:
    """The node after reading `char` at `node`: follow fail links until a child matches."""
    while True:
        child = children[node].get(char)
        if child is not None:
            return child
        if node == 0:
            return 0
        node = fail[node]


def _breadth_first(children: Sequence[dict[str, int]]) -> list[int]:
    order = [0]
    for node in order:
        order.extend(children[node].values())
    return order


class StopStringMatcher:
    """Finds the first stop string to complete in streamed text, across delta boundaries.

    The rule: the stop string whose end comes first in the whole text wins; if two end at the
    same character, the longer one (it starts earlier). Text before its start is emitted.
    Because the matcher reports a stop as soon as one completes, the answer does not depend
    on how the text was split into deltas.

    `feed` holds back the longest tail that is a proper prefix of some stop string. Any stop
    string ending later must start inside that tail or in later text (a start further back
    would make a longer such tail), so text it returns never has to be taken back.

    The text runs through one `StopAutomaton` over all the stop strings, one character at a
    time, so the work per token is the token's characters (plus a copy of the held tail),
    however many stop strings there are; `SamplingParams` caps their number and total length,
    which bounds the automaton's one-off build.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self._automaton = StopAutomaton.build(tuple(s for s in stop_strings if s))
        self._node = 0  # the automaton's state after every character fed so far
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str, *, armed: bool = True) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached); the stop string is dropped.

        With `armed=False` (before min_tokens) no stop string may end in `text`: one that
        completes there is ordinary text, but the tail is still held back, so a stop string
        that starts here and completes in a later, armed feed is found.
        """
        if self.stopped:
            return "", True
        automaton, node = self._automaton, self._node
        for index, char in enumerate(text):
            node = automaton.next(node, char)
            if armed and automaton.longest_stop[node]:
                self.matched = automaton.longest_stop[node]
                end = len(self._held) + index + 1
                emitted = (self._held + text[: index + 1])[: end - len(self.matched)]
                self._held = ""
                return emitted, True
        self._node = node
        buffer = self._held + text
        keep = automaton.hold[node]
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back tail, for when generation ends for another reason."""
        held, self._held, self._node = self._held, "", 0
        return held
