"""The KV cache's own dtype (nanoserve/model/kv_cache.py, --kv-cache-dtype): q8_0 rows written
by the native RoPE + K/V write are the codes and scales the torch path computes, the native
attention over them reads exactly the numbers torch's dequantization gives, and an engine with
q8_0 K/V keeps every invariant a float32 cache keeps (crowd == alone, prefix-cache hits,
preemption, the one-call decoder's bits), on the native ops and on the torch ops.

Against float32 K/V on the tiny random model: greedy tokens equal over 16 steps, and every
chosen token's logprob within MAX_LOGPROB_ERROR (2e-3) of float32's, five times the largest
difference measured (q8_0 rounds each value by at most half a step, max|row| / 254).
"""

from pathlib import Path

import pytest
import torch
from families import step
from test_batch_invariance import crowd_prompts, fingerprint, params_for, staggered_crowd
from test_cli import generate
from test_engine import readbacks_raise_outside_the_output_processor
from test_model import CONFIG, WEIGHTS, Cache
from test_native_ops import paged_setup

import nanoserve.model.decoder
from nanoserve.errors import InvalidRequestError
from nanoserve.llm import LLM
from nanoserve.model.decoder import DecoderLM
from nanoserve.model.kv_cache import KVCache, bytes_per_token, dequantize_q8, quantize_q8
from nanoserve.model.linear import KERNELS
from nanoserve.native import ops as native_ops
from nanoserve.native.ops import PagedContext
from nanoserve.sampling_params import SamplingParams

NATIVE = native_ops.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library here (no compiler, or off)")
MAX_LOGPROB_ERROR = 2e-3  # measured: 4e-4 on the native ops
OPS = ["native", "torch"]


def use_ops(which: str, monkeypatch) -> None:
    """`torch`: the path NANOSERVE_NO_NATIVE=1 takes (no native small ops, torch attention)."""
    if which == "native" and NATIVE is None:
        pytest.skip("no native library here")
    if which == "torch":
        monkeypatch.setattr(nanoserve.model.decoder, "native_ops_for", lambda like: None)


def rows_to_quantize(dim: int) -> torch.Tensor:
    """Random rows of several magnitudes, a zero row, and a row of values exactly half a step
    between two codes (the rounding's ties, which must go to the even code on both paths)."""
    g = torch.Generator().manual_seed(dim)
    rows = torch.randn(12, dim, generator=g) * torch.logspace(-3, 3, 12).unsqueeze(1)
    rows[3] = 0.0
    rows[5] = (torch.arange(dim) % 7 - 3 + 0.5) * (1.0 / 127)
    rows[5, 0] = 1.0  # the row's max: scale 1/127, so the others sit on ties
    return rows


@needs_native
@pytest.mark.parametrize("dim", [64, 20, 128])
def test_the_native_write_stores_the_codes_and_scales_torch_computes(dim):
    """RoPE with cos 1 and sin 0 leaves k as it is, so the native write quantizes the very rows
    quantize_q8 does."""
    rows = rows_to_quantize(dim)
    count, heads = rows.shape[0], 1
    qkv = torch.cat([torch.zeros(count, dim), rows, rows.flip(0)], dim=1)
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)
    k_codes = torch.zeros(1, 4, 4, dim, dtype=torch.int8)
    v_codes = torch.zeros_like(k_codes)
    k_scales, v_scales = torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)
    slots = torch.arange(count)
    NATIVE.rope_write_kv(qkv, torch.zeros(count, dtype=torch.long), cos, sin, slots, k_codes, v_codes, heads,
                         k_scales, v_scales)
    for codes, scales, written in ((k_codes, k_scales, rows), (v_codes, v_scales, rows.flip(0))):
        expected_codes, expected_scales = quantize_q8(written)
        assert torch.equal(codes.view(-1, dim)[:count], expected_codes)
        assert torch.equal(scales.view(-1)[:count], expected_scales)
    assert (expected_codes.abs() <= 127).all()


@pytest.mark.parametrize("dim", [64, 20])
def test_q8_0_rounds_each_value_to_within_half_a_step_of_its_row_scale(dim):
    rows = rows_to_quantize(dim)
    codes, scales = quantize_q8(rows)
    error = (dequantize_q8(codes, scales) - rows).abs()
    assert (error <= scales.unsqueeze(1) * (0.5 + 1e-5) + 1e-30).all()
    assert torch.equal(codes[3], torch.zeros(dim, dtype=torch.int8))
    ties = rows[5, 1:] * 127
    assert torch.equal(codes[5, 1:], torch.round(ties).to(torch.int8))  # half to even


@needs_native
@pytest.mark.parametrize("path", ["vector", "portable"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (2, 2, 20, 8)])
def test_native_attention_over_q8_0_reads_exactly_the_dequantized_numbers(path, heads, kv_heads, dim,
                                                                          block_size):
    """The attention dequantizes a row at a time inside its loop; the result is bit-identical to
    the same kernel over a float32 cache holding torch's dequantization of the whole cache."""
    contexts = [1, 63, 64, 65, 200]
    tables, k_float, v_float = paged_setup(contexts, heads, kv_heads, dim, block_size)
    (k_codes, k_scales), (v_codes, v_scales) = quantize_q8(k_float), quantize_q8(v_float)
    context = PagedContext(tables, torch.arange(len(contexts)), torch.tensor(contexts) - 1)
    q = torch.randn(len(contexts), (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(2))
    ops = native_ops.load(portable=path == "portable")
    quantized = ops.paged_attention(q, k_codes, v_codes, context, heads, dim ** -0.5, k_scales=k_scales,
                                    v_scales=v_scales)
    expanded = ops.paged_attention(q, dequantize_q8(k_codes, k_scales), dequantize_q8(v_codes, v_scales),
                                   context, heads, dim ** -0.5)
    assert torch.equal(quantized, expanded)


@needs_native
def test_the_native_ops_refuse_a_q8_0_cache_without_both_scales_or_of_another_dtype():
    codes = torch.zeros(1, 2, 4, 8, dtype=torch.int8)
    context = PagedContext(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                           torch.zeros(1, dtype=torch.long))
    with pytest.raises(native_ops.NativeOpsError, match="both k_scales and v_scales"):
        NATIVE.paged_attention(torch.zeros(1, 24), codes, codes, context, 1, 1.0,
                               k_scales=torch.zeros(1, 2, 4))
    with pytest.raises(native_ops.NativeOpsError, match="k_cache"):
        NATIVE.paged_attention(torch.zeros(1, 24), codes.float(), codes.float(), context, 1, 1.0,
                               k_scales=torch.zeros(1, 2, 4), v_scales=torch.zeros(1, 2, 4))


def test_kv_bytes_per_token_q8_0_is_about_a_quarter_of_float32_and_half_of_bfloat16():
    float32, bfloat16, q8_0 = (bytes_per_token(CONFIG, name) for name in ("float32", "bfloat16", "q8_0"))
    head_dim = CONFIG.head_dim
    assert float32 / q8_0 == 4 * head_dim / (head_dim + 4)
    assert bfloat16 / q8_0 == 2 * head_dim / (head_dim + 4)
    cache = KVCache(CONFIG, 10, 16, torch.float32, torch.device("cpu"), "q8_0")
    assert cache.nbytes == 10 * 16 * q8_0


def test_a_bfloat16_or_fp8_cache_stores_its_dtype_and_reads_back_the_activations_dtype():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, CONFIG.num_kv_heads, CONFIG.head_dim, generator=g) * 1000, torch.randn(
        3, CONFIG.num_kv_heads, CONFIG.head_dim, generator=g)
    slots, tables = torch.tensor([0, 1, 2]), torch.tensor([[0]])
    for name, storage in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        cache = KVCache(CONFIG, 2, 4, torch.float32, torch.device("cpu"), name)
        cache.write(0, slots, k, v)
        assert cache.k[0].dtype == storage
        got_k, got_v = cache.gather(0, tables)
        assert got_k.dtype == torch.float32
        expected = k.clamp(-448, 448) if name == "fp8" else k
        assert torch.equal(got_k[:, 0, :3], expected.to(storage).float().transpose(0, 1))
        assert torch.equal(got_v[:, 0, :3], v.to(storage).float().transpose(0, 1))


@pytest.mark.parametrize("ops", OPS)
def test_q8_0_kv_gives_float32_kvs_greedy_tokens_and_logprobs_within_the_bound(tiny_model_dir, ops,
                                                                                monkeypatch):
    use_ops(ops, monkeypatch)
    prompts = crowd_prompts(4)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)
    exact = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="float32").generate(prompts, params)
    small = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0")
    assert small.engine.kv_cache.cache_dtype == "q8_0"
    assert (small.engine.model.ops is None) == (ops == "torch")
    quantized = small.generate(prompts, params)
    for one, other in zip(exact, quantized, strict=True):
        assert one.token_ids == other.token_ids
        errors = [abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, other.logprobs, strict=True)]
        assert 0 < max(errors) <= MAX_LOGPROB_ERROR  # quantized (not float32 by mistake), and close


@pytest.mark.parametrize("ops", OPS)
def test_with_q8_0_kv_a_crowd_gives_every_request_its_solo_tokens_and_logprobs(tiny_model_dir, ops,
                                                                                monkeypatch):
    use_ops(ops, monkeypatch)
    llm = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0")
    prompts, params = crowd_prompts(8), [params_for(i) for i in range(8)]
    alone = [fingerprint(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert staggered_crowd(llm, prompts, params) == alone


@pytest.mark.parametrize("ops", OPS)
def test_q8_0_blocks_serve_prefix_cache_hits_with_the_tokens_of_a_fresh_prefill(tiny_model_dir, ops,
                                                                                 monkeypatch):
    use_ops(ops, monkeypatch)
    system = "You are a terse assistant. Answer in one word, then stop. " * 3
    prompts = [system + "Question one?", system + "Question two, longer?"]
    params = [params_for(i, max_tokens=8) for i in range(2)]
    fresh = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0", enable_prefix_caching=False)
    cached = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0")
    expected = [fingerprint(fresh.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    got = [fingerprint(cached.generate([p], [sp])[0]) for p, sp in zip(prompts, params, strict=True)]
    assert cached.engine.scheduler.prefix_cache_hits > 0
    assert got == expected
    assert cached.engine.pool.is_completely_free


@pytest.mark.parametrize("ops", OPS)
def test_with_q8_0_kv_preemption_by_recompute_changes_no_token_nor_logprob(tiny_model_dir, ops, monkeypatch):
    use_ops(ops, monkeypatch)
    prompts = [f"request {i}:" + " hi" * i for i in range(8)]
    params = [params_for(i, max_tokens=16) for i in range(8)]
    roomy = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0")
    cramped = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0", num_kv_blocks=14, block_size=4)
    expected = [fingerprint(c) for c in roomy.generate(prompts, params)]
    got = [fingerprint(c) for c in cramped.generate(prompts, params)]
    assert cramped.engine.scheduler.num_preemptions >= 3, "the pool was not small enough to preempt"
    assert got == expected
    assert cramped.engine.pool.is_completely_free


@pytest.mark.parametrize("ops", OPS)
def test_with_q8_0_kv_a_step_still_reads_back_once(tiny_model_dir, ops, monkeypatch):
    """Quantizing and dequantizing K/V happen on the device: no value comes back to decide them."""
    use_ops(ops, monkeypatch)
    engine = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="q8_0", max_num_batched_tokens=12).engine
    for i, prompt in enumerate(crowd_prompts(3)):
        engine.add_request(prompt, params_for(i, max_tokens=6))
    reads_per_step = []
    while engine.has_unfinished():
        with readbacks_raise_outside_the_output_processor() as reads:
            outputs = engine.step()
        reads_per_step.append((len(reads), bool(outputs)))
    assert all(reads == int(produced) for reads, produced in reads_per_step)
    assert engine.pool.is_completely_free


@needs_native
def test_the_one_call_decoder_leaves_the_separate_calls_bits_on_a_q8_0_cache():
    prompts = {"a": [(7 * i + 3) % 300 for i in range(13)], "b": [(11 * i + 5) % 300 for i in range(70)]}
    results = []
    for fused in (True, False):
        model = DecoderLM(CONFIG, WEIGHTS, batch_invariant=True, linear_kernel=KERNELS["native"],
                          kv_cache_dtype="q8_0")
        assert model.decoder is not None
        if not fused:
            model.decoder = None
        cache = Cache()
        cache.kv = KVCache(CONFIG, 96, cache.kv.block_size, torch.float32, torch.device("cpu"), "q8_0")
        outputs = [step(model, cache, [("a", prompts["a"], 0), ("b", prompts["b"][:40], 0)]),
                   step(model, cache, [("a", [5], 13), ("b", prompts["b"][40:], 40)])]
        outputs += [step(model, cache, [("a", [9 + i], 14 + i), ("b", [3 + i], 70 + i)]) for i in range(3)]
        results.append((outputs, cache.kv))
    (fused_out, fused_kv), (separate_out, separate_kv) = results
    for one, other in zip(fused_out, separate_out, strict=True):
        assert all(torch.equal(one[seq], other[seq]) for seq in one)
    def tensors(kv):
        return kv.k + kv.v + kv.k_scales + kv.v_scales

    pairs = zip(tensors(fused_kv), tensors(separate_kv), strict=True)
    assert all(torch.equal(one, other) for one, other in pairs)
    assert fused_kv.k[0].dtype == torch.int8 and fused_kv.k_scales[0].abs().sum() > 0


def test_the_start_up_line_says_how_many_tokens_the_q8_0_cache_holds(tiny_model_dir):
    """In the same budget, q8_0 holds 4 * head_dim / (head_dim + 4) times float32's tokens."""
    sizes = {}
    for name in ("float32", "q8_0"):
        engine = LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype=name, kv_cache_gb=0.001,
                     max_num_seqs=256).engine
        tokens = engine.kv_cache.num_blocks * engine.kv_cache.block_size
        summary = engine.kv_cache_summary
        assert f"= {tokens} tokens" in summary and f" {name} on cpu" in summary
        sizes[name] = tokens
    head_dim = engine.model_config.head_dim  # the default model's 64: 3.76x
    assert sizes["q8_0"] / sizes["float32"] == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)


@pytest.mark.parametrize(("value", "message"), [("int4", "must be one of"), ("fp8", "CUDA only")])
def test_a_bad_kv_cache_dtype_is_refused_by_name_before_any_model_loads(tmp_path, value, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        LLM(str(tmp_path / "no-model-here"), device="cpu", kv_cache_dtype=value)
    assert error.value.param == "kv_cache_dtype"


@pytest.mark.parametrize("value", ["int4", "fp8"])
def test_the_command_line_refuses_a_bad_kv_cache_dtype_with_exit_2_naming_the_option(value):
    result = generate("hi", "--device", "cpu", "--kv-cache-dtype", value)
    assert result.exit_code == 2
    assert "--kv-cache-dtype" in result.output


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
@pytest.mark.parametrize("cache_dtype", ["float16", "q8_0"])
def test_a_new_cpu_cache_reads_zero_everywhere_and_holds_no_page_until_written(cache_dtype):
    # Every slot is read before any is written (masked padding, a block's tail), so a new
    # cache must be zeros; and a budget of many GiB must not be written at start-up: a cache
    # of 512 MiB here leaves the process's resident memory within 64 MiB of where it was.
    before = _resident_bytes()
    cache = KVCache(CONFIG, 512 * 2**20 // bytes_per_token(CONFIG, cache_dtype) // 16, 16, torch.float32,
                    torch.device("cpu"), cache_dtype)
    assert cache.nbytes > 500 * 2**20
    assert _resident_bytes() - before < 64 * 2**20
    assert all(torch.count_nonzero(t) == 0 for t in cache.k + cache.v + (cache.k_scales or []))
    k = torch.ones(1, CONFIG.num_kv_heads, CONFIG.head_dim)
    cache.write(0, torch.tensor([cache.num_blocks * 16 - 1]), k, k)
    last_k, _ = cache.gather(0, torch.tensor([[cache.num_blocks - 1]]))
    assert torch.equal(last_k[:, 0, -1], k[0]) and torch.count_nonzero(last_k[:, 0, :-1]) == 0
