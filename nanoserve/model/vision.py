"""Vision encoders and projectors: an image's pixel tiles in, rows of the text model's
embedding space out, one family behind one interface (`ImageEncoder`).

Owns: the SigLIP vision transformer (patch embedding as one matrix multiply over unfolded
patches, learned position embeddings bucketed as Idefics3's NaViT variant does for tiles of any
size, pre-norm blocks with bidirectional attention among a tile's patches, a post-layernorm),
and each family's projector: Idefics3 / SmolVLM's pixel shuffle (scale_factor**2 neighbouring
patches into one row) and a linear map into the text width. The matrices go through the
engine's `LinearKernel` like the decoder's.
Refuses: knowing about prompts, requests or caching (the engine owns where the rows go and when
an image is encoded), and batching tiles of different images: an image is encoded alone, so its
rows have the same bits whoever else sent an image in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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
    patch_bias: torch.Tensor
    positions: torch.Tensor  # [patches_per_side**2, hidden]
    layers: list[EncoderLayerWeights]
    post_norm: tuple[torch.Tensor, torch.Tensor]
    projector: torch.Tensor  # [text hidden, hidden * scale_factor**2]

    def packed_for(self, kernel: LinearKernel) -> VisionWeights:
        """The same weights with every matrix packed once for `kernel`."""
        layers = [EncoderLayerWeights(**{f.name: (kernel.pack(getattr(layer, f.name))
                                                  if f.name in EncoderLayerWeights.MATRICES
                                                  else getattr(layer, f.name))
                                         for f in fields(layer)}) for layer in self.layers]
        return VisionWeights(kernel.pack(self.patch), self.patch_bias, self.positions, layers,
                             self.post_norm, kernel.pack(self.projector))

    def to(self, dtype: torch.dtype, device: torch.device) -> VisionWeights:
        def move(value):
            if isinstance(value, tuple):
                return tuple(move(v) for v in value)
            return value.to(device=device, dtype=dtype)
        layers = [EncoderLayerWeights(**{f.name: move(getattr(layer, f.name)) for f in fields(layer)})
                  for layer in self.layers]
        return VisionWeights(move(self.patch), move(self.patch_bias), move(self.positions), layers,
                             move(self.post_norm), move(self.projector))


class SiglipTower:
    """The SigLIP vision transformer: tiles in, one hidden row per patch out (post-layernorm)."""

    def __init__(self, config: VisionConfig, weights: VisionWeights, linear: LinearKernel) -> None:
        self.config = config
        self.weights = weights
        self.linear = linear.apply
        self.head_dim = config.hidden_size // config.num_heads

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, height, width] -> [tiles, patches, hidden]."""
        cfg, w = self.config, self.weights
        tiles, _, height, width = pixel_values.shape
        rows, cols = height // cfg.patch_size, width // cfg.patch_size
        hidden = self._affine(self._patches(pixel_values), w.patch, w.patch_bias)
        positions = w.positions[self._position_ids(rows, cols)]
        hidden = hidden.view(tiles, rows * cols, cfg.hidden_size) + positions
        for layer in w.layers:
            hidden = hidden + self._attention(self._norm(hidden, layer.norm1), layer)
            hidden = hidden + self._mlp(self._norm(hidden, layer.norm2), layer)
        return self._norm(hidden, w.post_norm)

    def _patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Each patch's pixels as one row [tiles * patches, channels * patch * patch], in the
        order the convolution's weight flattens (channel, row, column), patches row-major."""
        tiles, channels, height, width = pixel_values.shape
        p = self.config.patch_size
        grid = pixel_values.reshape(tiles, channels, height // p, p, width // p, p)
        return grid.permute(0, 2, 4, 1, 3, 5).reshape(-1, channels * p * p)

    def _position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """Each patch's position embedding on the trained grid: a tile of another patch count
        reads its fractional coordinates' buckets (as Idefics3's embeddings compute them)."""
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([count])
            fractions = (torch.arange(count, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
            return torch.bucketize(fractions, boundaries, right=True)

        ids = buckets(rows)[:, None] * side + buckets(cols)[None, :]
        return ids.reshape(-1).to(self.weights.positions.device)

    def _attention(self, x: torch.Tensor, layer: EncoderLayerWeights) -> torch.Tensor:
        """Bidirectional attention among each tile's patches."""
        tiles, patches, hidden = x.shape
        qkv = self._affine(x.reshape(-1, hidden), layer.qkv, layer.qkv_bias)
        q, k, v = qkv.view(tiles, patches, 3, self.config.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        attended = attended.transpose(1, 2).reshape(-1, hidden)
        return self._affine(attended, layer.out, layer.out_bias).view(tiles, patches, hidden)

    def _mlp(self, x: torch.Tensor, layer: EncoderLayerWeights) -> torch.Tensor:
        tiles, patches, hidden = x.shape
        up = self._affine(x.reshape(-1, hidden), layer.fc1, layer.fc1_bias)
        approximate = "tanh" if self.config.hidden_act == "gelu_pytorch_tanh" else "none"
        down = self._affine(F.gelu(up, approximate=approximate), layer.fc2, layer.fc2_bias)
        return down.view(tiles, patches, hidden)

    def _affine(self, x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.linear(x, matrix) + bias

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        weight, bias = norm
        return F.layer_norm(x, weight.shape, weight, bias, self.config.layer_norm_eps)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Idefics3's space-to-depth: [tiles, side * side, d] -> [tiles, side * side / s**2, d * s**2],
    each output row the s x s neighbouring patches' features side by side (its exact layout)."""
    tiles, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // scale_factor, dim * scale_factor).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale_factor, side // scale_factor, dim * scale_factor ** 2)
    return x.permute(0, 2, 1, 3).reshape(tiles, seq // scale_factor ** 2, dim * scale_factor ** 2)


class Idefics3Encoder:
    """SmolVLM / Idefics3: SigLIP, pixel shuffle, one linear map into the text width."""

    def __init__(self, config: VisionConfig, weights: VisionWeights,
                 linear_kernel: LinearKernel | None = None) -> None:
        self.config = config
        kernel = linear_kernel or KERNELS["aten"]
        self.weights = weights.packed_for(kernel)
        self.linear = kernel.apply
        self.tower = SiglipTower(config, self.weights, kernel)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.tower(pixel_values.to(self.weights.positions.dtype))
        shuffled = pixel_shuffle(patches, self.config.scale_factor)
        return self.linear(shuffled.reshape(-1, shuffled.shape[-1]), self.weights.projector)


ENCODERS = {"idefics3": Idefics3Encoder}


def build_encoder(config: VisionConfig, weights: VisionWeights,
                  linear_kernel: LinearKernel | None = None) -> ImageEncoder:
    return ENCODERS[config.family](config, weights, linear_kernel)
