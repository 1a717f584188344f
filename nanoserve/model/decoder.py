"""The decoder forward pass over a flat batch of tokens from many sequences, every family.

Owns: the layer loop (token embedding, RMSNorm around both sublayers, attention over the
paged KV cache, the gated MLP, residual adds, a tied or untied output head) and each family's
switches (`ModelConfig`): q/k/v and MLP biases, q/k head norms, Gemma's (1 + w) norms around
both sublayers and scaled embedding, attention and logit soft-capping, per-layer-type RoPE
(`rope`; M-RoPE's three positions a row where the batch carries them, Qwen2-VL's), the
gate's activation (`layers`), and on a mixture of experts' sparse layers the
routed experts in place of the MLP (`moe`), and image embedding rows spliced over their
placeholder tokens' embeddings (the batch carries them; `model.vision` makes them). Knows
nothing of requests, sampling or HTTP: a
`ForwardBatch` (`batch`) says which rows are which, and which adapter each LoRA row runs with
(`lora`: its update is added after the base linear it targets).

One loop with named switches rather than one module per family: the families differ by a
dozen small ops around the same attention and MLP, and the batch-invariant attention, the
native path and the cache layout are the hard part, shared by all. A switch that is off costs
one `is None` test a layer.

Rows are grouped for attention: all single-token (decode) rows form one group, each prefill
chunk is a group of its own. Every group reads its context through block tables.

The matrix multiplies run through a `LinearKernel` chosen by `nanoserve.model.linear`
(measured on this machine, its weights packed once here). Everything outside them runs one of
two ways, chosen once per model:
- native (float32 on the CPU, the library built; `nanoserve.native.ops`): RMSNorm fused with
  the residual add, RoPE fused with the K/V write into the paged cache, attention reading the
  paged cache in place, SiLU*up or GELU*up, q/k head norms. Its attention is batch-invariant by
  construction in both modes (each row alone over exactly the slots it sees, in context-chunk
  order), and every row, prefill or decode, goes through it, so the two agree bit for bit. A
  sparse layer with native matrices (the `native-quant-x8` or the float32 `native` kernel) runs
  its routed experts as one native call (`nanoserve.native.moe`). Where the stack is one the
  one-call decoder takes (`ModelConfig.runs_in_one_call`: Llama's, Mixtral's experts, Gemma 2
  and 3, Qwen3, windows) on one rank with such matrices, all its layers run as one native call
  a step (`nanoserve.native.decoder`), with the separate calls' bits, LoRA rows' updates
  included (`nanoserve.native.lora`).
- torch (half precision, CUDA, NANOSERVE_NO_NATIVE=1, or `native=False`): `attention`'s
  plain or batch-invariant forms, over K/V gathered from the cache.
A forward is batch-invariant when both its attention and its linear kernel are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from nanoserve import huge_pages
from nanoserve.config import ModelConfig
from nanoserve.model.attention import TorchAttention
from nanoserve.model.batch import ForwardBatch, StepContext, paged_context
from nanoserve.model.kv_cache import NATIVE_KV_CACHE_DTYPES, KVCache
from nanoserve.model.layers import ACTIVATIONS, rms_norm
from nanoserve.model.linear import KERNELS, LinearKernel, embedding
from nanoserve.model.lora import apply as apply_lora
from nanoserve.model.lora import native_step as native_lora_step
from nanoserve.model.moe import MixtureOfExperts
from nanoserve.model.rope import mrope_axis, rope_table
from nanoserve.model.weights import LayerWeights, LlamaWeights
from nanoserve.native import lora as native_lora
from nanoserve.native import ops as native_ops
from nanoserve.native.decoder import DecoderShape, LayerVectors, NativeDecoder
from nanoserve.native.moe import NativeExperts
from nanoserve.native.ops import NativeOps
from nanoserve.quant import Weight

# The native small-op calls one layer of the per-layer loop makes beside its linears (`DecoderLM._layers`:
# norm, RoPE + K/V write, attention, residual add + norm, SiLU*up): what the one-call decoder
# saves, as the kernel choice (worker/rank.py) counts it.
LOOP_NATIVE_OPS_PER_LAYER = 5

class TensorParallel(Protocol):
    """What a forward on one rank's shard asks of its ranks (nanoserve.distributed.collectives)."""

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor: ...

    def row_parallel(self, x: torch.Tensor, weight: Weight,
                     linear: Callable[[torch.Tensor, Weight], torch.Tensor]) -> torch.Tensor: ...

    def embedding(self, ids: torch.Tensor, table: Weight, *, threads: int | None = None) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def by_output(self) -> bool: ...


def native_ops_for(like: torch.Tensor) -> NativeOps | None:
    """The native ops for tensors like `like`: float32 on the CPU with the library built, else
    None (half precision and CUDA keep the torch ops)."""
    if like.dtype != torch.float32 or like.device.type != "cpu":
        return None
    return native_ops.load()


class DecoderLM:
    """The decoder-only language model of every family in `FAMILIES`: the Llama stack and
    the switches its `ModelConfig` turns on (the module docstring)."""

    def __init__(self, config: ModelConfig, weights: LlamaWeights, *, batch_invariant: bool = False,
                 linear_kernel: LinearKernel | None = None, max_positions: int | None = None,
                 native: bool = True, tensor_parallel: TensorParallel | None = None,
                 kv_cache_dtype: str | None = None, threads: int | None = None) -> None:
        """`weights` dense; they are packed here for `linear_kernel`, by default torch's own
        GEMM, on fixed row tiles when batch-invariant (the engine passes the kernel it measured).
        `native`: run the small ops in C where they can run here (`native_ops_for`).
        `tensor_parallel`: this rank's collectives, when `config` and `weights` are one rank's
        shard (nanoserve.distributed): the same forward, o and down across the ranks, the
        embedding summed over ranks and the logits of this rank's vocabulary rows.
        `kv_cache_dtype`: what the KV cache it runs with stores (kv_cache.py; None: the
        weights' dtype); the native attention reads float32 and q8_0 caches, the torch
        attention any other.
        `threads`: the thread count of every native call the forward makes (the engine's start-up
        policy's, `Startup.threads`; None: `native.thread_count`'s, for callers without one)."""
        self.config = config
        self.threads = threads
        self.tp = tensor_parallel
        self.ops = native_ops_for(weights.embed) if native else None
        self.native_kv = kv_cache_dtype is None or kv_cache_dtype in NATIVE_KV_CACHE_DTYPES
        self.linear_kernel = linear_kernel or KERNELS["aten-tile16" if batch_invariant else "aten"]
        self.weights = weights.packed_for(self.linear_kernel, threads)
        # Here, before the native decoder and experts below take their addresses; the loaded
        # tensors packing left as they were (the caller's) stay where they are.
        huge_pages.gather(huge_pages.tensors_in(self.weights), keep=huge_pages.tensors_in(weights))
        self.batch_invariant = batch_invariant
        self.linear = functools.partial(self.linear_kernel.apply, threads=threads)
        device, dtype = weights.embed.device, weights.embed.dtype
        context = max_positions or config.max_position_embeddings
        # One (cos, signed sin) table per distinct RoPE; layer i rotates by rope_tables[layer_rope[i]].
        ropes = [config.rope_of(i) for i in range(config.num_layers)]
        distinct = [r for i, r in enumerate(ropes) if r not in ropes[:i]]
        self.rope_tables = [rope_table(r, config, context, device, dtype) for r in distinct]
        self.layer_rope = [distinct.index(r) for r in ropes]
        self.mrope_axis = mrope_axis(config).to(device) if config.mrope_section else None
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.torch_attention = TorchAttention(config, self.scale, batch_invariant)
        self.activation = ACTIVATIONS[config.hidden_act]
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=device)
                            if config.gemma_norms else None)
        self.moe = (MixtureOfExperts(config.experts, self._linear, self._activate, threads=threads)
                    if config.experts else None)
        self.native_experts = self._native_experts()
        self.decoder = self._native_decoder()

    def _native_experts(self) -> list[NativeExperts | None]:
        """Per layer, its routed experts as one native call where the native small ops run and
        the experts are native matrices (else None: the layer loops over its experts); split by
        output across ranks, its router alone (the loop runs the experts, between gathers)."""
        if self.ops is None:
            return [None] * len(self.weights.layers)
        float_panels = self.linear_kernel.name == "native"
        renormalize = self.config.experts.renormalize if self.config.experts else False
        if self.tp is not None and self.tp.by_output:  # the loop runs the experts; the router is native
            return [NativeExperts.router_only(w.moe.router, w.moe.top_k, renormalize=renormalize,
                                              float_panels=float_panels)
                    if w.moe is not None else None for w in self.weights.layers]
        return [NativeExperts.for_layer(w.moe.router, w.moe.gate_up, w.moe.down, w.moe.top_k,
                                        renormalize=renormalize, float_panels=float_panels)
                if w.moe is not None else None for w in self.weights.layers]

    def _native_decoder(self) -> NativeDecoder | None:
        """Every layer of a step in one native call, where it computes exactly what the loop of
        separate native calls computes: the stacks `ModelConfig.runs_in_one_call` names (sparse
        layers each with their experts' native call), one rank, native matrices."""
        cfg, layers = self.config, self.weights.layers
        if self.ops is None or not self.native_attention or not cfg.runs_in_one_call or self.tp is not None:
            return None
        shape = DecoderShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.rms_norm_eps, self.scale, cfg.attn_softcap,
                             cfg.hidden_act)
        vectors = [LayerVectors(w.input_norm, w.post_norm, *self.rope_tables[self.layer_rope[i]],
                                cfg.window(i), w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm)
                   for i, w in enumerate(layers)]
        return NativeDecoder.for_layers(shape, vectors, [[w.qkv, w.o, w.gate_up, w.down] for w in layers],
                                        float_panels=self.linear_kernel.name == "native",
                                        experts=self.native_experts)

    @property
    def native_attention(self) -> bool:
        """The native attention reads float32, float16, bfloat16 and q8_0 caches: a model with
        another cache attends in torch (the rest of its small ops stay native)."""
        return self.ops is not None and self.native_kv

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run every row, write their K/V into the cache, return float32 logits of `logits_rows`."""
        return self._head(self._residual_stream(batch, kv_cache), batch.logits_rows)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and beside its logits the final hidden states of `hidden_rows`: after the
        model's last norm, without the head (transformers' `last_hidden_state`), what pooling
        reads."""
        hidden = self._residual_stream(batch, kv_cache)
        rows = batch.hidden_rows if batch.hidden_rows is not None else batch.logits_rows[:0]
        return self._head(hidden, batch.logits_rows), self._add_norm(hidden[rows], None, self.weights.norm)

    def _residual_stream(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Every row through every layer, K/V written into the cache; the residual stream after
        the last layer, before the final norm.

        Each layer: norm -> attention block -> residual add + norm -> MLP -> residual add, the
        residual adds done in place and fused with the norm that follows them (`delta` is the
        last sublayer's output, not yet added into `hidden`).
        """
        step = self._step_context(batch, kv_cache)  # built once per step, used by every layer
        input_ids = batch.input_ids
        if batch.image_rows is not None:
            # An image's rows are spliced over their tokens below: those read row 0 of the table,
            # since their id may lie outside it (a vocabulary without the image token).
            input_ids = input_ids.index_fill(0, batch.image_rows, 0)
        if self.tp is None:
            hidden = embedding(input_ids, self.weights.embed, threads=self.threads)
        else:
            hidden = self.tp.embedding(input_ids, self.weights.embed, threads=self.threads)
        if self.embed_scale is not None:
            hidden *= self.embed_scale
        if batch.image_rows is not None:  # an image's rows stand in for its placeholder tokens
            hidden.index_copy_(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        # The one-call decoder adds LoRA rows' updates itself, where the adapters run in C.
        runs_lora = step.lora is not None or not batch.adapter_rows
        # The one-call decoder runs causal attention and one position a row only: a step with a
        # bidirectional image (Gemma 3's) or M-RoPE positions takes the loop.
        if (self.decoder is not None and self.ops is not None and runs_lora and batch.visible_ends is None
                and batch.rope_positions is None):
            tally = self.moe.tally if self.moe is not None else None
            if tally is not None:
                tally.calls += self.decoder.sparse_layers
            delta = self.decoder.run(hidden, batch.slot_mapping, step.paged, kv_cache, step.normed,
                                     step.attended, step.activated, step.lora,
                                     expert_rows=None if tally is None else tally.rows,
                                     expert_seconds=None if tally is None else tally.seconds,
                                     threads=self.threads)
        else:
            delta = self._layers(hidden, step, kv_cache)
        if delta is not None:
            hidden += delta
        return hidden

    def _head(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits of `rows` of the residual stream: final norm, output head, soft-cap."""
        last = self._add_norm(hidden[rows], None, self.weights.norm)
        logits = self.linear(last, self.weights.lm_head).float()
        if self.config.final_softcap:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _layers(self, hidden: torch.Tensor, step: StepContext, kv_cache: KVCache) -> torch.Tensor | None:
        """Every layer, one by one; returns the last sublayer's output, not yet added."""
        delta = None
        for index, layer in enumerate(self.weights.layers):
            normed = self._add_norm(hidden, delta, layer.input_norm, step.normed)
            delta = self._attention(index, layer, normed, step, kv_cache)
            if layer.attn_out_norm is not None:
                delta = self._add_norm(delta, None, layer.attn_out_norm)
            normed = self._add_norm(hidden, delta, layer.post_norm, step.normed)
            delta = self._mlp(index, layer, normed, step)
            if layer.mlp_out_norm is not None:
                delta = self._add_norm(delta, None, layer.mlp_out_norm)
        return delta

    def _attention(self, index: int, layer: LayerWeights, x: torch.Tensor, step: StepContext,
                   kv_cache: KVCache) -> torch.Tensor:
        cfg, batch = self.config, step.batch
        qkv = self.linear(x, layer.qkv)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        self._lora(qkv, x, step, index, "qkv")
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer)
        window, rope = cfg.window(index), self.layer_rope[index]
        if self.native_attention:
            # RoPE and the K/V write, then attention over the paged cache in place: q is the
            # first heads * head_dim columns of qkv, rotated in place by the first call.
            k_cache, v_cache = kv_cache.k[index], kv_cache.v[index]
            k_scales, v_scales = kv_cache.scales(index)  # a q8_0 cache's; None for the others
            if step.mrope is not None:  # each row's own phases, read at its row index
                (cos, sin), positions = step.mrope[rope], step.row_index
            else:
                (cos, sin), positions = self.rope_tables[rope], batch.positions
            self.ops.rope_write_kv(qkv, positions, cos, sin, batch.slot_mapping, k_cache, v_cache,
                                   cfg.num_heads, k_scales, v_scales, threads=self.threads)
            out = self.ops.paged_attention(qkv, k_cache, v_cache, step.paged, cfg.num_heads, self.scale,
                                           window=window, out=step.attended, k_scales=k_scales,
                                           v_scales=v_scales, softcap=cfg.attn_softcap, threads=self.threads)
        else:
            out = self.torch_attention(index, qkv, step, kv_cache, rope=rope, window=window,
                                       softcap=cfg.attn_softcap)
        projected = self._row_parallel(out, layer.o)  # (LoRA never runs beside tensor parallelism)
        self._lora(projected, out, step, index, "o")
        out = projected
        if layer.o_bias is not None:
            out += layer.o_bias
        return out

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """RMSNorm over each q and each k head, in place in qkv (before RoPE, as Qwen3 and Gemma 3),
        or over all of q and all of k (OLMoE)."""
        cfg = self.config
        if self.ops is not None and cfg.qk_norm_per_head:  # the one-call decoder's code, in place
            self.ops.head_rms_norm(qkv, layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.rms_norm_eps, threads=self.threads)
            return
        if not cfg.qk_norm_per_head:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size: self.q_size + self.kv_size]
            q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
            k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))
            return
        heads = qkv[:, : self.q_size + self.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k = heads.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
        k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))

    def _mlp(self, index: int, layer: LayerWeights, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        if layer.moe is not None:
            if self.tp is not None and self.tp.by_output:  # this rank's columns, then all of them
                native = self.native_experts[index]
                return self.tp.all_gather(self.moe(x, layer.moe, native, gather=self.tp.all_gather))
            # routed and shared experts' partial sums (split by input), reduced once
            return self._reduced(self.moe(x, layer.moe, self.native_experts[index]))
        gate_up = self.linear(x, layer.gate_up)
        if layer.gate_up_bias is not None:
            gate_up += layer.gate_up_bias
        self._lora(gate_up, x, step, index, "gate_up")
        activated = self._activate(gate_up, step.activated)
        out = self._row_parallel(activated, layer.down)
        self._lora(out, activated, step, index, "down")
        if layer.down_bias is not None:
            out += layer.down_bias
        return out

    def _activate(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """activation(gate) * up of gate_up [rows, 2 * width]; `out`: the native path's buffer."""
        if self.ops is not None and self.config.hidden_act == "silu":
            return self.ops.silu_mul(gate_up, out, threads=self.threads)
        if self.ops is not None and self.config.hidden_act == "gelu_pytorch_tanh":
            return self.ops.gelu_tanh_mul(gate_up, out, threads=self.threads)
        # The activation runs row by row over the strided `gate` view, so each row takes the
        # same vectorized path whatever the batch (tests/test_model.py pins this).
        gate, up = gate_up.chunk(2, dim=-1)
        return self.activation(gate) * up

    def _linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """`linear` as it is at the call (the profile times the matrix multiplies by replacing it)."""
        return self.linear(x, weight)

    def _lora(self, out: torch.Tensor, x: torch.Tensor, step: StepContext, index: int, target: str) -> None:
        """Each LoRA row's low-rank update, after the base linear that ran for every row."""
        if step.lora is not None:
            step.lora.apply(out, x, index, target, threads=self.threads)
        elif step.batch.adapter_rows:
            apply_lora(out, x, step.batch.adapter_rows, index, target)

    @property
    def native_lora(self) -> bool:
        """Whether LoRA adapters' updates run in C here (nanoserve.native.lora): wherever the
        native small ops run; the engine loads its adapters for that path or the torch one."""
        return self.ops is not None and native_lora.available()

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split matrix's output summed over the ranks (itself with one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _row_parallel(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """x @ weight^T for o and down, the matrices whose input the ranks hold in shares: the
        whole output on every rank (`distributed.collectives` decides how)."""
        return self.linear(x, weight) if self.tp is None else self.tp.row_parallel(x, weight, self.linear)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden += delta (in place, when there is one), then the RMSNorm of hidden."""
        eps = self.config.rms_norm_eps
        if self.ops is not None:
            if delta is None:
                return self.ops.rms_norm(hidden, weight, eps, out, threads=self.threads)
            return self.ops.add_rms_norm(hidden, delta, weight, eps, out, threads=self.threads)
        if delta is not None:
            hidden += delta
        return rms_norm(hidden, weight, eps)

    def _mrope_rows(self, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's (cos, signed sin) rows [rows, head_dim]: dim d of row r read from the table
        at r's position on axis `mrope_axis[d]` (the same table entries plain RoPE reads, so a
        row whose three positions agree gets the bits of its plain rotation)."""
        if self.mrope_axis is None:
            raise ValueError("the batch carries M-RoPE positions; this model's RoPE has no mrope_section")
        index = self.mrope_axis.expand(1, positions.shape[1], -1)
        return cos[positions].gather(0, index)[0], sin[positions].gather(0, index)[0]

    def _step_context(self, batch: ForwardBatch, kv_cache: KVCache) -> StepContext:
        step = StepContext(batch)
        if batch.rope_positions is not None:
            step.mrope = [self._mrope_rows(cos, sin, batch.rope_positions) for cos, sin in self.rope_tables]
            step.row_index = torch.arange(batch.rope_positions.shape[1], device=batch.rope_positions.device)
        if self.ops is not None:
            step.lora = native_lora_step(batch.adapter_rows, batch.input_ids.shape[0])
            rows, cfg = batch.input_ids.shape[0], self.config
            cos = self.rope_tables[0][0]
            new = functools.partial(torch.empty, dtype=cos.dtype, device=cos.device)
            step.paged = paged_context(batch, kv_cache)
            step.normed, step.attended = new(rows, cfg.hidden_size), new(rows, self.q_size)
            step.activated = new(rows, cfg.intermediate_size)
        if not self.native_attention:
            self.torch_attention.plan_step(step, kv_cache, self.rope_tables)
        return step
