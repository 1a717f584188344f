"""What one forward is given: a flat batch of rows from many sequences, grouped for attention,
and the per-step context every layer reads (built once a step by the decoder)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanoserve.model.kv_cache import KVCache
from nanoserve.model.lora import AdapterRows
from nanoserve.native.lora import NativeLoRAStep
from nanoserve.native.ops import PagedContext


@dataclass(slots=True)
class AttentionGroup:
    """Rows that attend together: `num_seqs` sequences with `rows_per_seq` query rows each."""

    row_start: int  # first row of this group in the flat batch
    num_seqs: int
    rows_per_seq: int
    positions: torch.Tensor  # [num_seqs, rows_per_seq] absolute position of each query row
    block_tables: torch.Tensor  # [num_seqs, num_blocks] cache blocks of each sequence
    # The first row's position of each sequence, on the host, when the caller knows it: lets
    # attention skip context chunks a prefill row cannot see yet, without a readback.
    first_positions: tuple[int, ...] | None = None


@dataclass(slots=True)
class PositionPlan:
    """The batch-invariant attention's view of a step: every row is a query position that
    attends over its own sequence's whole context, whatever group it came in."""

    block_tables: torch.Tensor  # [seqs, blocks]: every sequence of the step, padded alike
    num_decode_rows: int  # rows 0..D-1 are single-row sequences 0..D-1 (decodes come first)
    # (first row, rows, sequence, first row's position or None) of each multi-row chunk
    prefills: list[tuple[int, int, int, int | None]]
    visible: torch.Tensor  # [1, rows, 1, ctx] bool: the slots up to each row's visible end


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows] flat cache slot of each row's K/V
    groups: list[AttentionGroup]
    logits_rows: torch.Tensor  # [n] rows whose next-token logits are wanted
    # LoRA: the rows of each adapter the step runs with (rows of none: the base model alone)
    adapter_rows: list[AdapterRows] = field(default_factory=list)
    # [m] rows whose final hidden states are wanted (embedding requests' pooling); None: none
    hidden_rows: torch.Tensor | None = None
    # Images: the rows whose token embedding is replaced, and what replaces it ([k, hidden], each
    # row an image's embedding row); None: no image row this step.
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # [rows] the last position each row attends to: past its own inside a bidirectional image
    # (Gemma 3), whose rows see the whole image; None: every row sees up to its own position.
    visible_ends: torch.Tensor | None = None
    # [3, rows] M-RoPE's (temporal, height, width) position of each row, where they differ from
    # `positions` (a Qwen2-VL request with an image): the rotary phases alone; the cache slots,
    # masks and windows keep `positions`. None: every row rotates by its position.
    rope_positions: torch.Tensor | None = None


@dataclass(slots=True)
class StepContext:
    """What every layer of one step needs, built once per step: for the torch ops the RoPE
    rows and the attention plan; for the native ops where each row's context lives."""

    batch: ForwardBatch
    paged: PagedContext | None = None
    # Native only: outputs every layer writes again, allocated once per step. Each is read by
    # the matrix multiply right after it, before the next layer overwrites it.
    normed: torch.Tensor | None = None  # [rows, hidden]
    attended: torch.Tensor | None = None  # [rows, heads * head_dim]
    activated: torch.Tensor | None = None  # [rows, intermediate]
    lora: NativeLoRAStep | None = None  # the LoRA rows' adapters for the C code (nanoserve.native.lora)
    # Torch attention only: the attention plan of the full layers and of the sliding layers,
    # and each RoPE table's (cos, signed sin) rows [rows, 1, head_dim].
    plan: PositionPlan | list[torch.Tensor] | None = None
    window_plan: PositionPlan | list[torch.Tensor] | None = None
    ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # M-RoPE steps (`ForwardBatch.rope_positions`): each RoPE table's (cos, signed sin) rows
    # [rows, head_dim], gathered once; the native ops read row i at `row_index[i]` = i.
    mrope: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    row_index: torch.Tensor | None = None


def paged_context(batch: ForwardBatch, kv_cache: KVCache) -> PagedContext:
    """Each row's sequence and block table for the native attention, bounds checked once here
    (the kernels take raw pointers: an out-of-range slot would be a segfault, not an error)."""
    groups = batch.groups
    width = max(group.block_tables.shape[1] for group in groups)
    tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
    row_seq, seq = [], 0
    for group in groups:
        row_seq += [s for s in range(seq, seq + group.num_seqs) for _ in range(group.rows_per_seq)]
        seq += group.num_seqs
    rows = batch.positions.shape[0]
    if len(row_seq) != rows:
        raise ValueError(f"attention groups cover {len(row_seq)} rows; the batch has {rows}")
    cache_slots = kv_cache.num_blocks * kv_cache.block_size
    checked = [("block_tables", tables, kv_cache.num_blocks),
               ("positions", batch.positions, width * kv_cache.block_size),
               ("slot_mapping", batch.slot_mapping, cache_slots)]
    if batch.visible_ends is not None:
        checked.append(("visible_ends", batch.visible_ends, width * kv_cache.block_size))
        torch._assert_async((batch.visible_ends >= batch.positions).all(),
                            "visible_ends must be >= positions")
    for name, values, bound in checked:
        if values.numel():
            # Checked inside torch, not read back into Python: a step reads back once, in the
            # output processor (tests/test_engine.py makes any other host read fail).
            torch._assert_async(((values >= 0) & (values < bound)).all(), f"{name} must lie in [0, {bound})")
    return PagedContext(tables.contiguous(), torch.tensor(row_seq, dtype=torch.long), batch.positions,
                        batch.visible_ends)
