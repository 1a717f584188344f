"""The tiled attention (nanoserve/native/attention.py, csrc/stages/attention.c) over every cache dtype
it reads: each vector path this CPU runs against the portable C reference bit for bit; every
path against a float64 reference of the numbers the cache holds; and what it is built for, a
row's bits depending on its own context only (alone == in a crowd == in a prefill chunk, at 1-3
threads), over contexts of several partitions (csrc/nanoserve.h's NS_ATTN_PARTITION).

Tolerance against float64: float32 arithmetic with a polynomial exp of about 1 ulp, 2e-5
relative (1e-5 absolute), as tests/test_native_ops.py holds the same kernel.
"""

import math

import pytest
import torch
from test_native_ops import paged_setup

from nanoserve.model.kv_cache import dequantize_q8, quantize_q8
from nanoserve.native import library
from nanoserve.native.attention import ISAS, NativeAttention, NativeOpsError

LIB = library()
needs_native = pytest.mark.skipif(LIB is None, reason="no native library here (no compiler, or off)")
AVAILABLE = [] if LIB is None else NativeAttention(LIB.lib).isas()
VECTOR_PATHS = [name for name in ("avx2", "avx512") if name in AVAILABLE]
DTYPES = ["float32", "float16", "bfloat16", "q8_0"]
PARTITION = 256  # csrc/nanoserve.h's NS_ATTN_PARTITION
# One slot, one tile, a partition and a bit, several partitions (block sizes that do not divide them).
CONTEXTS = [1, 64, 255, 256, 257, 300, 700]


def attention(path: str) -> NativeAttention:
    return NativeAttention(LIB.lib, ISAS[path] if path != "best" else 0)


def stored(k, v, dtype):
    """The cache as `dtype` stores it: (k, v, k_scales, v_scales), and the float32 numbers it holds."""
    if dtype == "q8_0":
        (k_codes, k_scales), (v_codes, v_scales) = quantize_q8(k), quantize_q8(v)
        return (k_codes, v_codes, k_scales, v_scales), (dequantize_q8(k_codes, k_scales),
                                                         dequantize_q8(v_codes, v_scales))
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    return (k, v, None, None), (k.float(), v.float())


def reference(q, k, v, tables, row_seq, positions, heads, scale, window=0, softcap=0.0, ends=None):
    """float64, one row at a time over its gathered context: q [rows, >= heads * d]; row r sees
    up to ends[r] (default: its position), from its position's window on."""
    kv_heads, _, _, dim = k.shape
    out = []
    ends = positions if ends is None else ends
    rows = zip(row_seq.tolist(), positions.tolist(), ends.tolist(), strict=True)
    for r, (seq, pos, end) in enumerate(rows):
        first = max(0, pos + 1 - window) if window else 0
        keys = k[:, tables[seq]].reshape(kv_heads, -1, dim)[:, first : end + 1].double()
        values = v[:, tables[seq]].reshape(kv_heads, -1, dim)[:, first : end + 1].double()
        qr = q[r, : heads * dim].view(kv_heads, heads // kv_heads, dim).double()
        scores = qr @ keys.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out.append((torch.softmax(scores, dim=-1) @ values).reshape(-1))
    return torch.stack(out)


def decode_rows(contexts, heads, kv_heads, dim, block_size, seed=0):
    tables, k, v = paged_setup(contexts, heads, kv_heads, dim, block_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim, generator=g)
    return q, tables, k, v, torch.arange(len(contexts)), torch.tensor(contexts) - 1


@needs_native
@pytest.mark.parametrize("path", VECTOR_PATHS or [pytest.param("avx2", marks=pytest.mark.skip(
    reason="this CPU runs no vector path"))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "window", "softcap"), [
    (9, 3, 64, 16, 0, 0.0),  # the default model's shape
    (4, 1, 128, 5, 0, 0.0),  # one K/V head; blocks that divide neither tiles nor partitions
    (8, 4, 256, 16, 100, 50.0),  # Gemma 2's head_dim, a sliding window and soft-capping
    (2, 2, 16, 32, 300, 0.0),  # a window wider than a partition
])
def test_each_vector_path_equals_the_portable_reference_bit_for_bit(path, dtype, heads, kv_heads, dim,
                                                                   block_size, window, softcap):
    q, tables, k, v, row_seq, positions = decode_rows(CONTEXTS, heads, kv_heads, dim, block_size)
    (k, v, k_scales, v_scales), _ = stored(k, v, dtype)
    runs = [attention(name)(q, k, v, tables, row_seq, positions, heads, dim ** -0.5, window=window,
                            softcap=softcap, k_scales=k_scales, v_scales=v_scales)
            for name in ("portable", path)]
    assert torch.equal(runs[0], runs[1])


@needs_native
@pytest.mark.parametrize("path", VECTOR_PATHS or [pytest.param("avx2", marks=pytest.mark.skip(
    reason="this CPU runs no vector path"))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap"), [
    (9, 3, 64, 0, 0.0),  # the default model's shape: a row's three heads share each K/V row
    (8, 1, 32, 0, 0.0),  # eight heads a K/V head: runs of three, three and two
    (8, 4, 256, 100, 50.0),  # pairs of heads, a window and soft-capping
])
def test_prompt_chunk_rows_on_each_vector_path_equal_the_portable_reference_bit_for_bit(
        path, dtype, heads, kv_heads, dim, window, softcap):
    """A prompt chunk's rows (each seeing its own prefix of the context: heads sharing a range,
    neighbours not) beside a decode row of another sequence, on the path's grouped kernels."""
    block_size, length = 16, 300
    tables, k, v = paged_setup([length, 40], heads, kv_heads, dim, block_size, seed=9)
    (k, v, k_scales, v_scales), _ = stored(k, v, dtype)
    g = torch.Generator().manual_seed(10)
    q = torch.randn(length - 200 + 1, heads * dim, generator=g)
    row_seq = torch.tensor([0] * (length - 200) + [1])
    positions = torch.tensor([*range(200, length), 39])
    runs = [attention(name)(q, k, v, tables, row_seq, positions, heads, dim ** -0.5, window=window,
                            softcap=softcap, k_scales=k_scales, v_scales=v_scales)
            for name in ("portable", path)]
    assert torch.equal(runs[0], runs[1])


@needs_native
@pytest.mark.parametrize("path", ["portable", "best"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size", "window", "softcap"), [
    (9, 3, 64, 16, 0, 0.0),
    (6, 2, 24, 8, 0, 0.0),  # head_dim not whole 16-lane chunks: the zero-padded reference
    (4, 2, 32, 16, 300, 30.0),
])
def test_the_attention_matches_a_float64_reference_of_the_numbers_the_cache_holds(
        path, dtype, heads, kv_heads, dim, block_size, window, softcap):
    q, tables, k, v, row_seq, positions = decode_rows(CONTEXTS, heads, kv_heads, dim, block_size, seed=3)
    (k, v, k_scales, v_scales), (k_held, v_held) = stored(k, v, dtype)
    out = attention(path)(q, k, v, tables, row_seq, positions, heads, dim ** -0.5, window=window,
                          softcap=softcap, k_scales=k_scales, v_scales=v_scales)
    expected = reference(q, k_held, v_held, tables, row_seq, positions, heads, dim ** -0.5, window, softcap)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=1e-5)


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_rows_bits_are_the_same_alone_in_a_crowd_in_a_prefill_chunk_and_at_1_to_3_threads(dtype):
    """Every position of a 600-slot sequence (three partitions) computed as one prefill chunk
    beside two decode rows of other sequences, at 1, 2 and 3 threads, equals the same position
    computed alone as a decode row on one thread: what crowd == solo and prefill == decode
    (preemption by recompute) rest on."""
    heads, kv_heads, dim, block_size, length = 9, 3, 64, 16, 600
    tables, k, v = paged_setup([length, 300, 3], heads, kv_heads, dim, block_size, seed=5)
    (k, v, _, _), _ = stored(k, v, dtype)
    g = torch.Generator().manual_seed(6)
    q_seq, others = torch.randn(length, heads * dim, generator=g), torch.randn(2, heads * dim, generator=g)
    crowd_q = torch.cat([others[:1], q_seq, others[1:]])
    crowd_seq = torch.tensor([1] + [0] * length + [2])
    crowd_positions = torch.tensor([299, *range(length), 2])
    kernel = attention("best")
    def crowd():
        return kernel(crowd_q, k, v, tables, crowd_seq, crowd_positions, heads, 0.125)

    crowds = [_with_threads(t, crowd) for t in (1, 2, 3)]
    assert torch.equal(crowds[0], crowds[1]) and torch.equal(crowds[0], crowds[2])
    for pos in (0, 63, 255, 256, 511, 599):
        table = tables[:1, : -(-(pos + 1) // block_size)].contiguous()
        alone = _with_threads(1, lambda pos=pos, table=table: kernel(
            q_seq[pos : pos + 1], k, v, table, torch.tensor([0]), torch.tensor([pos]), heads, 0.125))
        assert torch.equal(alone, crowds[0][1 + pos : 2 + pos]), f"position {pos}"


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "q8_0"])
@pytest.mark.parametrize("window", [0, 100])
def test_rows_inside_a_bidirectional_image_see_its_whole_run_on_every_path(dtype, window):
    """A 600-slot prompt chunk whose image rows [250, 520) see up to slot 519 (Gemma 3), beside a
    decode row: every vector path equals the portable reference bit for bit, the float64
    reference of the same visibility holds, and an image row computed alone (a one-row unit of
    several partitions, as the block split can leave one) has the chunk's bits."""
    heads, kv_heads, dim, block_size, length, image = 8, 2, 32, 16, 600, range(250, 520)
    tables, k, v = paged_setup([length, 300], heads, kv_heads, dim, block_size, seed=7)
    (k, v, k_scales, v_scales), (k_held, v_held) = stored(k, v, dtype)
    q = torch.randn(length + 1, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(8))
    row_seq, positions = torch.tensor([1] + [0] * length), torch.tensor([299, *range(length)])
    ends = torch.tensor([299, *(image[-1] if p in image else p for p in range(length))])
    def run(path, rows=slice(None)):
        return attention(path)(q[rows], k, v, tables, row_seq[rows], positions[rows], heads, dim ** -0.5,
                               window=window, k_scales=k_scales, v_scales=v_scales,
                               visible_ends=ends[rows].contiguous())

    portable = run("portable")
    for path in VECTOR_PATHS:
        assert torch.equal(run(path), portable), path
    expected = reference(q, k_held, v_held, tables, row_seq, positions, heads, dim ** -0.5, window, ends=ends)
    torch.testing.assert_close(portable.double(), expected, rtol=2e-5, atol=1e-5)
    for pos in (image[0], 300, image[-1]):
        assert torch.equal(run("best", slice(pos + 1, pos + 2)), run("best")[pos + 1 : pos + 2]), pos
    causal = attention("portable")(q, k, v, tables, row_seq, positions, heads, dim ** -0.5, window=window,
                                   k_scales=k_scales, v_scales=v_scales)
    assert not torch.equal(causal[1 + image[0]], portable[1 + image[0]])


@needs_native
def test_a_long_decode_rows_bits_do_not_depend_on_the_thread_count():
    """One row over eight partitions: its (K/V head, partition) units spread over the threads
    and merge in partition order, whoever computed them."""
    q, tables, k, v, row_seq, positions = decode_rows([2000], 9, 3, 64, 16, seed=7)
    kernel = attention("best")
    outs = [_with_threads(t, lambda: kernel(q, k, v, tables, row_seq, positions, 9, 0.125))
            for t in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
def test_bad_caches_and_paths_are_refused_before_any_pointer_reaches_c():
    q, tables, k, v, row_seq, positions = decode_rows([5], 2, 1, 16, 8)
    kernel = attention("portable")
    with pytest.raises(NativeOpsError, match="float32, float16, bfloat16 or q8_0"):
        kernel(q, k.double(), v.double(), tables, row_seq, positions, 2, 0.25)
    with pytest.raises(NativeOpsError, match="v_cache"):
        kernel(q, k.half(), v, tables, row_seq, positions, 2, 0.25)
    with pytest.raises(NativeOpsError, match="takes no scales"):
        kernel(q, k.half(), v.half(), tables, row_seq, positions, 2, 0.25, k_scales=k[..., 0],
               v_scales=v[..., 0])
    with pytest.raises(NativeOpsError, match="positions must have shape"):
        kernel(q, k, v, tables, row_seq, positions[:0], 2, 0.25)
    missing = [bit for bit in ISAS.values() if bit not in [ISAS[name] for name in AVAILABLE]]
    for bit in missing:
        with pytest.raises(NativeOpsError, match="does not run"):
            NativeAttention(LIB.lib, bit)


def test_the_partition_the_tests_cut_across_is_the_kernels():
    """CONTEXTS above straddle partitions only if PARTITION is csrc's NS_ATTN_PARTITION."""
    header = (pytest.importorskip("nanoserve.native.build").SOURCE_DIR / "nanoserve.h").read_text()
    assert f"#define NS_ATTN_PARTITION {PARTITION}" in header
    assert math.ceil(max(CONTEXTS) / PARTITION) >= 3
