"""Shard arithmetic: which rows and columns of every checkpoint tensor rank r of N holds.

As Megatron splits a layer: q/k/v and gate/up by output (whole heads; K/V heads split when N
divides them, else each rank keeps the one K/V head its query heads read, which needs N to be a
multiple of them), o and down by input for float weights (their partial outputs summed by one
all-reduce each) and by output for GGUF blocks (the input gathered, then each rank's outputs:
N ranks give one rank's bits; `splits_by_output` says why), the embedding and the head by
vocabulary (ceil(V / N) rows a rank, the last padded with zero
rows). A mixture of experts splits every expert (and the shared expert) as the dense MLP:
gate/up by its intermediate dimension, so each rank runs every expert on its slice, and down
as the dense down (by input: one all-reduce of the partial sums a layer; by output for GGUF
blocks: every expert's slices gathered once, then each rank's output columns whole); the
router and the shared expert's gate are replicated, so every rank routes every row alike.
Everything else (norms, o/down biases, q/k norms) is replicated. `local_config` is the model one
rank runs: the same forward on fewer heads, a slice of the MLP and of the vocabulary.

Pure arithmetic over tensors and GGUF blocks, no process groups: the loaders import it to
read only a rank's part of each tensor.
Refuses: GGUF blocks split by input where a rank's share is not a whole number of blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.config import ModelConfig
from nanoserve.errors import InvalidRequestError
from nanoserve.quant import QuantizedWeight

OPTION = "tensor_parallel_size"
# The matrices `Shard.by_output` splits by output: attention's o and every down projection (the
# dense MLP's, each expert's, Mixtral's w2, the shared expert's).
SPLIT_BY_OUTPUT = ("self_attn.o_proj.weight", "down_proj.weight", ".w2.weight")


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world: int
    # o and down split by output rather than by input (`splits_by_output` says when).
    by_output: bool = False

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first id, ids held, rows every rank holds): ceil(V / N) rows a rank, padded."""
        per_rank = -(-vocab_size // self.world)
        start = min(vocab_size, self.rank * per_rank)
        return start, min(vocab_size, start + per_rank) - start, per_rank


def splits_by_output(gguf: str | Path | None, quantize: str | None) -> bool:
    """Whether o and down are split by output: when the matrices run on GGUF blocks (a GGUF file's
    own, or --quantize). Their kernels quantize each activation row to 8-bit blocks, and that
    rounding turns a last-bit change into a whole step of the code, which the next layers grow:
    summing the ranks' partial products of a matrix split by input (one rounding per rank, then
    the sum) is a last-bit change, and a Q4_1 model's text left N = 1's within ten tokens. Split
    by output, every rank computes its outputs whole from the gathered input, with N = 1's
    instructions: N ranks give one rank's bits. Float weights keep Megatron's split by input
    (one all-reduce a matrix rather than two all-gathers; its sums differ in the last bits)."""
    return gguf is not None or quantize is not None


def check_shardable(config: ModelConfig, world: int, by_output: bool = False) -> None:
    """The split `local_config` (and `by_output`) makes exists for this model, else an error
    naming the option."""
    if world < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be at least 1; got {world}", param=OPTION)
    heads, kv_heads, ffn = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % world:
        raise InvalidRequestError(f"tensor_parallel_size {world} does not divide the model's {heads} "
                                  "attention heads", param=OPTION)
    if kv_heads % world and world % kv_heads:
        raise InvalidRequestError(f"tensor_parallel_size {world} neither divides the model's {kv_heads} "
                                  "key/value heads nor is a multiple of them", param=OPTION)
    experts = config.experts
    widths = [("MLP width", ffn)] + ([("experts' width", experts.intermediate_size),
                                       ("shared expert's width", experts.shared_intermediate_size)]
                                      if experts is not None else [])
    for what, width in widths:
        if width % world:
            raise InvalidRequestError(f"tensor_parallel_size {world} does not divide the model's {what} "
                                      f"{width}", param=OPTION)
    if by_output and config.hidden_size % world:
        raise InvalidRequestError(f"tensor_parallel_size {world} does not divide the model's hidden size "
                                  f"{config.hidden_size} (quantized weights split o and down by output)",
                                  param=OPTION)


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The model one rank runs: its heads, its K/V heads, its MLP slice, its vocabulary rows."""
    if world == 1:
        return config
    experts = config.experts
    if experts is not None:
        experts = dataclasses.replace(experts, intermediate_size=experts.intermediate_size // world,
                                      shared_intermediate_size=experts.shared_intermediate_size // world)
    return dataclasses.replace(config, experts=experts, num_heads=config.num_heads // world,
                               num_kv_heads=max(1, config.num_kv_heads // world),
                               intermediate_size=config.intermediate_size // world,
                               vocab_size=Shard(0, world).vocab_rows(config.vocab_size)[2])


Ranges = list[tuple[int, int]]


def tensor_split(name: str, config: ModelConfig, shard: Shard) -> tuple[int, Ranges] | None:
    """(dim, [(start, stop)...]) of the HF tensor `name` that `shard` holds; None: replicated.
    Several ranges are concatenated (Phi-3's fused qkv and gate_up)."""
    d, world, r = config.head_dim, shard.world, shard.rank
    q_rows = config.num_heads // world * d
    q = (r * q_rows, (r + 1) * q_rows)
    if config.num_kv_heads % world == 0:
        kv_rows = config.num_kv_heads // world * d
        kv = (r * kv_rows, (r + 1) * kv_rows)
    else:  # world is a multiple of the K/V heads: the one head this rank's queries read
        head = r * config.num_kv_heads // world
        kv = (head * d, (head + 1) * d)
    ffn = mlp_width(name, config) // world
    mlp = (r * ffn, (r + 1) * ffn)
    hidden = config.hidden_size // world
    kind, last = name.split(".")[-2], name.split(".")[-1]
    if shard.by_output and name.endswith(SPLIT_BY_OUTPUT):
        return 0, [(r * hidden, (r + 1) * hidden)]
    if kind == "q_proj":
        return 0, [q]
    if kind in ("k_proj", "v_proj"):
        return 0, [kv]
    if kind == "qkv_proj":
        k0, v0 = config.num_heads * d, (config.num_heads + config.num_kv_heads) * d
        return 0, [q, (k0 + kv[0], k0 + kv[1]), (v0 + kv[0], v0 + kv[1])]
    if kind in ("gate_proj", "up_proj", "w1", "w3"):  # w1, w3: Mixtral's expert gate and up
        return 0, [mlp]
    if kind == "gate_up_proj":
        return 0, [mlp, (config.intermediate_size + mlp[0], config.intermediate_size + mlp[1])]
    if kind == "o_proj" and last == "weight":
        return 1, [q]
    if kind in ("down_proj", "w2") and last == "weight":
        return 1, [mlp]
    if kind in ("embed_tokens", "lm_head"):
        start, count, _ = shard.vocab_rows(config.vocab_size)
        return 0, [(start, start + count)]
    return None


def mlp_width(name: str, config: ModelConfig) -> int:
    """The intermediate width of the MLP tensor `name` belongs to: an expert's, the shared
    expert's, or the dense MLP's."""
    if config.experts is not None and ".experts." in name:
        return config.experts.intermediate_size
    if config.experts is not None and ".shared_expert." in name:
        return config.experts.shared_intermediate_size
    return config.intermediate_size


def take(weight: torch.Tensor | QuantizedWeight, dim: int, ranges: Ranges, name: str = "tensor"
         ) -> torch.Tensor | QuantizedWeight:
    """The `ranges` of `weight` along `dim`, concatenated; GGUF blocks split by rows (whole rows
    of blocks), or by columns at whole blocks only."""
    if isinstance(weight, torch.Tensor):
        return torch.cat([weight.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()
    fmt, (rows, cols) = weight.format, weight.shape
    if dim == 0:
        blocks = torch.cat([weight.blocks[a:b] for a, b in ranges])
        return QuantizedWeight(fmt, (blocks.shape[0], cols), blocks.contiguous())
    if any(a % fmt.values or b % fmt.values for a, b in ranges):
        raise InvalidRequestError(
            f"{name}: {fmt.name} blocks hold {fmt.values} values, and a rank's {ranges[0][1] - ranges[0][0]} "
            f"inputs of {cols} are not whole blocks; choose a tensor_parallel_size that splits them so",
            param=OPTION)
    per = fmt.bytes
    blocks = torch.cat([weight.blocks[:, a // fmt.values * per: b // fmt.values * per] for a, b in ranges],
                       dim=1)
    return QuantizedWeight(fmt, (rows, sum(b - a for a, b in ranges)), blocks.contiguous())


def pad_rows(weight: torch.Tensor | QuantizedWeight, rows: int) -> torch.Tensor | QuantizedWeight:
    """`weight` with zero rows added up to `rows` (the last rank's vocabulary; zero bytes are a
    zero in every block format)."""
    missing = rows - weight.shape[0]
    if missing <= 0:
        return weight
    if isinstance(weight, torch.Tensor):
        return F.pad(weight, (0, 0, 0, missing))
    blocks = F.pad(weight.blocks, (0, 0, 0, missing))
    return QuantizedWeight(weight.format, (rows, weight.shape[1]), blocks)


def shard_tensor(name: str, read: Callable[[int | None, Ranges], torch.Tensor | QuantizedWeight],
                 config: ModelConfig, shard: Shard) -> torch.Tensor | QuantizedWeight:
    """Rank `shard`'s part of tensor `name`: `read(dim, ranges)` reads those ranges (dim None:
    the whole tensor), so a lazy reader never touches the rest."""
    split = tensor_split(name, config, shard)
    if split is None:
        return read(None, [])
    weight = read(*split)
    if split[1] and name.split(".")[-2] in ("embed_tokens", "lm_head"):
        weight = pad_rows(weight, shard.vocab_rows(config.vocab_size)[2])
    return weight


def shard_of(config: ModelConfig, shard: Shard) -> Callable[[str, torch.Tensor | QuantizedWeight],
                                                          torch.Tensor | QuantizedWeight]:
    """Cut a tensor already in memory to `shard` (GGUF files: loading.gguf reads each tensor's
    blocks whole, and keeps this part of it)."""
    def keep(name: str, whole: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        def read(dim: int | None, ranges: Ranges) -> torch.Tensor | QuantizedWeight:
            return whole if dim is None else take(whole, dim, ranges, name)
        return shard_tensor(name, read, config, shard)
    return keep
