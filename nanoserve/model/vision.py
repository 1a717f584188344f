"""Vision encoders and projectors: an image's pixel tiles in, rows of the text model's
embedding space out, every family behind one interface (`ImageEncoder`).

Owns: the SigLIP / CLIP vision transformer (patch embedding as one matrix multiply over
unfolded patches, CLIP's class token and pre-layernorm, learned position embeddings (SigLIP's
bucketed as Idefics3's NaViT variant does for tiles of any size), pre-norm blocks with
bidirectional attention among a tile's tokens, read at the family's layer, a post-layernorm
after the last), and each family's projector: Idefics3 / SmolVLM's pixel shuffle
(scale_factor**2 neighbouring patches into one row) and a linear map into the text width;
LLaVA-1.5's two linears with a GELU between; Gemma 3's average pool of the patch grid, soft-token
RMSNorm and one linear. The matrices go through the engine's
`LinearKernel` like the decoder's.
Qwen2-VL's and Qwen2.5-VL's tower and merger are another shape (model/qwen_vision.py).
Refuses: knowing about prompts, requests or caching (the engine owns where the rows go and when
an image is encoded), and batching tiles of different images: an image is encoded alone, so its
rows have the same bits whoever else sent an image in the same step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from nanoserve.model.linear import KERNELS, LinearKernel
from nanoserve.model.vision_config import VisionConfig


class ImageEncoder(Protocol):
    """What the engine asks of a family's image side."""

    config: VisionConfig

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles [tiles, channels, height, width] -> its embedding rows
        [tiles * rows_per_tile, text hidden], in the order its placeholders appear."""
        ...


@dataclass(slots=True)
class EncoderLayerWeights:
    norm1: tuple[torch.Tensor, torch.Tensor]  # layernorm (weight, bias)
    qkv: torch.Tensor  # [3 * hidden, hidden]: q, k, v stacked
    qkv_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: torch.Tensor
    fc1_bias: torch.Tensor
    fc2: torch.Tensor
    fc2_bias: torch.Tensor

    MATRICES = ("qkv", "out", "fc1", "fc2")


@dataclass(slots=True)
class VisionWeights:
    patch: torch.Tensor  # [hidden, channels * patch * patch]: the patch convolution as a matrix
    patch_bias: torch.Tensor | None  # SigLIP's; CLIP's convolution has none
    positions: torch.Tensor  # [positions, hidden]
    layers: list[EncoderLayerWeights]
    # The projector's linears, in order, each (matrix, bias or None); the family's activation between
    projector: list[tuple[torch.Tensor, torch.Tensor | None]]
    class_embedding: torch.Tensor | None = None  # CLIP's class token, prepended to the patches
    pre_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # CLIP's pre_layrnorm
    post_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # after the last layer, when it runs
    projector_norm: torch.Tensor | None = None  # Gemma 3's soft-token RMSNorm before its linear (1 + w)

    def packed_for(self, kernel: LinearKernel, threads: int | None = None) -> VisionWeights:
        """The same weights with every matrix packed once for `kernel` (on `threads` threads)."""
        pack = functools.partial(kernel.pack, threads=threads)
        layers = [EncoderLayerWeights(**{f.name: (pack(getattr(layer, f.name))
                                                  if f.name in EncoderLayerWeights.MATRICES
                                                  else getattr(layer, f.name))
                                         for f in fields(layer)}) for layer in self.layers]
        projector = [(pack(matrix), bias) for matrix, bias in self.projector]
        return VisionWeights(pack(self.patch), self.patch_bias, self.positions, layers, projector,
                             self.class_embedding, self.pre_norm, self.post_norm, self.projector_norm)

    def to(self, dtype: torch.dtype, device: torch.device) -> VisionWeights:
        return moved(self, dtype, device)


def moved(value, dtype: torch.dtype, device: torch.device):
    """`value` with every tensor in it moved to `dtype` on `device`: a tower's weights, their
    layers' dataclasses, tuples and lists, nested; None stays None."""
    if value is None:
        return None
    if is_dataclass(value):
        return replace(value, **{f.name: moved(getattr(value, f.name), dtype, device) for f in fields(value)})
    if isinstance(value, tuple | list):
        return type(value)(moved(v, dtype, device) for v in value)
    return value.to(device=device, dtype=dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_pytorch_tanh": _gelu_tanh, "gelu": F.gelu, "quick_gelu": quick_gelu, "silu": F.silu}


class VisionTransformer:
    """SigLIP's or CLIP's ViT: tiles in, one hidden row per token (CLIP's class token first) out,
    from the layer the family reads (`VisionConfig.feature_layer`)."""

    def __init__(self, config: VisionConfig, weights: VisionWeights, linear: LinearKernel,
                 threads: int | None = None) -> None:
        self.config = config
        self.weights = weights
        self.linear = functools.partial(linear.apply, threads=threads)
        self.head_dim = config.hidden_size // config.num_heads
        self.activation = ACTIVATIONS[config.hidden_act]
        # transformers' hidden_states: [embeddings, layer 1, ..., layer N]; feature_layer indexes them
        count = len(weights.layers)
        self.num_layers = count if config.feature_layer is None else range(count + 1)[config.feature_layer]

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, height, width] -> [tiles, tokens, hidden]."""
        cfg, w = self.config, self.weights
        tiles, _, height, width = pixel_values.shape
        rows, cols = height // cfg.patch_size, width // cfg.patch_size
        hidden = self.linear(self._patches(pixel_values), w.patch)
        if w.patch_bias is not None:
            hidden += w.patch_bias
        hidden = hidden.view(tiles, rows * cols, cfg.hidden_size)
        if w.class_embedding is not None:
            hidden = torch.cat([w.class_embedding.expand(tiles, 1, -1), hidden], dim=1)
        hidden = hidden + w.positions[self._position_ids(rows, cols)]
        if w.pre_norm is not None:
            hidden = self._norm(hidden, w.pre_norm)
        # The residual adds and biases in place: `hidden` and every matrix product are this call's
        # own, and a fresh [tokens, hidden] result per add cost several times the add itself.
        for layer in w.layers[:self.num_layers]:
            hidden += self._attention(self._norm(hidden, layer.norm1), layer)
            hidden += self._mlp(self._norm(hidden, layer.norm2), layer)
        if w.post_norm is not None and self.config.feature_layer is None:
            hidden = self._norm(hidden, w.post_norm)
        return hidden

    def _patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Each patch's pixels as one row [tiles * patches, channels * patch * patch], in the
        order the convolution's weight flattens (channel, row, column), patches row-major."""
        tiles, channels, height, width = pixel_values.shape
        p = self.config.patch_size
        grid = pixel_values.reshape(tiles, channels, height // p, p, width // p, p)
        return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, channels * p * p)

    def _position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """Each token's position embedding. CLIP's: in order, its class token's first (the tile
        must be image_size square). SigLIP's on the trained grid: a tile of another patch count
        reads its fractional coordinates' buckets (as Idefics3's embeddings compute them)."""
        device = self.weights.positions.device
        if self.weights.class_embedding is not None:
            return torch.arange(rows * cols + 1, device=device)
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([count])
            fractions = (torch.arange(count, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
            return torch.bucketize(fractions, boundaries, right=True)

        ids = buckets(rows)[:, None] * side + buckets(cols)[None, :]
        return ids.reshape(-1).to(device)

    def _attention(self, x: torch.Tensor, layer: EncoderLayerWeights) -> torch.Tensor:
        """Bidirectional attention among each tile's tokens."""
        tiles, tokens, hidden = x.shape
        qkv = self._affine(x.reshape(-1, hidden), layer.qkv, layer.qkv_bias)
        q, k, v = qkv.view(tiles, tokens, 3, self.config.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        attended = attended.transpose(1, 2).reshape(-1, hidden)
        return self._affine(attended, layer.out, layer.out_bias).view(tiles, tokens, hidden)

    def _mlp(self, x: torch.Tensor, layer: EncoderLayerWeights) -> torch.Tensor:
        tiles, tokens, hidden = x.shape
        up = self._affine(x.reshape(-1, hidden), layer.fc1, layer.fc1_bias)
        return self._affine(self.activation(up), layer.fc2, layer.fc2_bias).view(tiles, tokens, hidden)

    def _affine(self, x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.linear(x, matrix).add_(bias)

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        weight, bias = norm
        return F.layer_norm(x, weight.shape, weight, bias, self.config.layer_norm_eps)


def pooled_soft_tokens(x: torch.Tensor, tokens_per_image: int, norm_weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Gemma 3's multimodal projector before its matrix: [tiles, side * side, d] average-pooled to
    [tiles, tokens_per_image, d] over square windows of the patch grid (row-major), then Gemma's
    RMSNorm in float32 with its weight applied as (1 + w) (transformers' Gemma3MultiModalProjector)."""
    tiles, seq, dim = x.shape
    side, pooled = math.isqrt(seq), math.isqrt(tokens_per_image)
    grid = x.transpose(1, 2).reshape(tiles, dim, side, side).contiguous()
    x = F.avg_pool2d(grid, kernel_size=side // pooled, stride=side // pooled).flatten(2).transpose(1, 2)
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + norm_weight.float())
    return normed.to(x.dtype)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Idefics3's space-to-depth: [tiles, side * side, d] -> [tiles, side * side / s**2, d * s**2],
    each output row the s x s neighbouring patches' features side by side (its exact layout)."""
    tiles, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // scale_factor, dim * scale_factor).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale_factor, side // scale_factor, dim * scale_factor ** 2)
    return x.permute(0, 2, 1, 3).reshape(tiles, seq // scale_factor ** 2, dim * scale_factor ** 2)


class ProjectedEncoder:
    """A ViT and its family's projector, one class for every family so far:
    Idefics3 / SmolVLM: SigLIP, pixel shuffle, one linear map into the text width;
    LLaVA-1.5: CLIP's second-to-last layer without its class token, linear, GELU, linear;
    Gemma 3: SigLIP, average pool to `tokens_per_image` rows, soft-token RMSNorm, one linear."""

    def __init__(self, config: VisionConfig, weights: VisionWeights,
                 linear_kernel: LinearKernel | None = None, threads: int | None = None) -> None:
        """`threads`: the native calls' thread count (None: `native.thread_count`'s)."""
        self.config = config
        kernel = linear_kernel or KERNELS["aten"]
        self.weights = weights.packed_for(kernel, threads)
        self.linear = functools.partial(kernel.apply, threads=threads)
        self.tower = VisionTransformer(config, self.weights, kernel, threads)
        self.activation = ACTIVATIONS[config.projector_act] if config.projector_act else None

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # One tile a pass: a tile's activations (1,024 rows for SigLIP at 512 px) stay in the
        # caches and in memory the allocator hands back, where an image's tiles at once (17 for
        # SmolVLM at 2048 px) made every op write hundreds of MB of fresh pages. A tile's rows
        # never depended on the other tiles (attention is within a tile), so the bits are the same.
        return torch.cat([self._encode_tiles(pixel_values[index:index + 1])
                          for index in range(pixel_values.shape[0])])

    def _encode_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.tower(pixel_values.to(self.weights.positions.dtype))
        if self.config.drop_class_token:
            features = features[:, 1:]
        if self.config.scale_factor > 1:
            features = pixel_shuffle(features, self.config.scale_factor)
        if self.config.tokens_per_image:
            features = pooled_soft_tokens(features, self.config.tokens_per_image, self.weights.projector_norm,
                                          self.config.layer_norm_eps)
        rows = features.reshape(-1, features.shape[-1])
        for index, (matrix, bias) in enumerate(self.weights.projector):
            if index:
                rows = self.activation(rows)
            rows = self.linear(rows, matrix)
            if bias is not None:
                rows = rows + bias
        return rows


ENCODERS = {"idefics3": ProjectedEncoder, "llava": ProjectedEncoder, "gemma3": ProjectedEncoder}


def build_encoder(config: VisionConfig, weights: VisionWeights,
                  linear_kernel: LinearKernel | None = None, threads: int | None = None) -> ImageEncoder:
    return ENCODERS[config.family](config, weights, linear_kernel, threads)
