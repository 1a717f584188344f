"""Admission: a request's inputs made ready for the scheduler, or refused before they cost anything.

Owns: `InputProcessor` (vLLM v1's input processor, shared the same way by the front end and the
core): prompt encoding (text through the tokenizer, token ids checked against the vocabulary),
the request checks (the length against what one request may hold, `max_request_tokens`, which
is the context or the whole KV pool if smaller; token ids and grammars the model cannot honour;
the task; pooling the engine cannot do), truncation, bad words tokenized, a vision-language
model's images placed in the prompt (`engine.images`), and the seed of an unseeded request. It
reads plain facts (the tokenizer, context length, block size, number of blocks, ...) and no
engine: `Engine.add_request` runs `process` on its own facts, and the server runs the same
checks piece by piece while it plans a body, on the engine's processor (one engine in this
process) or on one built from what a data-parallel replica reported
(`server/bridges/replicas.py`), so a request is refused with one message whichever serves it.
Refuses: engine state (request ids, adapters, output state, the scheduler's queues); those stay
with `Engine.add_request`.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.errors import InvalidRequestError
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # only held: the scheduler imports this module and stays free of them
    from nanoserve.engine.images import EngineImages, ImageData
    from nanoserve.engine.structured import GrammarCompiler
    from nanoserve.multimodal.inputs import ImageInput
    from nanoserve.tokenizer import Tokenizer


def request_token_limit(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The most tokens (prompt plus output) one request may ever hold: its context, or every
    block of the KV pool if that is less."""
    return min(max_model_len, num_blocks * block_size)


def check_fits(num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """Refuse, at admission, a request that could never finish: waiting would be forever."""
    if num_prompt_tokens >= limit:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens; this engine holds at most "
            f"{limit} tokens per request (prompt plus output)",
            param="prompt",
        )
    if num_prompt_tokens + max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
            f"{num_prompt_tokens + max_tokens}, over this engine's limit of {limit} tokens "
            f"per request; lower max_tokens to at most {limit - num_prompt_tokens}",
            param="max_tokens",
        )


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request's inputs as the scheduler takes them: encoded, truncated, checked, seeded."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own, else one drawn at admission
    pooling: PoolingParams | None  # an embedding request, its method resolved
    images: list[ImageInput]  # placed in prompt_ids (a vision-language model's)


@dataclass(frozen=True, slots=True)
class InputProcessor:
    """The checks and preparation of a request's inputs, over the facts of the engine that serves it."""

    tokenizer: Tokenizer
    grammars: GrammarCompiler  # compiles at the check, so the engine's copy is a cache hit
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    task: str  # "generate" or "embed"
    pooling_method: str  # an embedding request's method when it names none
    hidden_size: int  # the one vector length served
    tensor_parallel: bool
    images: EngineImages | None = None  # a vision-language model's image side; None: text only

    @property
    def max_request_tokens(self) -> int:
        return request_token_limit(self.max_model_len, self.num_blocks, self.block_size)

    def encode_prompt(self, prompt: str | Sequence[int], placed: Sequence[ImageInput] = ()) -> list[int]:
        """The prompt's token ids: a text's encoded, or token ids checked against the vocabulary
        (but at the positions of `placed` images' rows, whose image token id may lie outside it:
        `engine.images` checks those)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.checked_ids(prompt, {p for image in placed for p in image.positions})
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        return ids

    def encode_pieces(self, pieces: list[str], add_bos: bool | None = None) -> list[list[int]]:
        """The token ids of each piece of a prompt's text (`Tokenizer.encode_pieces`), checked."""
        return [self.checked_ids(ids) for ids in self.tokenizer.encode_pieces(pieces, add_bos=add_bos)]

    def checked_ids(self, token_ids: Sequence[int], exempt: Collection[int] = ()) -> list[int]:
        """`token_ids` as a list, refused unless each (but those at the `exempt` positions) is an
        integer in the vocabulary."""
        ids = list(token_ids)
        bad = [t for i, t in enumerate(ids)
               if not isinstance(t, int) or not (0 <= t < self.vocab_size or i in exempt)]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}",
                param="prompt")
        return ids

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_fits(num_prompt_tokens, max_tokens, self.max_request_tokens)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every check a request's prompt and sampling must pass, before it costs the engine anything."""
        params.validate_for_vocab(self.vocab_size)
        self.check_fits(len(prompt_ids), params.max_tokens)
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)  # compiled here once, then cached

    def check_pooling(self, pooling: PoolingParams) -> None:
        """Refuse an embedding request this engine cannot pool: with tensor parallelism, or a
        vector length other than the model's."""
        if not isinstance(pooling, PoolingParams):
            raise InvalidRequestError(f"pooling must be a PoolingParams; got {pooling!r}", param="pooling")
        if self.tensor_parallel:
            raise InvalidRequestError("embeddings are not supported with tensor parallelism yet",
                                      param="pooling")
        if pooling.dimensions is not None and pooling.dimensions != self.hidden_size:
            raise InvalidRequestError(f"dimensions must be this model's hidden size, {self.hidden_size}; "
                                      f"got {pooling.dimensions} (vectors are not truncated)",
                                      param="dimensions")

    def process(self, prompt: str | Sequence[int], params: SamplingParams | None,
                pooling: PoolingParams | None,
                images: Sequence[ImageData] | Sequence[ImageInput] | None = None) -> AdmittedRequest:
        """A request's inputs checked and prepared for the scheduler (`Engine.add_request`): with
        `pooling`, an embedding request, whose `params` give only its priority and cache salt;
        `images`, one per placeholder of a vision-language model's text prompt."""
        pooling = self._resolved_pooling(pooling)
        params = (params or SamplingParams()).with_bad_words_token_ids(
            lambda text: self.tokenizer.encode(text, add_bos=False)).with_dry_breakers(
            lambda text: self.tokenizer.breaker_sequences(text))
        prompt_ids, image_inputs = self._prompt_inputs(prompt, params, images)
        if pooling is not None:  # nothing sampled: one "token" of room, as a prompt must leave
            params = dataclasses.replace(SamplingParams(max_tokens=1, temperature=0.0),
                                         priority=params.priority, cache_salt=params.cache_salt)
        self.check_request(prompt_ids, params)
        # Unseeded requests get a random seed now, so seeded and unseeded share one code path.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return AdmittedRequest(prompt_ids, params, seed, pooling, image_inputs)

    def _prompt_inputs(self, prompt: str | Sequence[int], params: SamplingParams,
                       images: Sequence[ImageData] | Sequence[ImageInput] | None
                       ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids (truncated as `params` ask) and its images placed in them; or
        token ids and the `ImageInput`s placed in them already (by the server's planner), checked."""
        if not images:
            return params.truncate_prompt(self.encode_prompt(prompt)), []
        if self.images is None:
            raise InvalidRequestError("this is a text-only model: it takes no images", param="images")
        from nanoserve.multimodal.inputs import ImageInput

        placed = all(isinstance(image, ImageInput) for image in images)
        if not placed and not isinstance(prompt, str):
            raise InvalidRequestError("images need a text prompt (their placeholders are expanded in its "
                                      "text); got token ids", param="prompt")
        if self.tensor_parallel:
            raise InvalidRequestError("images are not supported with tensor parallelism yet", param="images")
        if placed:  # `prompt` holds their placeholders
            prompt_ids = self.encode_prompt(prompt, images)
            self.images.check_placed(prompt_ids, images)
            return prompt_ids, list(images)
        return self.images.prompt(prompt, images, self.encode_pieces, params.truncate_prompt)

    def _resolved_pooling(self, pooling: PoolingParams | None) -> PoolingParams | None:
        """An embedding request's pooling, checked, with this engine's method where it names
        none; a generation request refused by an engine of the embed task."""
        if pooling is not None:
            self.check_pooling(pooling)
            return dataclasses.replace(pooling, method=pooling.method or self.pooling_method)
        if self.task == "embed":
            raise InvalidRequestError("this engine runs the embed task: it pools embeddings and generates no "
                                      "text (start it with task 'generate' to generate)", param="task")
        return None
