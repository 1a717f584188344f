"""From a scheduler's plan to the model's flat batch, then logits, then sampled tokens.

Owns the layout of a step: decode rows first, as one attention group (a decode's speculative
drafts are rows of that group too, each a one-row sequence over the request's blocks), then
each prefill chunk as a group of its own; the flat cache slot of every row; which rows need logits
(a drafting chunk's newest-token row and every draft row, then the prompt rows a request asking
for prompt_logprobs scores); the rows an image's embedding rows replace (a chunk takes the slice
of each image that falls in it); each row's three M-RoPE positions, where a request's images
take grids of positions (Qwen2-VL: `multimodal.inputs.rope_positions`, its generated tokens
continuing past its images' shift); and the sampling rows in the same order, with the request id of each.

An embedding request's chunks sample nothing: the forward returns their final hidden states
(every row for mean pooling, the last prompt row for last pooling), and the chunk that completes
the prompt pools them into the request's vector on the device (`pool`), read back with the
step's tokens.

With deferred output a decode's newest token may still be pending (sampled by the step in
flight, not yet on the host): its input row is then filled on the device from that step's
`TokenBatch`, never from a host list, so preparing needs no readback. The same holds for a
draft model's drafts (`DeviceDrafts`): a chunk whose draft ids are `spec_decode.ON_DEVICE` has
its draft rows filled on the device from the proposal, and the sampled `TokenBatch` carries
those drafts, so the host reads them back with the tokens they are verified against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoserve.engine.output import DraftTokens, PooledVectors, PromptTokens, TokenBatch
from nanoserve.engine.request import Request
from nanoserve.engine.sampler import BatchedSampler, RowEdits, SamplingBatch, SamplingRow, score_tokens
from nanoserve.engine.scheduler import ScheduledChunk
from nanoserve.engine.spec_decode import ON_DEVICE
from nanoserve.model.batch import AttentionGroup, ForwardBatch
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.lora import Adapter, AdapterRows
from nanoserve.multimodal.inputs import ImageInput, rope_positions


@dataclass(slots=True)
class DeviceDrafts:
    """A draft model's proposals, still on the device: row i of `token_ids` ([requests, K]) holds
    the K drafts of `request_ids[i]` (a chunk takes the first `len(draft_ids)` of its row)."""

    token_ids: torch.Tensor
    request_ids: list[str]


@dataclass(slots=True)
class PromptRows:
    """The logits rows after the sampled ones that score prompt tokens (prompt_logprobs): row i
    is position `positions[i] - 1` of `request_ids[i]`, scoring prompt token `positions[i]`."""

    request_ids: list[str]
    positions: list[int]
    token_ids: list[int]
    num_top: int  # the most alternatives any of the step's requests asked for

    def add(self, request: Request, start: int, stop: int, vocab_size: int) -> list[int]:
        """Rows for the chunk's positions in [start, stop) whose next prompt token is in the
        vocabulary: their offsets in the chunk. A token outside it (an image's placeholder) has no
        logprob: its entry stays None, as the first token's does."""
        prompt_ids = request.prompt_ids
        scored = [p for p in range(start + 1, min(stop, len(prompt_ids) - 1) + 1)
                  if prompt_ids[p] < vocab_size]
        self.request_ids += [request.request_id] * len(scored)
        self.positions += scored
        self.token_ids += (prompt_ids[p] for p in scored)
        self.num_top = max(self.num_top, request.params.prompt_logprobs)
        return [p - 1 - start for p in scored]


@dataclass(frozen=True, slots=True)
class PoolingSlice:
    """An embedding chunk's rows in the forward's hidden states: [start, start + count)."""

    chunk: ScheduledChunk
    start: int
    count: int


@dataclass(slots=True)
class PreparedStep:
    batch: ForwardBatch
    sampling: SamplingBatch | None
    sampled_request_ids: list[str]
    prompt_rows: PromptRows | None = None
    draft_rows: tuple[torch.Tensor, list[str]] | None = None  # device-filled drafts' input rows
    pooling: list[PoolingSlice] = field(default_factory=list)


@dataclass(slots=True)
class Forwarded:
    """What a step's forward returns: float32 logits of the sampled rows, then of the scored
    prompt rows; and the final hidden states of the embedding chunks' rows (None: no such chunk)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, *, eos_token_ids: frozenset[int],
                 device: torch.device,
                 image_embeddings: Callable[[ImageInput], torch.Tensor] | None = None) -> None:
        """`image_embeddings`: an image's embedding rows (computed once, `engine.images`)."""
        self.model = model
        self.image_embeddings = image_embeddings
        self.kv_cache = kv_cache
        self.sampler = BatchedSampler()
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.block_size = kv_cache.block_size

    def prepare(self, chunks: list[ScheduledChunk], in_flight: TokenBatch | None = None,
                drafts: DeviceDrafts | None = None) -> PreparedStep:
        """The step's tensors; `in_flight` holds the tokens still pending on the host, `drafts`
        the drafts the host has not seen."""
        # Decodes first, then each LoRA adapter's rows side by side (stable): an adapter's
        # update then runs over a slice of rows, not a gather and a scatter.
        first_seen = dict.fromkeys(id(chunk.request.adapter) for chunk in chunks)
        adapter_order = {key: order for order, key in enumerate(first_seen)}
        ordered = sorted(chunks, key=lambda c: (not c.is_decode, adapter_order[id(c.request.adapter)]))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        prompt_rows, prompt_logits_rows = PromptRows([], [], [], 0), []
        hidden_rows: list[int] = []
        pooling: list[PoolingSlice] = []
        pending: list[tuple[int, str]] = []  # (input row, request id) filled from `in_flight`
        device_drafts: list[tuple[int, str, int]] = []  # (input row, request id, draft) from `drafts`
        splices: list[tuple[list[int], torch.Tensor]] = []  # (input rows, image rows that replace them)
        visible_ends: list[int] = []  # the last position each row sees (past its own inside an image)
        bidirectional = any(image.bidirectional for chunk in ordered for image in chunk.request.images)
        mrope = any(image.rope_grid for chunk in ordered for image in chunk.request.images)
        rope_axes: list[list[int]] = [[], [], []]  # M-RoPE's three positions of each row, if any has them
        for chunk in ordered:
            stop = chunk.start + chunk.num_tokens
            known_stop = stop - len(chunk.draft_ids)
            first_row = len(input_ids)
            known = chunk.request.token_ids(chunk.start, known_stop)
            if len(known) < known_stop - chunk.start:  # the newest token is pending
                pending.append((len(input_ids) + len(known), chunk.request.request_id))
                known.append(0)
            if chunk.draft_ids and chunk.draft_ids[0] == ON_DEVICE:
                first, request_id = len(input_ids) + len(known), chunk.request.request_id
                device_drafts += ((first + j, request_id, j) for j in range(len(chunk.draft_ids)))
            if chunk.request.images:
                splices += self._image_splices(chunk, first_row)
            input_ids += known + list(chunk.draft_ids)
            positions += range(chunk.start, stop)
            if mrope:
                for axis, values in zip(rope_axes, rope_positions(
                        [image for image in chunk.request.images if image.rope_grid], chunk.start, stop),
                        strict=True):
                    axis += values
            if bidirectional:
                visible_ends += self._visible_ends(chunk)
            slots += (self._slot(chunk.request.block_ids, p) for p in range(chunk.start, stop))
            if chunk.samples:  # the newest token's row, then one per draft
                logits_rows += range(len(input_ids) - 1 - len(chunk.draft_ids), len(input_ids))
            if chunk.request.scores_prompt:
                prompt_logits_rows += (first_row + offset for offset in prompt_rows.add(
                    chunk.request, chunk.start, stop, self.model.config.vocab_size))
            if chunk.request.pooling is not None:
                rows = self._pooled_rows(chunk, first_row, len(input_ids))
                pooling.append(PoolingSlice(chunk, len(hidden_rows), len(rows)))
                hidden_rows += rows
        input_tensor = self._with_drafts(self._filled(self._tensor(input_ids), pending, in_flight),
                                         device_drafts, drafts)
        batch = ForwardBatch(
            input_ids=input_tensor,
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            groups=self._groups(ordered),
            logits_rows=self._tensor(logits_rows + prompt_logits_rows),
            adapter_rows=self._adapter_rows(ordered),
            hidden_rows=self._tensor(hidden_rows) if pooling else None,
        )
        if splices:
            batch.image_rows = self._tensor([row for rows, _ in splices for row in rows])
            batch.image_embeds = torch.cat([embeds for _, embeds in splices])
        if mrope:
            batch.rope_positions = self._tensor(rope_axes)
        if bidirectional and visible_ends != positions:  # some row lies inside a bidirectional image
            batch.visible_ends = self._tensor(visible_ends)
        sampled = [chunk for chunk in ordered if chunk.samples]
        return PreparedStep(batch, self._sampling_batch(sampled),
                            [c.request.request_id for c in sampled for _ in range(1 + len(c.draft_ids))],
                            prompt_rows if prompt_logits_rows else None,
                            self._draft_rows(device_drafts), pooling)

    def forward(self, step: PreparedStep) -> Forwarded:
        """Float32 logits of each chunk that reaches its newest token, in the sampling rows' order,
        then of each prompt row scored for prompt_logprobs; and the embedding chunks' hidden rows."""
        if not step.pooling:
            return Forwarded(self.model.forward(step.batch, self.kv_cache))
        return Forwarded(*self.model.forward_hidden(step.batch, self.kv_cache))

    def _image_splices(self, chunk: ScheduledChunk, first_row: int) -> list[tuple[list[int], torch.Tensor]]:
        """For each image with rows among the chunk's positions (a chunk may start or stop inside
        an image): the batch rows they go to, and those embedding rows."""
        stop = chunk.start + chunk.num_tokens
        splices = []
        for image in chunk.request.images:
            first, last = image.rows_in(chunk.start, stop)
            if first < last:
                rows = [first_row + position - chunk.start for position in image.positions[first:last]]
                splices.append((rows, self.image_embeddings(image)[first:last]))
        return splices

    @staticmethod
    def _visible_ends(chunk: ScheduledChunk) -> list[int]:
        """The last position each of the chunk's rows sees: its own, or inside a bidirectional
        image that image's last (the scheduler never cuts one, so it is in the cache by then)."""
        ends = list(range(chunk.start, chunk.start + chunk.num_tokens))
        for image in chunk.request.images:
            if image.bidirectional:
                first, last = image.rows_in(chunk.start, chunk.start + chunk.num_tokens)
                for position in image.positions[first:last]:
                    ends[position - chunk.start] = image.last_position
        return ends

    @staticmethod
    def _pooled_rows(chunk: ScheduledChunk, first_row: int, stop_row: int) -> list[int]:
        """The rows of an embedding chunk whose hidden states its pooling reads."""
        if chunk.request.pooling.method == "mean":
            return list(range(first_row, stop_row))
        return [stop_row - 1] if chunk.pools else []

    def pool(self, hidden: torch.Tensor, slices: list[PoolingSlice]) -> PooledVectors | None:
        """Keep each mean-pooling chunk's hidden rows on its request; for each chunk that completes
        its prompt, the request's vector (float32, on the device). Each vector is reduced alone,
        over its whole prompt at once: its bits depend on neither its neighbours nor its chunks."""
        vectors, request_ids = [], []
        for piece in slices:
            request = piece.chunk.request
            rows = hidden[piece.start:piece.start + piece.count].float()
            if request.pooling.method == "mean":
                if piece.chunk.start == 0:  # its first chunk (again, after a preemption)
                    request.pooled_rows = []
                request.pooled_rows.append(rows)
            if not piece.chunk.pools:
                continue
            mean = request.pooling.method == "mean"
            vector = torch.cat(request.pooled_rows).mean(dim=0) if mean else rows[0]
            if request.pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            request.pooled_rows = []
            vectors.append(vector)
            request_ids.append(request.request_id)
        return PooledVectors(torch.stack(vectors), request_ids) if vectors else None

    def sample(self, forwarded: Forwarded, step: PreparedStep) -> TokenBatch | None:
        """The step's new tokens, its scored prompt tokens and its pooled vectors, still on the
        device; None when the step has none of them."""
        logits = forwarded.logits
        pooled = self.pool(forwarded.hidden, step.pooling) if step.pooling else None
        num_sampled = len(step.sampled_request_ids)
        sampled = self.sampler(logits[:num_sampled], step.sampling) if step.sampling is not None else None
        prompt = None
        if step.prompt_rows is not None:
            rows = step.prompt_rows
            scores = score_tokens(logits[num_sampled:], self._tensor(rows.token_ids), rows.num_top)
            prompt = PromptTokens(scores, rows.request_ids, rows.positions, rows.token_ids)
        if sampled is None and prompt is None and pooled is None:
            return None
        drafts = None
        if step.draft_rows is not None:
            rows, request_ids = step.draft_rows
            drafts = DraftTokens(step.batch.input_ids.index_select(0, rows), request_ids)
        return TokenBatch(sampled, step.sampled_request_ids, prompt, drafts, pooled)

    def _filled(self, input_ids: torch.Tensor, pending: list[tuple[int, str]],
                 in_flight: TokenBatch | None) -> torch.Tensor:
        """`input_ids` with each pending token copied in from the step in flight (on the device)."""
        if not pending:
            return input_ids
        if in_flight is None:
            raise ValueError("a chunk's newest token is pending, and no step is in flight")
        source_row = {request_id: row for row, request_id in enumerate(in_flight.request_ids)}
        rows = self._tensor([row for row, _ in pending])
        sources = self._tensor([source_row[request_id] for _, request_id in pending])
        return input_ids.index_copy(0, rows, in_flight.sampled.token_ids.index_select(0, sources))

    def _with_drafts(self, input_ids: torch.Tensor, rows: list[tuple[int, str, int]],
                     drafts: DeviceDrafts | None) -> torch.Tensor:
        """`input_ids` with each device-only draft copied in from the proposal (on the device)."""
        if not rows:
            return input_ids
        if drafts is None:
            raise ValueError("a chunk's drafts are on the device, and no proposal was given")
        width = drafts.token_ids.shape[1]
        proposal_row = {request_id: row for row, request_id in enumerate(drafts.request_ids)}
        sources = self._tensor([proposal_row[request_id] * width + j for _, request_id, j in rows])
        return input_ids.index_copy(0, self._tensor([row for row, _, _ in rows]),
                                    drafts.token_ids.reshape(-1).index_select(0, sources))

    def _draft_rows(self, rows: list[tuple[int, str, int]]) -> tuple[torch.Tensor, list[str]] | None:
        if not rows:
            return None
        return self._tensor([row for row, _, _ in rows]), [request_id for _, request_id, _ in rows]

    def _adapter_rows(self, ordered: list[ScheduledChunk]) -> list[AdapterRows]:
        """The row ranges of each LoRA adapter this step runs with (one among the decodes, one
        among the prefills, at most), in the batch's row order."""
        ranges: dict[int, tuple[Adapter, list[tuple[int, int]]]] = {}
        row = 0
        for chunk in ordered:
            adapter, stop = chunk.request.adapter, row + chunk.num_tokens
            if adapter is not None:
                spans = ranges.setdefault(id(adapter), (adapter, []))[1]
                if spans and spans[-1][1] == row:
                    spans[-1] = (spans[-1][0], stop)
                else:
                    spans.append((row, stop))
            row = stop
        return [AdapterRows(adapter, tuple(spans)) for adapter, spans in ranges.values()]

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _groups(self, ordered: list[ScheduledChunk]) -> list[AttentionGroup]:
        decodes = [chunk for chunk in ordered if chunk.is_decode]
        groups = [self._decode_group(decodes)] if decodes else []
        row = sum(chunk.num_tokens for chunk in decodes)
        for chunk in ordered[len(decodes):]:
            groups.append(self._group([chunk], row_start=row, rows_per_seq=chunk.num_tokens))
            row += chunk.num_tokens
        return groups

    def _decode_group(self, decodes: list[ScheduledChunk]) -> AttentionGroup:
        """Every decode row, a draft's too, as a one-row sequence of its own (a drafting chunk's
        rows share its block table): one attention call for all of them, and each draft row is
        computed exactly as the decode step that would reach its position. Every row's K/V is
        written before any row attends, so a draft row sees the drafts before it."""
        rows = [(c.request.block_ids, p) for c in decodes for p in range(c.start, c.start + c.num_tokens)]
        num_blocks = max(-(-(position + 1) // self.block_size) for _, position in rows)
        # Short block tables are padded with block 0: the mask hides those slots.
        tables = [(block_ids[:num_blocks] + [0] * num_blocks)[:num_blocks] for block_ids, _ in rows]
        return AttentionGroup(0, len(rows), 1, self._tensor([[position] for _, position in rows]),
                              self._tensor(tables), first_positions=tuple(position for _, position in rows))

    def _group(self, chunks: list[ScheduledChunk], *, row_start: int, rows_per_seq: int) -> AttentionGroup:
        num_blocks = max(-(-(c.start + c.num_tokens) // self.block_size) for c in chunks)
        # Short block tables are padded with block 0: the mask hides those slots.
        tables = [(c.request.block_ids[:num_blocks] + [0] * num_blocks)[:num_blocks] for c in chunks]
        positions = [list(range(c.start, c.start + c.num_tokens)) for c in chunks]
        # A row inside a bidirectional image sees past its position: no chunk of context may be
        # skipped by position alone.
        sees_ahead = any(image.bidirectional and image.key_material(c.start, c.start + c.num_tokens)
                         for c in chunks for image in c.request.images)
        return AttentionGroup(row_start, len(chunks), rows_per_seq, self._tensor(positions),
                              self._tensor(tables),
                              first_positions=None if sees_ahead else tuple(c.start for c in chunks))

    def _sampling_batch(self, sampled: list[ScheduledChunk]) -> SamplingBatch | None:
        if not sampled:
            return None
        rows = [row for chunk in sampled for row in self._sampling_rows(chunk)]
        return SamplingBatch.build(rows, vocab_size=self.model.config.vocab_size,
                                   eos_token_ids=self.eos_token_ids, device=self.device)

    def _sampling_rows(self, chunk: ScheduledChunk) -> list[SamplingRow]:
        """The newest token's row, then one per draft: row i samples the token that would
        follow the output plus drafts[:i], with that position's key and penalty state, so it
        draws what decoding without speculation would draw once those drafts are accepted."""
        request = chunk.request
        output = request.output_ids
        edits = self._row_edits(request)
        # A pending token counts for the position (its value matters only to rows that need it
        # on the host, and those steps are never deferred).
        position = len(output) + request.num_pending_tokens
        rows = [SamplingRow(request.params, request.seed, position, request.prompt_ids, output, edits,
                            request.grammar)]
        if chunk.draft_ids and request.params.carries_draw_state:
            raise ValueError(f"{request.request_id} carries mirostat's mu from draw to draw: its rows "
                             "cannot be drafted ahead (the proposers never offer it drafts)")
        if chunk.draft_ids and chunk.draft_ids[0] == ON_DEVICE and request.params.reads_output_values:
            raise ValueError(f"{request.request_id}'s rows read its output's values (a penalty or a "
                             "bad word), and its drafts are on the device only")
        for i in range(1, len(chunk.draft_ids) + 1):
            ahead = output + list(chunk.draft_ids[:i])
            edits = edits.fork(ahead)
            rows.append(SamplingRow(request.params, request.seed, len(ahead), request.prompt_ids,
                                    ahead, edits))
        return rows

    def _row_edits(self, request: Request) -> RowEdits:
        """The request's penalty and bias cells, built at its first sampled step and kept on it."""
        if request.sampler_edits is None:
            request.sampler_edits = RowEdits(request.params, request.prompt_ids,
                                             self.model.config.vocab_size, self.device)
        return request.sampler_edits

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
