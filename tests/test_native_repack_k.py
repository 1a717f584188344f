"""Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS repacked at load (nanoserve.native.repack.repack_k,
csrc/gemm/matmul_kx8.c): the layout holds the file's values bit for bit, the kernel agrees with a
float64 product within the activation rounding bound (tests/test_quant.py's module doc) on
ragged shapes, its scalar reference gives the vector path's bits, and a row's bits never depend
on its neighbours, the tile it lands in or the thread count."""

from __future__ import annotations

import pytest
import torch
from test_quant import assert_within_bound, random_weight

from nanoserve import native
from nanoserve.model.linear import QUANTIZED_KERNELS, ProbeShape, self_test
from nanoserve.quant import QuantizedStack, QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"{native.status()}")

FORMATS = ("q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs")
# N odd, N below one group of 8, N a multiple of 8; K one, two, three and six super-blocks.
SHAPES = [(1, 256), (37, 512), (19, 768), (64, 1536)]
ROW_COUNTS = (*range(1, 18), 33, 130)  # every tile of 1..8 rows alone and split, past a 32-row panel


def _repack():
    from nanoserve.native import repack

    return repack


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_layout_reads_back_as_the_reference_dequantizer_gives_the_file(format_name, out_features,
                                                                       in_features):
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = _repack().repack_k(weight)
    assert isinstance(packed, _repack().KRepackedWeight)
    assert torch.equal(packed.dequantize(), weight.dequantize())


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_row_lookups_give_the_reference_dequantizers_bits(format_name, out_features, in_features):
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = _repack().repack_k(weight)
    ids = torch.arange(out_features).flip(0).reshape(1, -1)
    assert torch.equal(packed.lookup(ids), weight.dequantize()[ids])
    with pytest.raises(IndexError):
        packed.lookup(torch.tensor([out_features]))


@pytest.mark.parametrize("format_name", ["q2_k", "q6_k"])
def test_a_tied_table_in_a_k_layout_is_held_once(format_name):
    from nanoserve.model.linear import embedding
    from nanoserve.model.weights import LayerWeights, LlamaWeights
    from nanoserve.quant import serves_lookups

    table = random_weight(format_name, 24, 256)
    layer = LayerWeights(torch.ones(256), random_weight("q4_k", 16, 256), random_weight("q4_k", 256, 256),
                         torch.ones(256), random_weight("q4_k", 512, 256), random_weight("q4_k", 256, 256))
    weights = LlamaWeights(table, [layer], torch.ones(256), table)
    packed = weights.packed_for(QUANTIZED_KERNELS["native-quant-x8"])
    assert packed.embed is packed.lm_head and serves_lookups(packed.embed)
    ids = torch.tensor([[5, 23], [0, 5]])
    assert torch.equal(embedding(ids, packed.embed), table.dequantize()[ids])


@pytest.mark.parametrize("format_name", FORMATS)
def test_layout_is_the_files_bytes_up_to_padding_and_q4_k_unpacked_scales(format_name):
    weight = random_weight(format_name, 37, 512)
    # Q4_K's and Q5_K's 12 bytes of packed 6-bit scales and mins are 16 bytes unpacked, Q3_K's
    # 12 bytes of 6-bit scales 16 (resident 114 / 110 of the file's bytes), IQ4_XS's 6 bytes 8;
    # Q6_K's 6-bit codes a byte each (274: 256 code bytes, 16 scales, d)
    per_super_block = {"q4_k": 148, "q5_k": 180, "q6_k": 274, "q2_k": 84, "q3_k": 114,
                       "iq4_xs": 138}[format_name]
    assert _repack().repack_k(weight).nbytes == 40 * 2 * per_super_block


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_agrees_with_float64_and_a_row_alone_has_its_bits_in_any_chunk(format_name, out_features,
                                                                            in_features):
    repack = _repack()
    weight = random_weight(format_name, out_features, in_features, seed=out_features)
    packed = repack.repack_k(weight)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(in_features))
    alone = torch.cat([repack.matmul_k(x[r : r + 1], packed) for r in range(x.shape[0])])
    assert torch.equal(alone, torch.cat([repack.matmul_k(x[r : r + 1], packed, portable=True)
                                         for r in range(x.shape[0])]))
    for rows in ROW_COUNTS:
        y = repack.matmul_k(x[:rows], packed)
        assert_within_bound(y, x[:rows], weight)
        assert torch.equal(y, alone[:rows]), f"{rows} rows"
        assert torch.equal(y, repack.matmul_k(x[:rows], packed, portable=True)), f"{rows} rows, portable"


# (format, the byte ranges and values that put every code and scale at an extreme)
EXTREMES = [
    ("q6_k", [(slice(0, 192), 0x00), (slice(192, 208), 0x80)]),  # codes at -32, scales at -128
    ("q4_k", [(slice(16, 144), 0xFF), (slice(4, 16), 0xFF)]),  # codes at 15, 6-bit scales and mins at 63
    ("q5_k", [(slice(16, 176), 0xFF), (slice(4, 16), 0xFF)]),  # codes at 31, 6-bit scales and mins at 63
    ("q2_k", [(slice(16, 80), 0xFF), (slice(0, 16), 0xFF)]),  # codes at 3, 4-bit scales and mins at 15
    ("q3_k", [(slice(0, 96), 0x00), (slice(96, 108), 0x00)]),  # codes at -4, 6-bit scales at 0 - 32
    ("q3_k", [(slice(0, 96), 0xFF), (slice(96, 108), 0xFF)]),  # codes at 3 (q + 4 at 7), scales at 31
    # codes at the grid's -127 (each maddubs pair at 32258), 6-bit scales at 0 - 32
    ("iq4_xs", [(slice(2, 136), 0x00)]),
]


@pytest.mark.parametrize(("format_name", "extremes"), EXTREMES)
def test_extreme_codes_and_scales_stay_exact(format_name, extremes):
    """Every code and scale at an extreme against activations at +-127 fills the int16 sums
    (or the integers the floats are made from) to their bound: the vector path must still give
    the scalar reference's bits."""
    repack = _repack()
    x = torch.full((5, 512), 1.0)  # every activation code at +127, then at -127
    x[3:] = -1.0
    weight = random_weight(format_name, 9, 512)
    blocks = weight.blocks.reshape(-1, weight.format.bytes).clone()
    for byte_range, value in extremes:
        blocks[:, byte_range] = value
    extreme = QuantizedWeight(weight.format, weight.shape, blocks.reshape(9, -1))
    packed = repack.repack_k(extreme)
    y = repack.matmul_k(x, packed)
    assert torch.equal(y, repack.matmul_k(x, packed, portable=True))
    assert_within_bound(y, x, extreme)


def test_kernel_bits_do_not_depend_on_the_thread_count():
    repack = _repack()
    packed = repack.repack_k(random_weight("q4_k", 203, 768))
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(3))
    for rows in (3, 40):
        one = repack.matmul_k(x[:rows], packed, threads=1)
        assert torch.equal(repack.matmul_k(x[:rows], packed, threads=2), one), f"{rows} rows"


def test_formats_without_a_k_layout_stay_in_the_files_layout():
    for format_name in ("f16", "q4_1"):
        weight = random_weight(format_name, 8, 256)
        assert _repack().repack_k(weight) is weight


@pytest.mark.parametrize("kernel_name", ["native-quant-x8", "native-quant-gemm"])
def test_repacking_kernels_run_k_quants_in_their_layout_and_pass_the_self_test(kernel_name):
    kernel = QUANTIZED_KERNELS[kernel_name]
    stack = QuantizedStack((random_weight("q4_k", 12, 512, seed=1), random_weight("q6_k", 9, 512, seed=2),
                            random_weight("q4_1", 8, 512, seed=3), random_weight("q2_k", 11, 512, seed=8),
                            random_weight("q3_k", 5, 512, seed=9), random_weight("q5_k", 3, 512, seed=10)))
    packed = kernel.pack(stack)
    repack = _repack()
    layouts = [repack.KRepackedWeight] * 2 + [repack.RepackedWeight] + [repack.KRepackedWeight] * 3
    assert [type(p) for p in packed.parts] == layouts
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(4))
    y = kernel.apply(x, packed)
    columns = (slice(0, 12), slice(12, 21), slice(21, 29), slice(29, 40), slice(40, 45), slice(45, 48))
    for part, part_columns in zip(stack.parts, columns, strict=True):
        assert_within_bound(y[:, part_columns], x, part)
    layer = [random_weight("q2_k", 40, 512, seed=5), random_weight("q3_k", 33, 512, seed=6), stack]
    shape = ProbeShape([layer], random_weight("q6_k", 17, 512, seed=7))
    assert self_test(kernel, shape, max_rows=18, prefill_rows=70) == ""


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"])
def test_a_k_quant_gguf_runs_in_the_layout_and_a_request_alone_equals_it_in_a_crowd(type_name, tmp_path):
    from families import crowd_logits, load_model, prefill_logits
    from gguf import GGMLQuantizationType
    from tiny_model import write_tiny_gguf, write_tiny_llama

    from nanoserve.loading.weights import load_weights
    from nanoserve.model.decoder import DecoderLM

    model_dir = write_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=512, num_heads=4,
                                 num_kv_heads=2)
    path = write_tiny_gguf(tmp_path / "wide.gguf", model_dir, matrix_type=GGMLQuantizationType[type_name])
    config, weights = load_weights(model_dir, dtype=torch.float32, device=torch.device("cpu"), gguf=path)
    model = DecoderLM(config, weights, batch_invariant=True,
                      linear_kernel=QUANTIZED_KERNELS["native-quant-x8"])
    assert isinstance(model.weights.layers[0].down, _repack().KRepackedWeight)
    lengths = (13, 21, 20)  # c arrives in chunks of 10 (families.crowd_logits)
    prompts = [[(7 * i + 3 * seq) % config.vocab_size for i in range(n)] for seq, n in enumerate(lengths)]
    alone, crowd = crowd_logits(model, prompts, crowd=False), crowd_logits(model, prompts, crowd=True)
    assert all(torch.equal(a, c) for a, c in zip(alone, crowd, strict=True))
    assert torch.equal(prefill_logits(model, prompts[1], chunk=5), prefill_logits(model, prompts[1]))
    exact = prefill_logits(load_model(model_dir, gguf=path), prompts[1])
    ours = prefill_logits(model, prompts[1])
    # Activations rounded to 8 bits per block of 32 move the logits by a percent or so.
    assert float((ours - exact).abs().max()) <= 0.05 * float(exact.abs().max())
