"""Rotary position embeddings: the frequencies of every scaling kind transformers implements
(default, linear, dynamic, llama3, yarn, longrope), the (cos, signed sin) tables a model
builds once, and the rotation itself in the Hugging Face (rotate_half) layout.

Partial rotary embeddings (Phi-4-mini: RoPE on each head's first `rotary_dim` dims, the rest
passed through) run through the same whole-head rotation, the torch one and the native one
alike: the loader stores each q and k head's dims in `rotary_head_order` (the rotated halves
half a head apart, the passed dims between them), and the tables hold cos 1 and sin 0 on the
passed dims, where x * 1 + y * 0 is x exactly. q . k sums the same products in another
order, so attention is the transformers computation; V and the output stay in HF order."""

from __future__ import annotations

import math

import torch

from nanoserve.config import ModelConfig, Rope


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The rotary frequencies of the config's (full-attention) RoPE."""
    return rope_frequencies(Rope(config.rope_theta, config.rope_scaling), config.rotated_dims,
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
    raise ValueError(f"RoPE type {kind!r} is not implemented")  # loading/hf_config.py refuses it first


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
    """LongRoPE's short factors (loading/hf_config.py caps the context at the original one, where
    transformers uses them) and its attention factor from the extension ratio."""
    original = scaling["original_max_position_embeddings"]
    # loading/hf_config.py puts max_position_embeddings / original where none is given
    factor = scaling["factor"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float64)
    return inv_freq / short, float(attention)


def rope_table(rope: Rope, config: ModelConfig, context: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [context, head_dim] of one RoPE, scaled by its attention factor, in
    the stored head layout (`rotary_head_order`): cos 1 and sin 0 on the dims it passes.

    The phases position * frequency are rounded to float32 before cos and sin, as transformers
    (and vLLM) compute them: at long contexts that rounding moves a phase by up to half a
    float32 ulp of its value, which the checkpoints' reference forward carries and exact phases
    would not (tests/test_long_context.py holds 16k positions to it)."""
    inv_freq, factor = rope_frequencies(rope, config.rotated_dims, config.max_position_embeddings)
    freqs = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq.float()).double()
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    passed = torch.ones(context, (config.head_dim - config.rotated_dims) // 2, dtype=torch.float64)
    return (torch.cat([cos, passed, cos, passed], dim=-1).to(device=device, dtype=dtype),
            torch.cat([-sin, 0 * passed, sin, 0 * passed], dim=-1).to(device=device, dtype=dtype))


def mrope_axis(config: ModelConfig) -> torch.Tensor:
    """M-RoPE (Qwen2-VL): which of a token's (temporal, height, width) positions rotates each
    dim of a head [head_dim]: the rotated pairs split by `mrope_section` into a run for each axis
    in turn, each pair's two dims (half a head apart) alike, as transformers' Qwen2-VL rotary
    embedding composes its cos and sin."""
    pairs = torch.repeat_interleave(torch.arange(3), torch.tensor(config.mrope_section))
    return torch.cat([pairs, pairs])


def rotary_head_order(config: ModelConfig) -> torch.Tensor | None:
    """Which HF dim each stored dim of a q or k head is, where RoPE rotates only the first
    `rotary_dim` (r) of head_dim (d): [0, r/2) [r, r + (d-r)/2) [r/2, r) [r + (d-r)/2, d), so
    the rotated pairs (i, i + r/2) sit half a head apart as the whole-head rotation pairs them.
    None: the whole head rotates, and the HF order is the stored one."""
    if not config.rotary_dim:
        return None
    half, passed = config.rotary_dim // 2, (config.head_dim - config.rotary_dim) // 2
    first, second = torch.arange(half), torch.arange(half, config.rotary_dim)
    rest = torch.arange(config.rotary_dim, config.head_dim)
    return torch.cat([first, rest[:passed], second, rest[passed:]])


def qkv_row_order(config: ModelConfig) -> torch.Tensor | None:
    """`rotary_head_order` over the rows of the stacked q, k, v projection (v in HF order)."""
    order = rotary_head_order(config)
    if order is None:
        return None
    dim, qk_heads = config.head_dim, config.num_heads + config.num_kv_heads
    heads = torch.cat([h * dim + order for h in range(qk_heads)])
    return torch.cat([heads, torch.arange(qk_heads * dim, (qk_heads + config.num_kv_heads) * dim)])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Hugging Face (rotate_half) layout: x*cos + rotate_half(x)*sin.

    rotate_half(x) = cat(-x2, x1) is a roll by half the head with the sign folded into the sin
    table, so the rotation is four exact elementwise ops, bit-identical to the textbook form.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
