"""The forward pass: equal to a plain dense causal forward, and batch-invariant when asked.

These build a small random Llama in memory (no tokenizer needed) and drive `DecoderLM.forward`
directly with hand-made batches, so each property is pinned at the model's own boundary.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from families import Cache as PagedCache
from families import step

from nanoserve.config import ModelConfig
from nanoserve.loading.hf_names import weights_from_hf
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.linear import KERNELS, LinearKernel, kernels_for, self_test
from nanoserve.model.rope import rope_inv_freq
from nanoserve.native import ops as native_ops

CONFIG = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True)


def random_weights(config=CONFIG, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
              "mlp.down_proj": (h, i)}
    tensors = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=g) * 0.5,
               "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for name, shape in shapes.items():
            tensors[f"{prefix}{name}.weight"] = torch.randn(*shape, generator=g) * 0.1
        tensors[prefix + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        tensors[prefix + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return weights_from_hf(config, tensors)


WEIGHTS = random_weights()


def dense_forward(token_ids):
    """An independent textbook forward: full causal attention, K/V heads repeated, no cache."""
    x = WEIGHTS.embed[torch.tensor(token_ids)]
    n = len(token_ids)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), rope_inv_freq(CONFIG))
    cos, sin = torch.cat([angles, angles], -1).cos().float(), torch.cat([angles, angles], -1).sin().float()

    def norm(t, w):
        return w * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps))

    def rope(t):
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos[:, None] + rotated * sin[:, None]

    heads, kv_heads, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    for layer in WEIGHTS.layers:
        q, k, v = (norm(x, layer.input_norm) @ layer.qkv.T).split([heads * d, kv_heads * d, kv_heads * d], -1)
        q, k = rope(q.view(n, heads, d)), rope(k.view(n, kv_heads, d))
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.view(n, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        x = x + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ layer.o.T
        gate, up = (norm(x, layer.post_norm) @ layer.gate_up.T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ layer.down.T
    return norm(x, WEIGHTS.norm) @ WEIGHTS.lm_head.T


class Cache(PagedCache):
    """families.py's paged cache and block allocator, sized for CONFIG."""

    def __init__(self):
        super().__init__(CONFIG, 128)


def invariant_kernels() -> list[str]:
    """The kernels whose self-test passes on this model's shapes: the engine may choose any of them."""
    shape = WEIGHTS.probe_shape()
    return [k.name for k in kernels_for(torch.device("cpu"))
            if not self_test(k, shape, max_rows=18, prefill_rows=64)]


INVARIANT_KERNELS = invariant_kernels()
# Every property below holds with the native small ops and with the torch ones.
NATIVE = [pytest.param(True, id="native-ops"), pytest.param(False, id="torch-ops")]
if native_ops.load() is None:
    NATIVE = [pytest.param(True, id="native-ops", marks=pytest.mark.skip(reason="no native library here")),
              NATIVE[1]]


def invariant_model(kernel_name, native):
    return DecoderLM(CONFIG, WEIGHTS, batch_invariant=True, linear_kernel=KERNELS[kernel_name], native=native)


PROMPT_A = [(7 * i + 3) % 300 for i in range(13)]
PROMPT_B = [(11 * i + 5) % 300 for i in range(37)]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_prefill_and_decode_match_a_dense_causal_forward(batch_invariant, native):
    model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=batch_invariant, native=native)
    cache = Cache()
    prefill = step(model, cache, [("a", PROMPT_A[:-1], 0)])
    torch.testing.assert_close(prefill["a"], dense_forward(PROMPT_A[:-1])[-1], atol=1e-4, rtol=1e-4)
    decode = step(model, cache, [("a", PROMPT_A[-1:], len(PROMPT_A) - 1)])
    torch.testing.assert_close(decode["a"], dense_forward(PROMPT_A)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kernel", INVARIANT_KERNELS)
def test_batch_invariant_rows_are_bit_identical_alone_and_in_any_batch(kernel, native):
    model = invariant_model(kernel, native)
    alone = step(model, Cache(), [("a", PROMPT_A, 0)])["a"]
    for others in (1, 3, 17):
        cache = Cache()
        crowd = [(f"n{i}", PROMPT_B[: 5 + 2 * i], 0) for i in range(others)]
        crowd.insert(others // 2, ("a", PROMPT_A, 0))
        assert torch.equal(step(model, cache, crowd)["a"], alone)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kernel", INVARIANT_KERNELS)
def test_batch_invariant_decode_equals_prefill_recompute_bit_for_bit(kernel, native):
    """What preemption by recompute relies on: K/V from decode steps equal a re-prefill."""
    model = invariant_model(kernel, native)
    incremental, neighbours = Cache(), [("b", PROMPT_B, 0)]
    step(model, incremental, [("a", PROMPT_A[:5], 0), *neighbours])
    for p in range(5, len(PROMPT_A)):  # decode the rest one token at a time beside a neighbour
        logits = step(model, incremental, [("a", PROMPT_A[p:p + 1], p), ("b", [p], len(PROMPT_B) + p - 5)])
    recomputed = step(model, Cache(), [("a", PROMPT_A, 0)])["a"]
    assert torch.equal(logits["a"], recomputed)


@pytest.mark.parametrize("native", NATIVE)
def test_every_matrix_multiply_goes_through_the_kernel_the_model_was_given(native):
    """A kernel whose rows depend on the call's row count makes the forward's rows depend on the
    batch: the invariance above comes from the kernels chosen, not from luck."""
    def skewed(x, weight, *, threads=None):
        return KERNELS["aten-tile16"].apply(x, weight) * (1 + 2**-20 * (x.shape[0] > 1))

    model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=True,
                      linear_kernel=LinearKernel("skewed", "test", KERNELS["aten"].pack, skewed, ("cpu",)),
                      native=native)
    alone = step(model, Cache(), [("a", PROMPT_A[-1:], 0)])["a"]
    crowd = [("n", PROMPT_B[:1], 0), ("a", PROMPT_A[-1:], 0)]
    assert not torch.equal(step(model, Cache(), crowd)["a"], alone)


def test_llama3_rope_scaling_stretches_long_wavelengths_and_keeps_short_ones():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain_cfg = ModelConfig(vocab_size=10, hidden_size=128, intermediate_size=8, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=64, max_position_embeddings=16, rms_norm_eps=1e-5,
                            rope_theta=500000.0, rope_scaling=None, tie_word_embeddings=True)
    scaled_cfg = ModelConfig(**{**{f: getattr(plain_cfg, f) for f in plain_cfg.__slots__},
                                "rope_scaling": scaling})
    plain, scaled = rope_inv_freq(plain_cfg), rope_inv_freq(scaled_cfg)
    wavelength = 2 * math.pi / plain
    short = wavelength < 8192 / 4.0
    long = wavelength > 8192 / 1.0
    assert short.any() and long.any()
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0)).all()


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kernel", INVARIANT_KERNELS)
def test_a_long_prefill_skipping_unseen_chunks_equals_decoding_bit_for_bit(kernel, native):
    """A 150-token prompt spans three 64-slot chunks: its early rows skip the later chunks."""
    model = invariant_model(kernel, native)
    prompt = [(13 * i + 7) % 300 for i in range(150)]
    whole = step(model, Cache(), [("a", prompt, 0)])["a"]
    pieces = Cache()
    step(model, pieces, [("a", prompt[:40], 0)])
    for p in range(40, 150):
        logits = step(model, pieces, [("a", prompt[p:p + 1], p)])["a"]
    assert torch.equal(logits, whole)


def test_decode_and_prefill_attention_sum_cancelling_chunk_partials_in_the_same_order():
    """Summation order is invisible on smooth data (torch's CPU cumsum even adds in float64), so
    the context here is made so it shows: uniform attention over four chunks whose P@V
    partials are 1, a tiny amount and -1, which round differently in any other order, whether
    the adds are float32 (dim 0) or float64 (dim 1)."""
    from nanoserve.model.attention import CONTEXT_CHUNK, position_attention, sequence_position_attention

    kv_heads, per_kv, dim, ctx = 2, 2, 8, 4 * CONTEXT_CHUNK
    g = torch.Generator().manual_seed(3)
    v = torch.randn(kv_heads, ctx, dim, generator=g)
    slot = [c * CONTEXT_CHUNK + 5 for c in range(4)]
    weight = float(ctx)  # every visible slot gets probability exactly 1 / ctx
    for column, tiny in ((0, 1.25 * 2.0**-24), (1, 1.25 * 2.0**-53)):
        v[:, :, column] = 0.0
        v[:, slot[0], column], v[:, slot[1], column], v[:, slot[2], column] = weight, weight * tiny, -weight
    k = torch.zeros(kv_heads, ctx, dim)  # q.k = 0 everywhere: the softmax is exactly uniform
    rows = 3  # the last three positions of the context, as one prefill chunk
    q = torch.randn(kv_heads, rows, per_kv, dim, generator=g)
    positions = torch.arange(ctx - rows, ctx)
    visible = (torch.arange(ctx).view(1, ctx) <= positions.view(-1, 1)).view(1, rows, 1, ctx)
    prefill = sequence_position_attention(q, k, v, visible, 0.25, first_position=ctx - rows)
    decode = position_attention(q[:, -1:], k[:, None], v[:, None], visible[:, -1:], 0.25)
    # In chunk order: (1.25 * 2**-24, 2**-52) adding in float64, (2**-23, 0) in float32.
    in_chunk_order = {(1.25 * 2.0**-24, 2.0**-52), (2.0**-23, 0.0)}
    assert (decode[0, 0, 0, 0].item(), decode[0, 0, 0, 1].item()) in in_chunk_order
    assert torch.equal(decode[:, 0], prefill[:, -1])


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kernel", INVARIANT_KERNELS)
def test_decode_rows_over_one_two_and_three_chunks_in_one_step_equal_their_prefills(kernel, native):
    """Contexts of 65, 129 and 200 tokens decode side by side, padded to the longest: each
    row's logits are the bits its own whole-prompt prefill gives its last token."""
    model = invariant_model(kernel, native)
    prompts = {f"s{n}": [(17 * i + n) % 300 for i in range(n)] for n in (65, 129, 200)}
    crowd = Cache()
    step(model, crowd, [(seq, p[:-1], 0) for seq, p in prompts.items()])
    decoded = step(model, crowd, [(seq, p[-1:], len(p) - 1) for seq, p in prompts.items()])
    for seq, prompt in prompts.items():
        assert torch.equal(decoded[seq], step(model, Cache(), [(seq, prompt, 0)])[seq]), seq


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_prefill_and_decode_over_three_attention_chunks_match_a_dense_causal_forward(batch_invariant, native):
    model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=batch_invariant, native=native)
    prompt = [(13 * i + 7) % 300 for i in range(150)]  # 150 positions: three 64-slot chunks
    dense = dense_forward(prompt)
    cache = Cache()
    prefill = step(model, cache, [("a", prompt[:-1], 0)])["a"]
    torch.testing.assert_close(prefill, dense[-2], atol=1e-4, rtol=1e-4)
    decode = step(model, cache, [("a", prompt[-1:], 149)])["a"]
    torch.testing.assert_close(decode, dense[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kernel", INVARIANT_KERNELS[:1])
def test_prefill_chunks_that_straddle_attention_chunk_boundaries_equal_one_prefill(kernel, native):
    model = invariant_model(kernel, native)
    prompt = [(13 * i + 7) % 300 for i in range(150)]
    whole = step(model, Cache(), [("a", prompt, 0)])["a"]
    pieces = Cache()
    for start, stop in ((0, 60), (60, 130), (130, 150)):  # across slots 64 and 128
        logits = step(model, pieces, [("a", prompt[start:stop], start)])["a"]
    assert torch.equal(logits, whole)
