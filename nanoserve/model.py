"""The decoder forward pass over a flat batch of tokens from many sequences, every family.

Owns: token embedding, RMSNorm, rotary embeddings (default, linear, dynamic, llama3, yarn,
longrope), grouped-query attention over the paged KV cache (full or a sliding window), the
gated MLP, and a tied or untied output head; and each family's switches (`ModelConfig`): q/k/v
and MLP biases, q/k head norms, Gemma's (1 + w) norms around both sublayers and scaled
embedding, attention and logit soft-capping, per-layer-type RoPE, the gate's activation.
Knows nothing of requests, sampling or HTTP: a `ForwardBatch` says which rows are which.

One module with named switches rather than one per family: the families differ by a dozen
small ops around the same attention and MLP, and the batch-invariant attention, the native
path and the cache layout are the hard part, shared by all. With every switch off (Llama) the
forward runs `_llama_layers`, the loop it always ran; any switch on runs `_switched_layers`,
which reads each switch once per layer.

Rows are grouped for attention: all single-token (decode) rows form one group, each prefill
chunk is a group of its own. Every group reads its context through block tables.

The matrix multiplies run through a `LinearKernel` chosen by `nanoserve.linear` (measured on
this machine, its weights packed once here). Attention has two forms:
- plain: torch's scaled_dot_product_attention, fastest; a row's low bits may depend on the
  context length its batch was padded to.
- batch-invariant: fixed-shape tiles reduced in a fixed order, so a row's result is
  bit-identical alone, in any batch and at any position, and the same whether it was computed
  in a prefill chunk or a decode step (so preemption by recompute cannot change a token).
A forward is batch-invariant when both its attention and its linear kernel are.

Everything outside the matrix multiplies runs one of two ways, chosen once per model:
- native (float32 on the CPU, the library built; `nanoserve.native.ops`): RMSNorm fused with
  the residual add, RoPE fused with the K/V write into the paged cache, attention reading the
  paged cache in place, SiLU*up. Its attention is batch-invariant by construction in both
  modes (each row alone over exactly the slots it sees, in CONTEXT_CHUNK order), and every row,
  prefill or decode, goes through it, so the two agree bit for bit.
- torch (half precision, CUDA, NANOSERVE_NO_NATIVE=1, or `native=False`): the two attention
  forms above, over K/V gathered from the cache.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from nanoserve import quant
from nanoserve.config import ModelConfig, Rope
from nanoserve.kv_cache import KVCache
from nanoserve.linear import KERNELS, LinearKernel, ProbeShape
from nanoserve.native import ops as native_ops
from nanoserve.native.ops import NativeOps, PagedContext
from nanoserve.quant import QuantizedWeight, Weight

# Context chunk of the batch-invariant attention: scores and P@V run on fixed [*, CONTEXT_CHUNK]
# pieces and the pieces are summed in order, so zero-padded context never moves a bit.
CONTEXT_CHUNK = 64


class TensorParallel(Protocol):
    """What a forward on one rank's shard asks of its ranks (nanoserve.parallel.Collectives)."""

    def row_parallel(self, x: torch.Tensor, weight: Weight,
                     linear: Callable[[torch.Tensor, Weight], torch.Tensor]) -> torch.Tensor: ...

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor: ...


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
    visible: torch.Tensor  # [1, rows, 1, ctx] bool: the slots up to each row's position


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows] flat cache slot of each row's K/V
    groups: list[AttentionGroup]
    logits_rows: torch.Tensor  # [n] rows whose next-token logits are wanted


@dataclass(slots=True)
class StepContext:
    """What every layer of one step needs, built once per step: for the torch ops the RoPE
    rows and the attention plan; for the native ops where each row's context lives."""

    batch: ForwardBatch
    cos: torch.Tensor | None = None  # [rows, 1, head_dim]
    sin: torch.Tensor | None = None
    plan: PositionPlan | list[torch.Tensor] | None = None
    paged: PagedContext | None = None
    # Native only: outputs every layer writes again, allocated once per step. Each is read by
    # the matrix multiply right after it, before the next layer overwrites it.
    normed: torch.Tensor | None = None  # [rows, hidden]
    attended: torch.Tensor | None = None  # [rows, heads * head_dim]
    activated: torch.Tensor | None = None  # [rows, intermediate]
    # Switched models, torch attention: the plan of the sliding layers, and each RoPE table's rows.
    window_plan: PositionPlan | list[torch.Tensor] | None = None
    ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None


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
    for name, values, bound in (("block_tables", tables, kv_cache.num_blocks),
                                ("positions", batch.positions, width * kv_cache.block_size),
                                ("slot_mapping", batch.slot_mapping, cache_slots)):
        if values.numel():
            # Checked inside torch, not read back into Python: a step reads back once, in the
            # output processor (tests/test_engine.py makes any other host read fail).
            torch._assert_async(((values >= 0) & (values < bound)).all(), f"{name} must lie in [0, {bound})")
    return PagedContext(tables.contiguous(), torch.tensor(row_seq, dtype=torch.long), batch.positions)


@dataclass(slots=True)
class LayerWeights:
    """A layer's matrices: dense tensors, or GGUF blocks (nanoserve.quant) for quantized runs."""

    input_norm: torch.Tensor
    qkv: Weight  # q, k and v projections stacked: one GEMM instead of three
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # gate and up stacked
    down: Weight
    # The switches' tensors (None where the family has none): biases of the stacked matrices,
    # q/k head norms, and Gemma's norms of the attention and MLP outputs.
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def matrices(self) -> list[Weight]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def with_matrices(self, convert: Callable[[Weight], Weight],
                      vector: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> LayerWeights:
        """The same layer with every matrix through `convert` and every vector through `vector`."""
        vectors = {f: None if getattr(self, f) is None else vector(getattr(self, f)) for f in _LAYER_VECTORS}
        return LayerWeights(qkv=convert(self.qkv), o=convert(self.o), gate_up=convert(self.gate_up),
                            down=convert(self.down), **vectors)


_LAYER_VECTORS = ("input_norm", "post_norm", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm",
                  "k_norm", "attn_out_norm", "mlp_out_norm")


@dataclass(slots=True)
class LlamaWeights:
    embed: Weight
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Weight  # the embedding itself when tied

    @classmethod
    def from_hf_state_dict(cls, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> LlamaWeights:
        """The weights under their Hugging Face names (`hf_tensor_shapes` lists them). Gemma's
        norms scale by (1 + w): the 1 is added here, in float32, once."""
        def norm(name: str) -> torch.Tensor:
            return tensors[name].float() + 1.0 if config.gemma_norms else tensors[name]

        def optional(name: str, present: bool, read: Callable[[str], torch.Tensor] = tensors.__getitem__):
            return read(name) if present else None

        def stacked(names: list[str]) -> torch.Tensor:
            return torch.cat([tensors[n] for n in names])

        def layer(i: int) -> LayerWeights:
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            fused = config.family == "phi3"
            gemma = config.gemma_norms
            qkv_names = [attn + f"{x}_proj" for x in "qkv"]
            gate_up_names = [mlp + "gate_proj", mlp + "up_proj"]
            return LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=tensors[attn + "qkv_proj.weight"] if fused else quant.stack_rows(
                    [tensors[n + ".weight"] for n in qkv_names]),
                o=tensors[attn + "o_proj.weight"],
                post_norm=norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                               + ".weight"),
                gate_up=tensors[mlp + "gate_up_proj.weight"] if fused else quant.stack_rows(
                    [tensors[n + ".weight"] for n in gate_up_names]),
                down=tensors[mlp + "down_proj.weight"],
                qkv_bias=stacked([n + ".bias" for n in qkv_names]) if config.qkv_bias else None,
                o_bias=optional(attn + "o_proj.bias", config.o_bias),
                gate_up_bias=stacked([n + ".bias" for n in gate_up_names]) if config.mlp_bias else None,
                down_bias=optional(mlp + "down_proj.bias", config.mlp_bias),
                q_norm=optional(attn + "q_norm.weight", config.qk_norm, norm),
                k_norm=optional(attn + "k_norm.weight", config.qk_norm, norm),
                attn_out_norm=optional(p + "post_attention_layernorm.weight", gemma, norm),
                mlp_out_norm=optional(p + "post_feedforward_layernorm.weight", gemma, norm),
            )

        embed = tensors["model.embed_tokens.weight"]
        lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        return cls(embed, [layer(i) for i in range(config.num_layers)], norm("model.norm.weight"), lm_head)

    def to(self, dtype: torch.dtype, device: torch.device) -> LlamaWeights:
        """Dense tensors in `dtype` on `device`; quantized matrices stay as they are (CPU)."""
        def move(t: Weight) -> Weight:
            if quant.is_quantized(t):
                return t
            return t.to(device=device, dtype=dtype).contiguous()

        tied = self.lm_head is self.embed
        embed = move(self.embed)
        layers = [w.with_matrices(move, move) for w in self.layers]
        return LlamaWeights(embed, layers, move(self.norm), embed if tied else move(self.lm_head))

    def quantized(self, format_name: str) -> LlamaWeights:
        """Every matrix and the token table quantized to `format_name` (--quantize); norms stay."""
        def convert(w: Weight) -> QuantizedWeight:
            return quant.quantize(quant.dense(w), format_name)

        embed = convert(self.embed)
        layers = [w.with_matrices(convert) for w in self.layers]
        head = embed if self.lm_head is self.embed else convert(self.lm_head)
        return LlamaWeights(embed, layers, self.norm, head)

    def dequantized(self) -> LlamaWeights:
        """Every quantized matrix as float32 (where no native kernel runs them)."""
        embed = quant.dense(self.embed)
        layers = [w.with_matrices(quant.dense) for w in self.layers]
        head = embed if self.lm_head is self.embed else quant.dense(self.lm_head)
        return LlamaWeights(embed, layers, self.norm, head)

    def is_quantized(self) -> bool:
        return any(quant.is_quantized(m) for m in [self.embed, self.lm_head, *self.layers[0].matrices()])

    def nbytes(self) -> int:
        """Bytes the weights hold (a tied head counted once)."""
        matrices = [self.embed, self.norm, *(m for w in self.layers for m in w.matrices()),
                    *(v for w in self.layers for f in _LAYER_VECTORS if (v := getattr(w, f)) is not None)]
        if self.lm_head is not self.embed:
            matrices.append(self.lm_head)
        return sum(m.nbytes for m in matrices)

    def packed_for(self, kernel: LinearKernel) -> LlamaWeights:
        """The same weights with every matrix in `kernel`'s layout; the embedding stays a table."""
        layers = [w.with_matrices(kernel.pack) for w in self.layers]
        return LlamaWeights(self.embed, layers, self.norm, kernel.pack(self.lm_head))

    def probe_shape(self) -> ProbeShape:
        """The linears a forward runs, for measuring kernels on the model's own weights."""
        return ProbeShape([[w.qkv, w.o, w.gate_up, w.down] for w in self.layers], self.lm_head)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The rotary frequencies of the config's (full-attention) RoPE."""
    return rope_frequencies(Rope(config.rope_theta, config.rope_scaling), config.head_dim,
                            config.max_position_embeddings)[0]


def rope_frequencies(rope: Rope, dim: int, context: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float64, the factor cos and sin are scaled by), as
    transformers' ROPE_INIT_FUNCTIONS compute them for every position up to `context`."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind in ("default", "dynamic"):  # dynamic NTK changes nothing up to max_position_embeddings
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(rope.theta, dim, scaling, context)
    if kind == "longrope":
        return _longrope(inv_freq, scaling, context)
    raise ValueError(f"RoPE type {kind!r} is not implemented")  # config.py refuses it first


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3 scaling: long wavelengths stretched by `factor`, short ones kept, a blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def _yarn(theta: float, dim: int, scaling: dict, context: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or context / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolated = 1 - ramp
    inv_freq = extrapolation / factor * (1 - extrapolated) + extrapolation * extrapolated
    return inv_freq, float(attention)


def _longrope(inv_freq: torch.Tensor, scaling: dict, context: int) -> tuple[torch.Tensor, float]:
    """LongRoPE's short factors (config.py caps the context at the original one, where
    transformers uses them) and its attention factor from the extension ratio."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]  # config.py puts max_position_embeddings / original where none is given
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float64)
    return inv_freq / short, float(attention)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config`'s family holds, with its shape."""
    hidden, ffn, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * dim, config.num_kv_heads * dim
    layer: dict[str, tuple[int, ...]] = {"self_attn.o_proj.weight": (hidden, q_rows),
                                         "mlp.down_proj.weight": (hidden, ffn),
                                         "input_layernorm.weight": (hidden,),
                                         "post_attention_layernorm.weight": (hidden,)}
    if config.family == "phi3":
        layer |= {"self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                  "mlp.gate_up_proj.weight": (2 * ffn, hidden)}
    else:
        layer |= {"self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
                  "self_attn.v_proj.weight": (kv_rows, hidden), "mlp.gate_proj.weight": (ffn, hidden),
                  "mlp.up_proj.weight": (ffn, hidden)}
    if config.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                  "self_attn.v_proj.bias": (kv_rows,)}
    if config.o_bias:
        layer["self_attn.o_proj.bias"] = (hidden,)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (ffn,), "mlp.up_proj.bias": (ffn,), "mlp.down_proj.bias": (hidden,)}
    if config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,)}
    if config.gemma_norms:
        layer |= {"pre_feedforward_layernorm.weight": (hidden,),
                  "post_feedforward_layernorm.weight": (hidden,)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Half precision: normalize in float32 like the reference implementation, then scale.
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Hugging Face (rotate_half) layout: x*cos + rotate_half(x)*sin.

    rotate_half(x) = cat(-x2, x1) is a roll by half the head with the sign folded into the sin
    table, so the rotation is four exact elementwise ops, bit-identical to the textbook form.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


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


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU. torch's float32 erf takes another path for a lone row than for a batch
    (tests/test_families.py caught a last-bit difference); in float64 the two paths differ
    far below what the rounding to float32 keeps."""
    return F.gelu(x.double()).to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": _gelu_erf, "gelu_pytorch_tanh": _gelu_tanh}


def rope_table(rope: Rope, config: ModelConfig, context: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [context, head_dim] of one RoPE, scaled by its attention factor."""
    inv_freq, factor = rope_frequencies(rope, config.head_dim, config.max_position_embeddings)
    freqs = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    return (torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype),
            torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype))


def native_ops_for(like: torch.Tensor) -> NativeOps | None:
    """The native ops for tensors like `like`: float32 on the CPU with the library built, else
    None (half precision and CUDA keep the torch ops)."""
    if like.dtype != torch.float32 or like.device.type != "cpu":
        return None
    return native_ops.load()


class Llama:
    def __init__(self, config: ModelConfig, weights: LlamaWeights, *, batch_invariant: bool = False,
                 linear_kernel: LinearKernel | None = None, max_positions: int | None = None,
                 native: bool = True, tensor_parallel: TensorParallel | None = None) -> None:
        """`weights` dense; they are packed here for `linear_kernel`, by default torch's own
        GEMM, on fixed row tiles when batch-invariant (the engine passes the kernel it measured).
        `native`: run the small ops in C where they can run here (`native_ops_for`).
        `tensor_parallel`: this rank's collectives, when `config` and `weights` are one rank's
        shard (nanoserve.parallel): the same forward, an all-reduce after o and after down, the
        embedding summed over ranks and the logits of this rank's vocabulary rows."""
        self.config = config
        self.tp = tensor_parallel
        self.ops = native_ops_for(weights.embed) if native else None
        self.linear_kernel = linear_kernel or KERNELS["aten-tile16" if batch_invariant else "aten"]
        self.weights = weights.packed_for(self.linear_kernel)
        self.batch_invariant = batch_invariant
        self.linear = self.linear_kernel.apply
        device, dtype = weights.embed.device, weights.embed.dtype
        context = max_positions or config.max_position_embeddings
        # One (cos, signed sin) table per distinct RoPE; layer i rotates by rope_tables[layer_rope[i]].
        ropes = [config.rope_of(i) for i in range(config.num_layers)]
        distinct = [r for i, r in enumerate(ropes) if r not in ropes[:i]]
        self.rope_tables = [rope_table(r, config, context, device, dtype) for r in distinct]
        self.layer_rope = [distinct.index(r) for r in ropes]
        self.rope_cos, self.rope_signed_sin = self.rope_tables[0]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.switched = not config.is_plain_llama
        # The native attention has no soft-capping: a model with it attends in torch (the rest
        # of its small ops stay native).
        self.native_attention = self.ops is not None and not config.attn_softcap
        self.activation = ACTIVATIONS[config.hidden_act]
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=device)
                            if config.gemma_norms else None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run every row, write their K/V into the cache, return float32 logits of `logits_rows`.

        Each layer: norm -> attention block -> residual add + norm -> MLP -> residual add, the
        residual adds done in place and fused with the norm that follows them.
        """
        step = self._step_context(batch, kv_cache)  # built once per step, used by every layer
        if self.tp is None:
            hidden = quant.embedding(batch.input_ids, self.weights.embed)
        else:
            hidden = self.tp.embedding(batch.input_ids, self.weights.embed)
        if self.switched:
            delta = self._switched_layers(hidden, step, kv_cache)
        else:
            delta = self._llama_layers(hidden, step, kv_cache)
        if delta is not None:
            hidden += delta
        last = self._add_norm(hidden[batch.logits_rows], None, self.weights.norm)
        logits = self.linear(last, self.weights.lm_head).float()
        if self.config.final_softcap:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _llama_layers(self, hidden: torch.Tensor, step: StepContext, kv_cache: KVCache
                      ) -> torch.Tensor | None:
        """Every layer with every switch off; returns the last sublayer's output, not yet added."""
        delta = None  # the last sublayer's output, not yet added into `hidden`
        for index, layer in enumerate(self.weights.layers):
            normed = self._add_norm(hidden, delta, layer.input_norm, step.normed)
            delta = self._attention_block(index, layer, normed, step, kv_cache)
            normed = self._add_norm(hidden, delta, layer.post_norm, step.normed)
            delta = self._mlp(layer, normed, step)
        return delta

    def _switched_layers(self, hidden: torch.Tensor, step: StepContext, kv_cache: KVCache
                         ) -> torch.Tensor | None:
        """Every layer with the family's switches (`hidden` scaled in place first, for Gemma)."""
        if self.embed_scale is not None:
            hidden *= self.embed_scale
        delta = None
        for index, layer in enumerate(self.weights.layers):
            normed = self._add_norm(hidden, delta, layer.input_norm, step.normed)
            delta = self._switched_attention(index, layer, normed, step, kv_cache)
            if layer.attn_out_norm is not None:
                delta = self._add_norm(delta, None, layer.attn_out_norm)
            normed = self._add_norm(hidden, delta, layer.post_norm, step.normed)
            delta = self._switched_mlp(layer, normed, step)
            if layer.mlp_out_norm is not None:
                delta = self._add_norm(delta, None, layer.mlp_out_norm)
        return delta

    def _switched_attention(self, index: int, layer: LayerWeights, x: torch.Tensor, step: StepContext,
                            kv_cache: KVCache) -> torch.Tensor:
        cfg, batch = self.config, step.batch
        qkv = self.linear(x, layer.qkv)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer)
        window, table = cfg.window(index), self.layer_rope[index]
        if self.native_attention:
            k_cache, v_cache = kv_cache.k[index], kv_cache.v[index]
            cos, sin = self.rope_tables[table]
            self.ops.rope_write_kv(qkv, batch.positions, cos, sin, batch.slot_mapping, k_cache, v_cache,
                                   cfg.num_heads)
            out = self.ops.paged_attention(qkv, k_cache, v_cache, step.paged, cfg.num_heads, self.scale,
                                           window=window, out=step.attended)
        else:
            cos, sin = step.ropes[table]
            plan = step.window_plan if window else step.plan
            out = self._torch_attention(index, qkv, step, kv_cache, cos=cos, sin=sin, plan=plan,
                                        softcap=cfg.attn_softcap)
        out = self._row_parallel(out, layer.o)
        if layer.o_bias is not None:
            out += layer.o_bias
        return out

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """RMSNorm over each q and each k head, in place in qkv (before RoPE, as Qwen3 and Gemma 3)."""
        cfg = self.config
        heads = qkv[:, : self.q_size + self.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k = heads.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
        k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))

    def _switched_mlp(self, layer: LayerWeights, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        gate_up = self.linear(x, layer.gate_up)
        if layer.gate_up_bias is not None:
            gate_up += layer.gate_up_bias
        if self.ops is not None and self.config.hidden_act == "silu":
            activated = self.ops.silu_mul(gate_up, step.activated)
        else:
            # Row by row over the strided `gate` view, as `_mlp` does (batch-invariant).
            gate, up = gate_up.chunk(2, dim=-1)
            activated = self.activation(gate) * up
        out = self._row_parallel(activated, layer.down)
        if layer.down_bias is not None:
            out += layer.down_bias
        return out

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden += delta (in place, when there is one), then the RMSNorm of hidden."""
        eps = self.config.rms_norm_eps
        if self.ops is not None:
            if delta is None:
                return self.ops.rms_norm(hidden, weight, eps, out)
            return self.ops.add_rms_norm(hidden, delta, weight, eps, out)
        if delta is not None:
            hidden += delta
        return rms_norm(hidden, weight, eps)

    def _step_context(self, batch: ForwardBatch, kv_cache: KVCache) -> StepContext:
        if self.ops is not None:
            rows, cfg = batch.input_ids.shape[0], self.config
            new = functools.partial(torch.empty, dtype=self.rope_cos.dtype, device=self.rope_cos.device)
            step = StepContext(batch, paged=paged_context(batch, kv_cache), normed=new(rows, cfg.hidden_size),
                               attended=new(rows, self.q_size), activated=new(rows, cfg.intermediate_size))
            if not self.native_attention:
                self._add_torch_attention(step, kv_cache)
            return step
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_signed_sin[batch.positions].unsqueeze(1)
        plan = (self._position_plan(batch, kv_cache.block_size) if self.batch_invariant
                else [self._group_mask(group, kv_cache.block_size) for group in batch.groups])
        step = StepContext(batch, cos=cos, sin=sin, plan=plan)
        if self.switched:
            self._add_torch_attention(step, kv_cache)
        return step

    def _add_torch_attention(self, step: StepContext, kv_cache: KVCache) -> None:
        """What a switched model's torch attention needs beyond the Llama step: every RoPE
        table's rows and the sliding layers' plan (the full plan too, where native built none)."""
        batch, block_size, window = step.batch, kv_cache.block_size, self.config.sliding_window
        step.ropes = [(cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1))
                      for cos, sin in self.rope_tables]

        def plan(window: int) -> PositionPlan | list[torch.Tensor]:
            if self.batch_invariant:
                return self._position_plan(batch, block_size, window)
            return [self._group_mask(group, block_size, window) for group in batch.groups]

        if step.plan is None:
            step.plan = plan(0)
        step.window_plan = plan(window) if window else None

    def _attention_block(self, index: int, layer: LayerWeights, x: torch.Tensor, step: StepContext,
                         kv_cache: KVCache) -> torch.Tensor:
        qkv = self.linear(x, layer.qkv)
        if self.ops is not None:
            out = self._native_attention(index, qkv, step, kv_cache)
        else:
            out = self._torch_attention(index, qkv, step, kv_cache)
        return self._row_parallel(out, layer.o)

    def _row_parallel(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """x @ weight^T for o and down, the matrices whose input the ranks hold in shares: the
        whole output on every rank (nanoserve.parallel decides how)."""
        return self.linear(x, weight) if self.tp is None else self.tp.row_parallel(x, weight, self.linear)

    def _native_attention(self, index: int, qkv: torch.Tensor, step: StepContext,
                          kv_cache: KVCache) -> torch.Tensor:
        """RoPE, the K/V write and attention over the paged cache in place: two native calls."""
        k_cache, v_cache = kv_cache.k[index], kv_cache.v[index]
        batch, heads = step.batch, self.config.num_heads
        self.ops.rope_write_kv(qkv, batch.positions, self.rope_cos, self.rope_signed_sin,
                               batch.slot_mapping, k_cache, v_cache, heads)
        # q is the first heads * head_dim columns of qkv, now rotated in place.
        return self.ops.paged_attention(qkv, k_cache, v_cache, step.paged, heads, self.scale,
                                        out=step.attended)

    def _torch_attention(self, index: int, qkv: torch.Tensor, step: StepContext, kv_cache: KVCache,
                         cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                         plan: PositionPlan | list[torch.Tensor] | None = None,
                         softcap: float = 0.0) -> torch.Tensor:
        """`cos`, `sin`, `plan`: the layer's own where a switched model has several (default:
        the step's); `softcap` > 0: scores soft-capped before the mask."""
        cfg, batch = self.config, step.batch
        plan = step.plan if plan is None else plan
        cos = step.cos if cos is None else cos
        sin = step.sin if sin is None else sin
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
        visible = slots <= batch.positions.view(-1, 1)
        if window:  # a sliding layer: only the last `window` positions
            visible &= slots > batch.positions.view(-1, 1) - window
        return PositionPlan(tables, decodes, prefills, visible.view(1, -1, 1, ctx))

    def _group_mask(self, group: AttentionGroup, block_size: int, window: int = 0) -> torch.Tensor:
        """[1, seqs, per_kv * rows, ctx] bool: a query row sees the context up to its position
        (with a `window`, its last `window` positions only)."""
        ctx = group.block_tables.shape[1] * block_size
        slots = torch.arange(ctx, device=group.positions.device)
        visible = slots.view(1, 1, ctx) <= group.positions.unsqueeze(-1)  # [seqs, rows, ctx]
        if window:
            visible &= slots.view(1, 1, ctx) > group.positions.unsqueeze(-1) - window
        per_kv = self.config.num_heads // self.config.num_kv_heads
        return visible.unsqueeze(1).expand(-1, per_kv, -1, -1).reshape(1, group.num_seqs, -1, ctx)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        gate_up = self.linear(x, layer.gate_up)
        if self.ops is not None:
            return self._row_parallel(self.ops.silu_mul(gate_up, step.activated), layer.down)
        # SiLU runs row by row over the strided `gate` view, so each row takes the same
        # vectorized path whatever the batch (tests/test_model.py pins this).
        gate, up = gate_up.chunk(2, dim=-1)
        return self._row_parallel(F.silu(gate) * up, layer.down)
