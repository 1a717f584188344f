"""LoRA's updates in C (nanoserve.native.lora): every adapter of a step in one pass per target
matrix gives what float64 arithmetic gives and what the torch path gives (within float
tolerance), a row's bits are the same alone and beside rows of other adapters or none at any
thread count, the portable path has the AVX2 path's bits, on ragged shapes (inputs not a
multiple of 8, odd widths, ranks 1 to 16, adapters on a subset of targets)."""

from __future__ import annotations

import pytest
import torch
from test_model import CONFIG

from nanoserve import native
from nanoserve.model.lora import AdapterRows, AdapterWeights, LoRARequest, apply, load_adapter, native_step
from nanoserve.native import lora as native_lora
from nanoserve.native.lora import NativeAdapter, NativeLoRAStep, Piece, TargetUpdate

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

K, N = 20, 37  # input width with a tail past the 8 lanes; output width odd
PIECE_COLUMNS = ((0, 13), (13, 12), (29, 8))  # (first column, width): columns 25..28 belong to no module


def target_update(generator: torch.Generator, rank: int, pieces: int = 3) -> TargetUpdate:
    """A fused target of `pieces` modules, each of rank `rank`."""
    a = torch.randn(pieces * rank, K, generator=generator)
    return TargetUpdate(a, tuple(Piece(column, i * rank, torch.randn(width, rank, generator=generator))
                                 for i, (column, width) in enumerate(PIECE_COLUMNS[:pieces])))


def adapters(seed: int = 0) -> list[tuple[NativeAdapter, dict[str, TargetUpdate]]]:
    """Ragged ranks (1, 8, 16), one adapter on two modules of qkv only, one not on qkv at all."""
    generator = torch.Generator().manual_seed(seed)
    layers = [{"qkv": target_update(generator, 1)}, {"qkv": target_update(generator, 8, pieces=2)},
              {"qkv": target_update(generator, 16)}, {"o": target_update(generator, 4, pieces=1)}]
    return [(NativeAdapter([layer]), layer) for layer in layers]


def reference(x: torch.Tensor, out: torch.Tensor, row_slot: list[int], layers: list[dict[str, TargetUpdate]]):
    """out + each row's update, in float64."""
    expected = out.double()
    for row, slot in enumerate(row_slot):
        update = layers[slot].get("qkv") if slot >= 0 else None
        if update is None:
            continue
        shrunk = update.a.double() @ x[row].double()
        for piece in update.pieces:
            width, rank = piece.b.shape
            expected[row, piece.column:piece.column + width] += piece.b.double() @ shrunk[
                piece.rank_start:piece.rank_start + rank]
    return expected


def run(row_slot: list[int], x: torch.Tensor, out: torch.Tensor, pool, *, portable: bool = False,
        threads: int | None = None):
    step = NativeLoRAStep([adapter for adapter, _ in pool], torch.tensor(row_slot, dtype=torch.int32))
    result = out.clone()
    step.apply(result, x, 0, "qkv", portable=portable, threads=threads)
    return result


ROW_SLOTS = [[0], [2], [-1, 3], [2, 2, 2, 2, 2, 1], [0, 1, 1, -1, 2, 2, 2, 2, 2, 3, 0, 0, 1]]


@pytest.mark.parametrize("row_slot", ROW_SLOTS, ids=lambda slots: f"{len(slots)}rows")
def test_each_row_gets_its_own_adapters_update_as_float64_does(row_slot):
    pool, generator = adapters(), torch.Generator().manual_seed(1)
    x = torch.randn(len(row_slot), K, generator=generator)
    out = torch.randn(len(row_slot), N, generator=generator)
    got = run(row_slot, x, out, pool)
    expected = reference(x, out, row_slot, [layer for _, layer in pool])
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    untouched = [row for row, slot in enumerate(row_slot) if slot in (-1, 3)]
    assert torch.equal(got[untouched], out[untouched])
    assert torch.equal(got[:, 25:29], out[:, 25:29])  # no module writes these columns


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_are_the_same_alone_and_beside_other_adapters(threads):
    pool, generator = adapters(), torch.Generator().manual_seed(2)
    row_slot = ROW_SLOTS[-1]
    x = torch.randn(len(row_slot), K, generator=generator)
    out = torch.randn(len(row_slot), N, generator=generator)
    crowd = run(row_slot, x, out, pool, threads=threads)
    for row, slot in enumerate(row_slot):
        alone = run([slot], x[row:row + 1], out[row:row + 1], pool, threads=threads)
        assert torch.equal(alone[0], crowd[row])


def test_the_portable_path_has_the_avx2_paths_bits():
    if not native_lora.portable_is_fused():
        pytest.skip("fmaf is not fused here: the portable chain rounds differently")
    pool, generator = adapters(), torch.Generator().manual_seed(3)
    for row_slot in ROW_SLOTS:
        x = torch.randn(len(row_slot), K, generator=generator)
        out = torch.randn(len(row_slot), N, generator=generator)
        assert torch.equal(run(row_slot, x, out, pool), run(row_slot, x, out, pool, portable=True))


def test_inputs_that_do_not_fit_the_adapter_are_refused_by_name():
    pool = adapters()
    step = NativeLoRAStep([pool[0][0]], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="qkv update of layer 0 reads 20 inputs"):
        step.apply(torch.zeros(2, N), torch.zeros(2, K + 1), 0, "qkv")
    with pytest.raises(ValueError, match="x has 3 rows"):
        step.apply(torch.zeros(2, N), torch.zeros(3, K), 0, "qkv")
    with pytest.raises(ValueError, match="out must be a contiguous"):
        step.apply(torch.zeros(N, 2).t(), torch.zeros(2, K), 0, "qkv")


def random_weights(rank: int, modules: list[str], seed: int) -> AdapterWeights:
    """An adapter on `modules` of every layer of test_model's CONFIG, A and B random."""
    generator = torch.Generator().manual_seed(seed)
    q, kv, hidden, inter = CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim, \
        CONFIG.hidden_size, CONFIG.intermediate_size
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    layers = [{module: (torch.randn(rank, shapes[module][0], generator=generator),
                        torch.randn(shapes[module][1], rank, generator=generator)) for module in modules}
              for _ in range(CONFIG.num_layers)]
    return AdapterWeights(rank, 0.5, layers)


def test_the_c_updates_are_the_torch_paths_within_float_tolerance():
    from nanoserve.model.linear import KERNELS

    kernel = KERNELS["aten-tile16"]
    specs = [(1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             (8, ["q_proj", "v_proj"]), (16, ["up_proj", "down_proj", "o_proj"])]
    loaded = {}
    for native_path in (True, False):
        loaded[native_path] = [
            load_adapter(LoRARequest(f"a{i}", i + 1, "/none"), random_weights(rank, modules, seed=i), CONFIG,
                         serial=i, pack=kernel.pack, matmul=kernel.apply, dtype=torch.float32,
                         device=torch.device("cpu"), native=native_path)
            for i, (rank, modules) in enumerate(specs)]
    rows, generator = 9, torch.Generator().manual_seed(4)
    ranges = [((0, 2), (7, 8)), ((2, 5),), ((5, 7),)]  # row 8 runs with none
    q = CONFIG.num_heads * CONFIG.head_dim
    qkv = q + 2 * CONFIG.num_kv_heads * CONFIG.head_dim
    widths = {"qkv": (CONFIG.hidden_size, qkv), "o": (q, CONFIG.hidden_size),
              "gate_up": (CONFIG.hidden_size, 2 * CONFIG.intermediate_size),
              "down": (CONFIG.intermediate_size, CONFIG.hidden_size)}
    for native_path in (True, False):
        assert (loaded[native_path][0].native is not None) is native_path
    step = native_step([AdapterRows(a, r) for a, r in zip(loaded[True], ranges, strict=True)], rows)
    groups = [AdapterRows(a, r) for a, r in zip(loaded[False], ranges, strict=True)]
    for layer in range(CONFIG.num_layers):
        for target, (width_in, width_out) in widths.items():
            x = torch.randn(rows, width_in, generator=generator)
            out = torch.randn(rows, width_out, generator=generator)
            ours, theirs = out.clone(), out.clone()
            step.apply(ours, x, layer, target)
            apply(theirs, x, groups, layer, target)
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), (layer, target)
            assert torch.equal(ours[8], out[8])


def test_a_row_slot_past_the_steps_adapters_is_refused():
    pool = adapters()
    with pytest.raises(RuntimeError, match="row_slot must lie in"):
        NativeLoRAStep([pool[0][0]], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        NativeLoRAStep([pool[0][0]], torch.tensor([0, 0]))
