"""The forward's native small ops (nanoserve/native/ops.py, csrc/stages/ops.c) against float64 torch
references, on ragged shapes, on both the vector path and the portable C path; and the
property the attention is built for: a row's bits depend on its own context only.

Tolerances: the kernels run in float32 and their exp is a polynomial of about 1 ulp, so each
is held to 2e-5 relative (1e-5 absolute) of a float64 reference, a few float32 roundings
over the reductions these shapes have.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from test_model import CONFIG, PROMPT_A, PROMPT_B, WEIGHTS, Cache, step

from nanoserve.model.batch import AttentionGroup, ForwardBatch
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache
from nanoserve.native import ops as native_ops
from nanoserve.native.ops import NativeOpsError, PagedContext

NATIVE = native_ops.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library here (no compiler, or off)")
PATHS = ["vector", "portable"]
TOLERANCE = {"rtol": 2e-5, "atol": 1e-5}


def kernels(path):
    return native_ops.load(portable=path == "portable")


def close(actual, expected):
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCE)


def reference_rms_norm(x, weight, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 7), (17, 64), (33, 100)])
def test_rms_norm_matches_a_float64_reference(path, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, weight = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    close(kernels(path).rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 13), (40, 64)])
def test_add_rms_norm_adds_in_place_exactly_and_normalizes_the_sum(path, rows, dim):
    g = torch.Generator().manual_seed(dim)
    residual, delta = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    weight = torch.randn(dim, generator=g)
    expected_sum = residual + delta
    normed = kernels(path).add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(residual, expected_sum)  # one float32 add per element, as torch's
    close(normed, reference_rms_norm(expected_sum, weight, 1e-6))


GATED = {"silu_mul": F.silu, "gelu_tanh_mul": functools.partial(F.gelu, approximate="tanh")}


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", sorted(GATED))
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (1, 2048), (3, 9), (16, 40)])
def test_gated_activations_match_a_float64_reference(path, op, rows, width):
    g = torch.Generator().manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 6
    gate, up = gate_up.double().chunk(2, dim=-1)
    close(getattr(kernels(path), op)(gate_up), GATED[op](gate) * up)


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 256), (4, 2, 16), (3, 3, 24)])
def test_head_rms_norm_norms_each_q_and_k_head_in_place_and_leaves_v(path, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g) * 3
    q_weight, k_weight = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    before = qkv.clone()
    kernels(path).head_rms_norm(qkv, q_weight, k_weight, heads, kv_heads, 1e-6)
    q, k, v = before.view(5, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    expected = torch.cat([reference_rms_norm(q, q_weight, 1e-6), reference_rms_norm(k, k_weight, 1e-6),
                          v.double()], dim=1).view(5, -1)
    close(qkv, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])


def rope_tables(positions, dim):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return (torch.cat([freqs.cos(), freqs.cos()], -1).float(),
            torch.cat([-freqs.sin(), freqs.sin()], -1).float())


def reference_rope(x, positions, cos, signed_sin):
    """x [rows, heads, d]: x*cos + rotate_half(x)*sin, in float64."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1).double()
    sin = torch.cat([-signed_sin[:, :half], signed_sin[:, half:]], -1)  # the textbook cat(sin, sin)
    return x.double() * cos[positions, None].double() + rotated * sin[positions, None].double()


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(9, 3, 64, 16), (4, 1, 20, 5), (2, 2, 128, 4)])
def test_rope_rotates_q_in_place_and_writes_rotated_k_and_v_at_their_slots_only(heads, kv_heads, dim,
                                                                                block_size):
    g = torch.Generator().manual_seed(dim)
    rows, blocks = 7, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    original = qkv.clone()
    positions = torch.tensor([0, 3, 9, 17, 2, 29, 11])
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    cos, sin = rope_tables(32, dim)
    k_cache = torch.full((kv_heads, blocks, block_size, dim), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)
    NATIVE.rope_write_kv(qkv, positions, cos, sin, slots, k_cache, v_cache, heads)

    q, k, v = original.view(rows, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)
    close(qkv[:, : heads * dim].view(rows, heads, dim), reference_rope(q, positions, cos, sin))
    assert torch.equal(qkv[:, heads * dim :], original[:, heads * dim :])  # k and v left as they were
    flat_k, flat_v = k_cache.view(kv_heads, -1, dim), v_cache.view(kv_heads, -1, dim)
    close(flat_k[:, slots].transpose(0, 1), reference_rope(k, positions, cos, sin))
    assert torch.equal(flat_v[:, slots].transpose(0, 1), v)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[:, untouched] == 7.0).all() and (flat_v[:, untouched] == 7.0).all()


def paged_setup(seqs_lens, heads, kv_heads, dim, block_size, seed=0):
    """A cache holding random K/V for sequences of the given lengths in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    tables = [-(-n // block_size) for n in seqs_lens]
    blocks = sum(tables) + 3
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(tables) + 2  # wider than any sequence needs: the padding must not be read
    block_tables, at = [], 0
    for count in tables:
        block_tables.append(order[at : at + count] + [0] * (width - count))
        at += count
    k_cache = torch.randn(kv_heads, blocks, block_size, dim, generator=g)
    v_cache = torch.randn(kv_heads, blocks, block_size, dim, generator=g)
    return torch.tensor(block_tables), k_cache, v_cache


def reference_attention(q, k_cache, v_cache, block_tables, row_seq, positions, heads, window=0):
    """float64, one row at a time over its gathered context: q [rows, heads * d]."""
    kv_heads, _, _, dim = k_cache.shape
    out = []
    for r, (seq, pos) in enumerate(zip(row_seq.tolist(), positions.tolist(), strict=True)):
        k = k_cache[:, block_tables[seq]].reshape(kv_heads, -1, dim)[:, : pos + 1].double()
        v = v_cache[:, block_tables[seq]].reshape(kv_heads, -1, dim)[:, : pos + 1].double()
        first = max(0, pos + 1 - window) if window else 0
        k, v = k[:, first:], v[:, first:]
        qr = q[r, : heads * dim].view(kv_heads, heads // kv_heads, dim).double()
        probs = torch.softmax(qr @ k.transpose(1, 2) / math.sqrt(dim), dim=-1)
        out.append((probs @ v).reshape(-1))
    return torch.stack(out)


# Context lengths shorter than, equal to and longer than one and two 64-slot chunks.
CONTEXTS = [1, 5, 63, 64, 65, 127, 128, 129, 200]


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [
    (9, 3, 64, 16),  # the default model's shape
    (4, 1, 64, 5),  # one K/V head; blocks that do not divide a chunk
    (2, 2, 20, 8),  # head_dim not a multiple of 8: the vector tail
    (6, 2, 128, 32),
])
def test_paged_attention_matches_a_float64_reference_on_ragged_contexts(path, heads, kv_heads, dim,
                                                                        block_size):
    tables, k_cache, v_cache = paged_setup(CONTEXTS, heads, kv_heads, dim, block_size)
    row_seq = torch.arange(len(CONTEXTS))
    positions = torch.tensor(CONTEXTS) - 1
    q_width = (heads + 2 * kv_heads) * dim  # a view of the qkv projection, as the model passes
    q = torch.randn(len(CONTEXTS), q_width, generator=torch.Generator().manual_seed(1))
    out = kernels(path).paged_attention(q, k_cache, v_cache, PagedContext(tables, row_seq, positions),
                                        heads, dim ** -0.5)
    close(out, reference_attention(q, k_cache, v_cache, tables, row_seq, positions, heads))


@needs_native
@pytest.mark.parametrize("window", [1, 40, 64, 100])
def test_a_sliding_window_bound_attends_over_the_last_slots_only(window):
    heads, kv_heads, dim, block_size = 4, 2, 32, 16
    tables, k_cache, v_cache = paged_setup(CONTEXTS, heads, kv_heads, dim, block_size)
    row_seq, positions = torch.arange(len(CONTEXTS)), torch.tensor(CONTEXTS) - 1
    q = torch.randn(len(CONTEXTS), heads * dim, generator=torch.Generator().manual_seed(2))
    out = NATIVE.paged_attention(q, k_cache, v_cache, PagedContext(tables, row_seq, positions), heads,
                                 dim ** -0.5, window=window)
    close(out, reference_attention(q, k_cache, v_cache, tables, row_seq, positions, heads, window))


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_a_rows_attention_bits_are_the_same_alone_in_a_prefill_chunk_and_in_a_crowd(path):
    """What prefill == decode rests on: every position of a 150-slot sequence, computed as one
    prefill chunk beside other sequences, equals the same position computed alone."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lens = [150, 70, 3]
    tables, k_cache, v_cache = paged_setup(lens, heads, kv_heads, dim, block_size)
    g = torch.Generator().manual_seed(3)
    q_seq = torch.randn(150, heads * dim, generator=g)
    others = torch.randn(2, heads * dim, generator=g)
    ops = kernels(path)
    crowd_q = torch.cat([others[:1], q_seq, others[1:]])
    crowd = PagedContext(tables, torch.tensor([1] + [0] * 150 + [2]),
                         torch.tensor([69, *range(150), 2]))
    together = ops.paged_attention(crowd_q, k_cache, v_cache, crowd, heads, 0.125)[1:151]
    for pos in (0, 63, 64, 100, 149):
        alone = PagedContext(tables[:1, : -(-(pos + 1) // block_size)].contiguous(), torch.tensor([0]),
                             torch.tensor([pos]))
        assert torch.equal(ops.paged_attention(q_seq[pos : pos + 1], k_cache, v_cache, alone, heads, 0.125),
                           together[pos : pos + 1])


@needs_native
def test_a_prefill_chunks_attention_bits_do_not_depend_on_the_thread_count():
    """Threads take (row, K/V head) units in turn; whichever thread runs a unit, its bits are
    the same, at 1, 2 and 3 threads, over a causal chunk (rows of growing context)."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    tables, k_cache, v_cache = paged_setup([150], heads, kv_heads, dim, block_size)
    q = torch.randn(150, heads * dim, generator=torch.Generator().manual_seed(4))
    chunk = PagedContext(tables, torch.zeros(150, dtype=torch.long), torch.arange(150))
    outputs = [NATIVE.paged_attention(q, k_cache, v_cache, chunk, heads, 0.125, threads=threads)
               for threads in (1, 2, 3)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_a_query_heads_bits_do_not_depend_on_the_heads_sharing_its_kv_head(path):
    """The kernel reads each K/V head once for all the query heads that share it: each head's
    output must still be the bits it has computed as the only head over that K/V head."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    tables, k_cache, v_cache = paged_setup([200, 65, 1], heads, kv_heads, dim, block_size)
    q = torch.randn(3, heads * dim, generator=torch.Generator().manual_seed(4))
    context = PagedContext(tables, torch.tensor([0, 1, 2]), torch.tensor([199, 64, 0]))
    ops = kernels(path)
    grouped = ops.paged_attention(q, k_cache, v_cache, context, heads, 0.125)
    for h in range(heads):
        kv = slice(h // (heads // kv_heads), h // (heads // kv_heads) + 1)
        alone = ops.paged_attention(q[:, h * dim : (h + 1) * dim].contiguous(), k_cache[kv].contiguous(),
                                    v_cache[kv].contiguous(), context, 1, 0.125)
        assert torch.equal(alone, grouped[:, h * dim : (h + 1) * dim]), f"head {h}"


@needs_native
def test_bad_tensors_raise_before_any_pointer_reaches_c():
    x = torch.randn(2, 8)
    with pytest.raises(NativeOpsError, match="float32"):
        NATIVE.rms_norm(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(NativeOpsError, match="contiguous"):
        NATIVE.rms_norm(x.t(), torch.ones(2), 1e-5)
    with pytest.raises(NativeOpsError, match="weight must have shape"):
        NATIVE.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(NativeOpsError, match="even width"):
        NATIVE.silu_mul(torch.randn(2, 7))
    with pytest.raises(NativeOpsError, match="positions must have shape"):
        PagedContext(torch.zeros(1, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                     torch.zeros(2, dtype=torch.long))
    cache = torch.zeros(1, 2, 4, 8)
    three_rows = PagedContext(torch.zeros(1, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                              torch.zeros(3, dtype=torch.long))
    with pytest.raises(NativeOpsError, match="describes 3 rows; q has 2"):
        NATIVE.paged_attention(torch.randn(2, 8), cache, cache, three_rows, 1, 1.0)


def test_without_the_library_there_are_no_native_ops(monkeypatch):
    monkeypatch.setattr(native_ops.native, "library", lambda: None)
    assert native_ops.load() is None


# The model with the native ops: the same forward as with the torch ops, within tolerance.
@needs_native
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_native_forward_agrees_with_the_torch_forward(batch_invariant):
    native = DecoderLM(CONFIG, WEIGHTS, batch_invariant=batch_invariant)
    plain = DecoderLM(CONFIG, WEIGHTS, batch_invariant=batch_invariant, native=False)
    assert native.ops is not None and plain.ops is None
    prefill = [("a", PROMPT_A[:-1], 0), ("b", PROMPT_B, 0)]
    decode = [("a", PROMPT_A[-1:], len(PROMPT_A) - 1), ("b", [3], len(PROMPT_B))]
    results = []
    for model in (native, plain):
        cache = Cache()
        results.append({**step(model, cache, prefill), **{f"{s} decode": x
                                                          for s, x in step(model, cache, decode).items()}})
    assert len(results[0]) == 4
    for seq, logits in results[0].items():
        torch.testing.assert_close(logits, results[1][seq], atol=1e-4, rtol=1e-4)


@needs_native
def test_the_native_forward_reads_the_cache_in_place_without_gathering_it(monkeypatch):
    def no_gather(*args, **kwargs):
        raise AssertionError("the native forward gathered the KV cache")

    monkeypatch.setattr(KVCache, "gather", no_gather)
    model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=True)
    cache = Cache()
    step(model, cache, [("a", PROMPT_A[:-1], 0)])
    step(model, cache, [("a", PROMPT_A[-1:], len(PROMPT_A) - 1)])


def test_half_precision_and_native_false_keep_the_torch_ops():
    assert DecoderLM(CONFIG, WEIGHTS.to(torch.bfloat16, torch.device("cpu"))).ops is None
    assert DecoderLM(CONFIG, WEIGHTS, native=False).ops is None


@needs_native
def test_a_batch_whose_slots_lie_outside_the_cache_is_refused_before_any_kernel_runs():
    model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=True)
    cache = Cache()
    table = torch.tensor([cache.blocks("a", 4)])
    bad = ForwardBatch(torch.tensor([1]), torch.tensor([3]), torch.tensor([10**6]),
                       [AttentionGroup(0, 1, 1, torch.tensor([[3]]), table, first_positions=(3,))],
                       torch.tensor([0]))
    with pytest.raises(RuntimeError, match="slot_mapping must lie in"):
        model.forward(bad, cache.kv)
