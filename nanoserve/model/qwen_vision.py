"""Qwen2-VL's and Qwen2.5-VL's vision transformer and patch merger: one image's patches in,
rows of the text model's embedding space out (`model.vision.ImageEncoder`).

Owns: the patch embedding (the Conv3d over `temporal_patch_size` copies of a still image,
as one matrix multiply over each flattened patch), the 2D rotary embedding inside the ViT
(each patch's (row, column) in the merge-window order the processor emits, the row's
frequencies on the first half of each rotated half, the column's on the second), the
pre-norm blocks (Qwen2-VL: LayerNorm and a quick_gelu MLP; Qwen2.5-VL: RMSNorm and a SwiGLU
MLP, with window attention on every block but `full_attention_layers`, the merged units
permuted window by window as transformers' `get_vision_window_index` orders them), bidirectional
attention among the image's patches, and the merger (its norm, each merge_size x merge_size
patches' rows side by side, linear, GELU, linear), un-permuted back to the processor's order.
Refuses: batching images together (each image is encoded alone, so its rows have the same
bits whoever else sent one), videos (a grid of more than one temporal patch).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nanoserve.model.linear import KERNELS, LinearKernel
from nanoserve.model.vision import ACTIVATIONS, moved
from nanoserve.model.vision_config import VisionConfig

Norm = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias); no bias: an RMSNorm


@dataclass(slots=True)
class QwenVisionLayer:
    norm1: Norm
    qkv: torch.Tensor  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor
    proj: torch.Tensor
    proj_bias: torch.Tensor
    norm2: Norm
    up: torch.Tensor  # Qwen2-VL: fc1 [ffn, hidden]; Qwen2.5-VL: gate and up stacked [2 * ffn, hidden]
    up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor

    MATRICES = ("qkv", "proj", "up", "down")


@dataclass(slots=True)
class QwenVisionWeights:
    patch: torch.Tensor  # [hidden, channels * temporal * patch * patch]: the Conv3d as a matrix
    layers: list[QwenVisionLayer]
    merger_norm: Norm
    merger: list[tuple[torch.Tensor, torch.Tensor]]  # the merger's two linears (matrix, bias)

    def packed_for(self, kernel: LinearKernel, threads: int | None = None) -> QwenVisionWeights:
        def pack(matrix: torch.Tensor) -> torch.Tensor:
            return kernel.pack(matrix, threads=threads)

        layers = [replace(layer, **{name: pack(getattr(layer, name))
                                    for name in QwenVisionLayer.MATRICES}) for layer in self.layers]
        return QwenVisionWeights(pack(self.patch), layers, self.merger_norm,
                                 [(pack(matrix), bias) for matrix, bias in self.merger])

    def to(self, dtype: torch.dtype, device: torch.device) -> QwenVisionWeights:
        return moved(self, dtype, device)


def patch_positions(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """[grid_h * grid_w, 2] each patch's (row, column), in the processor's order: merge x merge
    windows row-major, the patches of a window row-major (transformers' get_vision_position_ids)."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return torch.stack([rows.reshape(shape).transpose(1, 2).flatten(),
                        cols.reshape(shape).transpose(1, 2).flatten()], dim=-1)


def window_order(grid_h: int, grid_w: int, merge: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over the merged grid (`window_units` merged rows a side): the merged
    units in window order, and each window's length in patches (transformers' get_vision_window_index)."""
    units_h, units_w = grid_h // merge, grid_w // merge
    index = torch.arange(units_h * units_w).reshape(units_h, units_w)
    pad_h, pad_w = window_units - units_h % window_units, window_units - units_w % window_units
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    windows_h, windows_w = padded.shape[0] // window_units, padded.shape[1] // window_units
    padded = padded.reshape(windows_h, window_units, windows_w, window_units).permute(0, 2, 1, 3)
    padded = padded.reshape(windows_h * windows_w, -1)
    lengths = [int(n) * merge * merge for n in (padded >= 0).sum(-1).tolist() if n]
    return padded[padded >= 0], lengths


class QwenVisionEncoder:
    """Qwen2-VL's or Qwen2.5-VL's tower and merger; `encode` takes one image as the processor
    lays it out: [grid_h, grid_w, channels * temporal * patch * patch]."""

    def __init__(self, config: VisionConfig, weights: QwenVisionWeights,
                 linear_kernel: LinearKernel | None = None, threads: int | None = None) -> None:
        self.config = config
        kernel = linear_kernel or KERNELS["aten"]
        self.weights = weights.packed_for(kernel, threads)
        self.linear = functools.partial(kernel.apply, threads=threads)
        self.head_dim = config.hidden_size // config.num_heads
        half = self.head_dim // 2  # the rows' and the columns' frequencies share each rotated half
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.gated = config.family == "qwen2_5_vl"  # its MLP: act(gate) * up
        self.activation = ACTIVATIONS[config.hidden_act]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[grid_h, grid_w, patch pixels] (rows in merge-window order) -> [grid_h * grid_w / merge**2,
        text hidden], in the order the image's placeholders appear."""
        cfg, w = self.config, self.weights
        grid_h, grid_w, width = pixel_values.shape
        merge, unit = cfg.merge_size, cfg.merge_size ** 2
        hidden = self.linear(pixel_values.reshape(-1, width).to(w.merger_norm[0].dtype), w.patch)
        cos, sin = self._rotary(patch_positions(grid_h, grid_w, merge).to(hidden.device))
        order, windows = None, None
        if cfg.window_size:
            order, windows = window_order(grid_h, grid_w, merge, cfg.window_size // merge // cfg.patch_size)
            order = order.to(hidden.device)
            hidden, cos, sin = (x.reshape(-1, unit, x.shape[-1])[order].reshape(-1, x.shape[-1])
                                for x in (hidden, cos, sin))
        for index, layer in enumerate(w.layers):
            full = not cfg.window_size or index in cfg.full_attention_layers
            hidden = hidden + self._attention(self._norm(hidden, layer.norm1), layer, cos, sin,
                                              None if full else windows)
            hidden = hidden + self._mlp(self._norm(hidden, layer.norm2), layer)
        rows = self._norm(hidden, w.merger_norm).reshape(-1, unit * cfg.hidden_size)
        (first, first_bias), (second, second_bias) = w.merger
        rows = self.linear(F.gelu(self.linear(rows, first) + first_bias), second) + second_bias
        if order is not None:
            rows = rows[torch.argsort(order)]
        return rows

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [patches, head_dim] float32: the row's phases, then the column's, twice."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [patches, 2, d/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    def _attention(self, x: torch.Tensor, layer: QwenVisionLayer, cos: torch.Tensor, sin: torch.Tensor,
                   windows: list[int] | None) -> torch.Tensor:
        """Bidirectional attention among the image's patches (`windows`: among each window's, the
        windows' lengths in order); q and k rotated in float32 as transformers'
        apply_rotary_pos_emb_vision."""
        tokens, hidden = x.shape
        qkv = self.linear(x, layer.qkv) + layer.qkv_bias
        q, k, v = qkv.view(tokens, 3, self.config.num_heads, self.head_dim).unbind(1)
        q, k = (self._rotate(t, cos, sin) for t in (q, k))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        attended = self._attend(q, k, v, windows or [tokens])
        return self.linear(attended.transpose(0, 1).reshape(tokens, hidden), layer.proj) + layer.proj_bias

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: list[int]) -> torch.Tensor:
        """[heads, tokens, d] attended within each window, consecutive windows of one length as one
        batch (a window row's full windows), so the cost is the windows' and not the image's square."""
        heads, _, dim = q.shape
        out, start = [], 0
        for length, run in itertools.groupby(windows):
            count = len(list(run))
            stop = start + count * length
            q_run, k_run, v_run = (t[:, start:stop].reshape(heads, count, length, dim).transpose(0, 1)
                                   for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q_run, k_run, v_run, scale=self.head_dim ** -0.5)
            out.append(attended.transpose(0, 1).reshape(heads, count * length, dim))
            start = stop
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        half = wide.shape[-1] // 2
        rotated = torch.cat([-wide[..., half:], wide[..., :half]], dim=-1)
        return (wide * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

    def _mlp(self, x: torch.Tensor, layer: QwenVisionLayer) -> torch.Tensor:
        up = self.linear(x, layer.up) + layer.up_bias
        if self.gated:
            gate, up = up.chunk(2, dim=-1)
            activated = self.activation(gate) * up
        else:
            activated = self.activation(up)
        return self.linear(activated, layer.down) + layer.down_bias

    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        weight, bias = norm
        eps = self.config.layer_norm_eps
        if bias is not None:
            return F.layer_norm(x, weight.shape, weight, bias, eps)
        wide = x.float()
        return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
