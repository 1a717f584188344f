"""From a scheduler's plan to the model's flat batch, then logits, then sampled tokens.

Owns the layout of a step: rows of single-token chunks (decodes) first, as one attention
group, then each multi-token (prefill) chunk as a group of its own; the flat cache slot of
every row; which rows need logits; and the sampling rows in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kv_cache import KVCache
from nanoserve.model import AttentionGroup, ForwardBatch, Llama
from nanoserve.output import TokenBatch
from nanoserve.request import Request
from nanoserve.sampler import BatchedSampler, RowEdits, SamplingBatch, SamplingRow
from nanoserve.scheduler import ScheduledChunk


@dataclass(slots=True)
class PreparedStep:
    batch: ForwardBatch
    sampling: SamplingBatch | None
    sampled_request_ids: list[str]


class ModelRunner:
    def __init__(self, model: Llama, kv_cache: KVCache, *, eos_token_ids: frozenset[int],
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = BatchedSampler()
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.block_size = kv_cache.block_size

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedStep:
        ordered = sorted(chunks, key=lambda chunk: chunk.num_tokens > 1)  # decodes first, stable
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for chunk in ordered:
            stop = chunk.start + chunk.num_tokens
            input_ids += chunk.request.token_ids(chunk.start, stop)
            positions += range(chunk.start, stop)
            slots += (self._slot(chunk.request.block_ids, p) for p in range(chunk.start, stop))
            if chunk.samples:
                logits_rows.append(len(input_ids) - 1)
        batch = ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            groups=self._groups(ordered),
            logits_rows=self._tensor(logits_rows),
        )
        sampled = [chunk for chunk in ordered if chunk.samples]
        return PreparedStep(batch, self._sampling_batch(sampled),
                            [chunk.request.request_id for chunk in sampled])

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Float32 logits of each chunk that reaches its newest token, in the sampling rows' order."""
        return self.model.forward(step.batch, self.kv_cache)

    def sample(self, logits: torch.Tensor, step: PreparedStep) -> TokenBatch | None:
        """The step's new tokens, still on the device; None when no chunk reached its end."""
        if step.sampling is None:
            return None
        return TokenBatch(self.sampler(logits, step.sampling), step.sampled_request_ids)

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _groups(self, ordered: list[ScheduledChunk]) -> list[AttentionGroup]:
        decodes = [chunk for chunk in ordered if chunk.num_tokens == 1]
        groups = [self._group(decodes, row_start=0, rows_per_seq=1)] if decodes else []
        row = len(decodes)
        for chunk in ordered[len(decodes):]:
            groups.append(self._group([chunk], row_start=row, rows_per_seq=chunk.num_tokens))
            row += chunk.num_tokens
        return groups

    def _group(self, chunks: list[ScheduledChunk], *, row_start: int, rows_per_seq: int) -> AttentionGroup:
        num_blocks = max(-(-(c.start + c.num_tokens) // self.block_size) for c in chunks)
        # Short block tables are padded with block 0: the mask hides those slots.
        tables = [(c.request.block_ids[:num_blocks] + [0] * num_blocks)[:num_blocks] for c in chunks]
        positions = [list(range(c.start, c.start + c.num_tokens)) for c in chunks]
        return AttentionGroup(row_start, len(chunks), rows_per_seq, self._tensor(positions),
                              self._tensor(tables), first_positions=tuple(c.start for c in chunks))

    def _sampling_batch(self, sampled: list[ScheduledChunk]) -> SamplingBatch | None:
        if not sampled:
            return None
        rows = [
            SamplingRow(params=c.request.params, seed=c.request.seed,
                        position=len(c.request.output_ids), prompt_ids=c.request.prompt_ids,
                        output_ids=c.request.output_ids, edits=self._row_edits(c.request),
                        grammar=c.request.grammar)
            for c in sampled
        ]
        return SamplingBatch.build(rows, vocab_size=self.model.config.vocab_size,
                                   eos_token_ids=self.eos_token_ids, device=self.device)

    def _row_edits(self, request: Request) -> RowEdits:
        """The request's penalty and bias cells, built at its first sampled step and kept on it."""
        if request.sampler_edits is None:
            request.sampler_edits = RowEdits(request.params, request.prompt_ids,
                                             self.model.config.vocab_size, self.device)
        return request.sampler_edits

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
