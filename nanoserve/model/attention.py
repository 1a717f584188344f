"""Attention in torch over the paged KV cache, in two forms (the native kernel is the third,
`nanoserve.native.ops.paged_attention`):

- plain: torch's scaled_dot_product_attention per attention group, fastest; a row's low bits
  may depend on the context length its batch was padded to.
- batch-invariant: fixed-shape tiles reduced in a fixed order (`position_attention`), so a
  row's result is bit-identical alone, in any batch and at any position, and the same whether
  it was computed in a prefill chunk or a decode step (so preemption by recompute cannot
  change a token).

`TorchAttention` is what a decoder layer calls: it plans a step once (masks, or the positions'
plan) and runs a layer's attention from its fused qkv rows. A row sees the context up to its
position, or, inside a bidirectional image (Gemma 3), up to the image's last position
(`ForwardBatch.visible_ends`); a sliding window still counts back from its position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.config import ModelConfig
from nanoserve.model.batch import AttentionGroup, ForwardBatch, PositionPlan, StepContext
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.rope import apply_rope

# Context chunk of the batch-invariant attention: scores and P@V run on fixed [*, CONTEXT_CHUNK]
# pieces and the pieces are summed in order, so zero-padded context never moves a bit.
CONTEXT_CHUNK = 64


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [kv_heads, s, rows, d], k/v [kv_heads, s, ctx, d], mask [1, s, rows, ctx] bool.
    `softcap` > 0 (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask, which
    SDPA cannot do, so those run as explicit products."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = soft_cap((q.float() * scale) @ k.float().transpose(-1, -2), softcap)
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
    return (probs @ v.float()).to(q.dtype)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place."""
    return scores.div_(cap).tanh_().mul_(cap)


def position_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                       scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Attention of one query position per item, computed the same way whatever else runs.

    q [kv_heads, n, heads_per_kv, d]: per K/V head, the query heads of one position each;
    k/v [kv_heads, n, ctx, d] with ctx a CONTEXT_CHUNK multiple (`_position_plan` pads the
    block tables to one); visible [1, n, 1, ctx] bool. Every matrix multiply has one shape,
    [heads_per_kv, d] x [d, CONTEXT_CHUNK] for the scores and its mirror for P@V, whatever n,
    ctx or the neighbours; the softmax runs along whole rows of CONTEXT_CHUNK multiples; the
    per-chunk P@V partials are summed in chunk order by a cumulative sum. Padded context adds
    exact zeros. So a position's bits are the same alone, in any crowd, at any padding, and in
    a prefill chunk or a decode step (tests/test_model.py pins all four).
    """
    if q.dtype != torch.float32:  # half precision: scores, softmax and sums in float32, as SDPA does
        return position_attention(q.float(), k.float(), v.float(), visible, scale, softcap).to(q.dtype)
    kv_heads, n, per_kv, dim = q.shape
    ctx = k.shape[2]
    chunks = ctx // CONTEXT_CHUNK
    # Contiguous, so the multiplies below see K transposed in place, never a transposed copy:
    # BLAS takes another code path (and other low bits) for the two layouts.
    k = k.contiguous().view(kv_heads, n, chunks, CONTEXT_CHUNK, dim)
    v = v.contiguous().view(kv_heads, n, chunks, CONTEXT_CHUNK, dim)
    scores = (q * scale).unsqueeze(2) @ k.transpose(-1, -2)  # [kv_heads, n, chunks, per_kv, CHUNK]
    scores = scores.transpose(2, 3).reshape(kv_heads, n, per_kv, ctx)
    if softcap:
        soft_cap(scores, softcap)
    probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
    probs = probs.view(kv_heads, n, per_kv, chunks, CONTEXT_CHUNK).transpose(2, 3)
    partials = probs @ v  # [kv_heads, n, chunks, per_kv, d]
    return partials.cumsum(dim=2)[:, :, -1]


def sequence_position_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                                scale: float, first_position: int | None = None,
                                softcap: float = 0.0) -> torch.Tensor:
    """`position_attention` for many positions of ONE sequence, without copying its context.

    q [kv_heads, n, heads_per_kv, d]; k/v [kv_heads, ctx, d] (ctx a CONTEXT_CHUNK multiple);
    visible [1, n, 1, ctx]. The same [heads_per_kv, d] x [d, CONTEXT_CHUNK] products, one
    batched multiply per (K/V head, chunk) over the n positions, the chunk's K/V broadcast to
    them with a zero stride, so each position's bits equal its decode-step bits.

    With `first_position` known, rows that cannot see a chunk yet (a causal prefill's early
    rows against its later chunks) skip it: their scores there are masked to -inf anyway and
    their P@V partial is an exact zero, so skipping changes no bit and halves the work.
    """
    if q.dtype != torch.float32:
        return sequence_position_attention(q.float(), k.float(), v.float(), visible, scale,
                                           first_position, softcap).to(q.dtype)
    kv_heads, n, per_kv, dim = q.shape
    chunks = k.shape[1] // CONTEXT_CHUNK
    k = k.view(kv_heads, chunks, CONTEXT_CHUNK, dim)
    v = v.view(kv_heads, chunks, CONTEXT_CHUNK, dim)
    q = q * scale
    # Rows [blind[c]:] see some of chunk c; earlier rows see none of it.
    blind = [0 if first_position is None else min(n, max(0, c * CONTEXT_CHUNK - first_position))
             for c in range(chunks)]
    scores = torch.empty(kv_heads, chunks, n, per_kv, CONTEXT_CHUNK, dtype=q.dtype, device=q.device)
    for head in range(kv_heads):
        for chunk in range(chunks):
            rows = n - blind[chunk]
            if rows:
                key_t = k[head, chunk].transpose(0, 1).expand(rows, dim, CONTEXT_CHUNK)
                torch.bmm(q[head, blind[chunk]:], key_t, out=scores[head, chunk, blind[chunk]:])
    scores = scores.permute(0, 2, 3, 1, 4).reshape(kv_heads, n, per_kv, chunks * CONTEXT_CHUNK)
    if softcap:
        soft_cap(scores, softcap)
    probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
    probs = probs.view(kv_heads, n, per_kv, chunks, CONTEXT_CHUNK)
    partials = torch.zeros(kv_heads, chunks, n, per_kv, dim, dtype=q.dtype, device=q.device)
    for head in range(kv_heads):
        for chunk in range(chunks):
            rows = n - blind[chunk]
            if rows:
                values = v[head, chunk].expand(rows, CONTEXT_CHUNK, dim)
                torch.bmm(probs[head, blind[chunk]:, :, chunk].contiguous(), values,
                          out=partials[head, chunk, blind[chunk]:])
    return partials.cumsum(dim=1)[:, -1]



def _visible_ends(batch: ForwardBatch) -> torch.Tensor:
    """[rows] the last position each row sees: its own, or its bidirectional image's last."""
    return batch.positions if batch.visible_ends is None else batch.visible_ends


@dataclass(slots=True)
class TorchAttention:
    """A model's attention in torch: the step's plans, and each layer's attention from qkv."""

    config: ModelConfig
    scale: float
    batch_invariant: bool

    @property
    def q_size(self) -> int:
        return self.config.num_heads * self.config.head_dim

    @property
    def kv_size(self) -> int:
        return self.config.num_kv_heads * self.config.head_dim

    def plan_step(self, step: StepContext, kv_cache: KVCache,
                  rope_tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every RoPE table's rows for the step, the full layers' plan and the sliding layers'."""
        batch, block_size, window = step.batch, kv_cache.block_size, self.config.sliding_window
        if step.mrope is not None:
            step.ropes = [(cos.unsqueeze(1), sin.unsqueeze(1)) for cos, sin in step.mrope]
        else:
            step.ropes = [(cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1))
                          for cos, sin in rope_tables]
        step.plan = self._plan(batch, block_size, 0)
        step.window_plan = self._plan(batch, block_size, window) if window else None

    def _plan(self, batch: ForwardBatch, block_size: int, window: int) -> PositionPlan | list[torch.Tensor]:
        if self.batch_invariant:
            return self._position_plan(batch, block_size, window)
        ends = _visible_ends(batch)
        return [self._group_mask(group, ends, block_size, window) for group in batch.groups]

    def __call__(self, index: int, qkv: torch.Tensor, step: StepContext, kv_cache: KVCache, *,
                 rope: int = 0, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Layer `index`'s attention: q and k rotated by RoPE table `rope`, K/V written into the
        cache, the layer's plan (`window` > 0: the sliding layers'); `softcap` > 0: scores
        soft-capped before the mask."""
        cfg, batch = self.config, step.batch
        cos, sin = step.ropes[rope]
        plan = step.window_plan if window else step.plan
        # q and k rotate together: one pass over [rows, heads + kv_heads, head_dim].
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads,
                                                                  cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        kv_cache.write(index, batch.slot_mapping, k, v)
        if isinstance(plan, PositionPlan):
            out = self._attend_by_position(index, q, plan, kv_cache, softcap)
        elif len(batch.groups) == 1:  # the common decode step: no need to stitch groups together
            out = self._attend_group(index, batch.groups[0], q, plan[0], kv_cache, softcap)
        else:
            out = torch.empty_like(q)
            for group, mask in zip(batch.groups, plan, strict=True):
                rows = slice(group.row_start, group.row_start + group.num_seqs * group.rows_per_seq)
                out[rows] = self._attend_group(index, group, q[rows], mask, kv_cache, softcap)
        return out.reshape(-1, self.q_size)

    def _attend_group(self, index: int, group: AttentionGroup, q: torch.Tensor, mask: torch.Tensor,
                      kv_cache: KVCache, softcap: float = 0.0) -> torch.Tensor:
        """Plain attention (SDPA) of one group: q [seqs*rows, heads, d] -> same shape."""
        cfg = self.config
        seqs, rows = group.num_seqs, group.rows_per_seq
        per_kv = cfg.num_heads // cfg.num_kv_heads
        k, v = kv_cache.gather(index, group.block_tables)  # [kv_heads, seqs, ctx, d]
        # SDPA's two batch dimensions taken as (kv_heads, seqs), the cache's own order.
        q = q.view(seqs, rows, cfg.num_kv_heads, per_kv, cfg.head_dim)
        q = q.permute(2, 0, 3, 1, 4).reshape(cfg.num_kv_heads, seqs, per_kv * rows, cfg.head_dim)
        out = plain_attention(q, k, v, mask, self.scale, softcap)
        out = out.view(cfg.num_kv_heads, seqs, per_kv, rows, cfg.head_dim).permute(1, 3, 0, 2, 4)
        return out.reshape(seqs * rows, cfg.num_heads, cfg.head_dim)

    def _attend_by_position(self, index: int, q: torch.Tensor, plan: PositionPlan,
                            kv_cache: KVCache, softcap: float = 0.0) -> torch.Tensor:
        """Every row attends as a decode row would: q [rows, heads, d] -> same shape.

        Decode rows run together over their sequences' gathered context; the rows of a prefill
        chunk run over their one sequence's context, broadcast to them without a copy.
        """
        cfg = self.config
        rows, per_kv = q.shape[0], cfg.num_heads // cfg.num_kv_heads
        k, v = kv_cache.gather(index, plan.block_tables)  # [kv_heads, seqs, ctx, d]
        q = q.view(rows, cfg.num_kv_heads, per_kv, cfg.head_dim).transpose(0, 1)
        decodes = plan.num_decode_rows
        if not plan.prefills:
            out = position_attention(q, k, v, plan.visible, self.scale, softcap)
        else:
            out = torch.empty_like(q)
            if decodes:
                out[:, :decodes] = position_attention(q[:, :decodes], k[:, :decodes], v[:, :decodes],
                                                      plan.visible[:, :decodes], self.scale, softcap)
            for start, count, seq, first_position in plan.prefills:
                chunk = slice(start, start + count)
                out[:, chunk] = sequence_position_attention(q[:, chunk], k[:, seq], v[:, seq],
                                                            plan.visible[:, chunk], self.scale,
                                                            first_position, softcap)
        return out.transpose(0, 1).reshape(rows, cfg.num_heads, cfg.head_dim)

    def _position_plan(self, batch: ForwardBatch, block_size: int, window: int = 0) -> PositionPlan:
        groups = batch.groups
        # Whole CONTEXT_CHUNKs of context, whatever the block size: the padded slots are hidden.
        width = max(group.block_tables.shape[1] for group in groups)
        width += -width % (math.lcm(CONTEXT_CHUNK, block_size) // block_size)
        tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
        decodes, prefills, seq = 0, [], 0
        for group in groups:
            if group.rows_per_seq == 1:
                decodes += group.num_seqs
            else:
                firsts = group.first_positions or (None,) * group.num_seqs
                prefills += [(group.row_start + i * group.rows_per_seq, group.rows_per_seq, seq + i,
                              firsts[i]) for i in range(group.num_seqs)]
            seq += group.num_seqs
        ctx = width * block_size
        # Groups hold their rows in batch order, so batch.positions is each row's position.
        slots = torch.arange(ctx, device=tables.device).view(1, ctx)
        visible = slots <= _visible_ends(batch).view(-1, 1)
        if window:  # a sliding layer: only the last `window` positions
            visible &= slots > batch.positions.view(-1, 1) - window
        return PositionPlan(tables, decodes, prefills, visible.view(1, -1, 1, ctx))

    def _group_mask(self, group: AttentionGroup, ends: torch.Tensor, block_size: int,
                    window: int = 0) -> torch.Tensor:
        """[1, seqs, per_kv * rows, ctx] bool: a query row sees the context up to its end (its
        position, or its bidirectional image's last; with a `window`, from its position's last
        `window` positions only)."""
        ctx = group.block_tables.shape[1] * block_size
        slots = torch.arange(ctx, device=group.positions.device)
        rows = slice(group.row_start, group.row_start + group.num_seqs * group.rows_per_seq)
        visible = slots.view(1, 1, ctx) <= ends[rows].view(group.num_seqs, group.rows_per_seq, 1)
        if window:
            visible &= slots.view(1, 1, ctx) > group.positions.unsqueeze(-1) - window
        per_kv = self.config.num_heads // self.config.num_kv_heads
        return visible.unsqueeze(1).expand(-1, per_kv, -1, -1).reshape(1, group.num_seqs, -1, ctx)
