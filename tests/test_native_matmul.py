"""The native float matmuls: right against float64, the same bits on every path and in every
call, refused on bad input, and never required (the torch kernels run without them).

Tolerance: output (i, j) is a chain of K fused multiply-adds in float32, so it is within
gamma_K * sum_k |x_ik w_jk| of the exact product (gamma_K = K u / (1 - K u), u = 2^-24, the
worst-case bound for recursive summation), plus half a bfloat16 ulp (2^-8 relative) when the
output is rounded to bfloat16. A misplaced weight or a dropped term is off by O(|y|) instead.
"""

import pytest
import torch

from nanoserve import native, quant
from nanoserve.llm import LLM
from nanoserve.model import linear
from nanoserve.model.linear import KERNELS, KernelUnavailableError, ProbeShape, choose_kernel, self_test
from nanoserve.native import matmul
from nanoserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
needs_library = pytest.mark.skipif(not matmul.available(), reason=f"the library is off: {native.status()}")

# (out N, in K): N odd, under a panel, a panel plus a tail; K under and not a multiple of the
# 8-float vector, and the model's own sizes.
SHAPES = [(1, 1), (7, 3), (16, 8), (33, 17), (45, 100), (200, 96), (257, 576), (96, 1536)]
ROWS = [*range(1, 34), 100, 257]


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * m + 7 * n + k)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    k, u = x.shape[1], 2.0**-24
    bound = (k * u / (1 - k * u)) * (x.double().abs() @ w.double().abs().T)
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    excess = (y.double() - exact).abs() - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max():.3g}"


@needs_library
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_row_count_matches_a_float64_reference_within_the_fma_chain_bound(dtype, n, k):
    _, w = operands(1, n, k, dtype)
    packed = matmul.pack(w)
    for m in ROWS:
        x, _ = operands(m, n, k, dtype)
        assert_within_bound(matmul.matmul(x, packed), x, w)


@needs_library
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), [(33, 17), (200, 96), (96, 1536)])
def test_portable_path_agrees_with_the_isa_path(dtype, n, k):
    """Bit for bit where the portable chain is a fused multiply-add (then both run the same
    chain); within the bound otherwise."""
    _, w = operands(1, n, k, dtype)
    packed = matmul.pack(w)
    for m in (1, 3, 6, 7, 16, 33):
        x, _ = operands(m, n, k, dtype)
        fast, portable = matmul.matmul(x, packed), matmul.matmul(x, packed, portable=True)
        assert_within_bound(portable, x, w)
        if matmul.portable_is_fused():
            assert torch.equal(fast, portable), f"{m} rows: the paths differ"


@needs_library
@pytest.mark.parametrize("portable", [False, True], ids=["isa", "portable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_bits_do_not_depend_on_its_call_its_position_or_the_threads(dtype, portable):
    n, k = 200, 700  # big enough that a call of 2 or more rows runs on several threads
    x, w = operands(40, n, k, dtype)
    packed = matmul.pack(w)
    def product(rows, **options):
        return matmul.matmul(rows, packed, portable=portable, **options)

    assert_each_rows_bits_are_its_own(product, x)


def assert_each_rows_bits_are_its_own(product, x: torch.Tensor) -> None:
    """`product(rows, threads=...)` gives each row of x the bits it gets alone, in any call of 1
    to 33 rows at two offsets and on 1 to 3 threads."""
    alone = torch.cat([product(x[r : r + 1]) for r in range(x.shape[0])])
    for m in range(1, 34):
        for start in (0, 7):
            call = product(x[start : start + m])
            assert torch.equal(call, alone[start : start + m]), f"{m} rows at offset {start}"
    for threads in (1, 2, 3):
        assert torch.equal(product(x, threads=threads), alone)


@needs_library
def test_bfloat16_output_is_the_float32_chain_rounded_to_nearest_even_as_torch_rounds():
    """inf, NaN and float32 overflow included; the bfloat16 weights widen exactly."""
    x, w = operands(9, 37, 40, torch.bfloat16)
    w[0, :3] = torch.tensor([float("inf"), 1.0, 2.0])  # row 0: inf, or NaN where an x is 0 * inf
    w[1, 0] = float("nan")
    x[2, :] = 0.0
    x[3, :2] = torch.tensor([3.0e38, 3.0e38])  # overflows to inf in float32
    widened = matmul.matmul(x.float(), matmul.pack(w.float()))
    got = matmul.matmul(x, matmul.pack(w))
    nan = widened.isnan()  # torch itself writes NaN as 0x7fc0 (scalar) or 0xffff (vectorized)
    assert nan[:, :2].any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], widened.to(torch.bfloat16).view(torch.int16)[~nan])


@needs_library
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_kernel_passes_the_kernel_choices_batch_invariance_self_test(dtype):
    g = torch.Generator().manual_seed(3)
    sizes = ((97, 64), (64, 64), (250, 64), (64, 130))
    layer = [torch.randn(out, inp, generator=g).to(dtype) for out, inp in sizes]
    shape = ProbeShape([layer], torch.randn(301, 64, generator=g).to(dtype))
    assert self_test(KERNELS["native"], shape, max_rows=18, prefill_rows=100) == ""


@needs_library
def test_an_engine_forced_onto_the_native_kernel_gives_a_request_the_same_bits_alone_and_in_a_crowd(
        tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", linear_kernel="native")
    assert llm.engine.kernel_choice.kernel.name == "native" and llm.engine.kernel_choice.batch_invariant
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)

    def fingerprint(completion):
        return [(e.token_id, e.logprob, e.top) for e in completion.logprobs]

    prompts = [" ".join(["word"] * (1 + 3 * i)) + f" story {i}:" for i in range(5)]
    crowd = [fingerprint(out) for out in llm.generate(prompts, params)]
    alone = [fingerprint(llm.generate([prompt], params)[0]) for prompt in prompts]
    assert crowd == alone


@needs_library
@pytest.mark.parametrize("bad", ["float16", "dtype mismatch", "shape", "non-contiguous", "3-d"])
def test_bad_operands_are_refused_before_any_pointer_reaches_c(bad):
    x, w = operands(4, 32, 24, torch.float32)
    packed = matmul.pack(w)
    if bad == "float16":
        with pytest.raises(matmul.UnsupportedDtypeError, match="float16"):
            matmul.pack(w.half())
        return
    x = {"dtype mismatch": x.bfloat16(), "shape": x[:, :20], "non-contiguous": x.t().contiguous().t(),
         "3-d": x.view(2, 2, 24)}[bad]
    with pytest.raises(ValueError, match="x"):
        matmul.matmul(x, packed)


def test_float16_leaves_the_native_kernel_out_of_the_choice(tmp_path):
    g = torch.Generator().manual_seed(0)
    layer = [torch.randn(48, 32, generator=g).half()]
    choice = choose_kernel(ProbeShape([layer], torch.randn(64, 32, generator=g).half()), device=CPU,
                           max_rows=4, prefill_rows=8, batch_invariant=False, cache_path=tmp_path / "k.json")
    assert "native" not in choice.verdicts


# ---- a GGUF file's F16 / BF16 matrices in the same panels (HalfPanels) ------------------------

HALF_FORMATS = ["f16", "bf16"]


def half_weight(format_name: str, n: int, k: int, seed: int = 0) -> quant.QuantizedWeight:
    return quant.random_weight(format_name, n, k, generator=torch.Generator().manual_seed(seed + 7 * n + k))


@needs_library
@pytest.mark.parametrize("format_name", HALF_FORMATS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_half_panels_match_a_float64_reference_within_the_fma_chain_bound(format_name, n, k):
    """The file's values widen exactly, so the bound is the float32 chain's alone."""
    weight = half_weight(format_name, n, k)
    packed = matmul.pack_half(weight)
    for m in ROWS:
        x, _ = operands(m, n, k, torch.float32)
        assert_within_bound(matmul.matmul_half(x, packed), x, weight.dequantize())


@needs_library
@pytest.mark.parametrize("format_name", HALF_FORMATS)
@pytest.mark.parametrize(("n", "k"), [(33, 17), (200, 96), (96, 1536)])
def test_half_panels_portable_path_agrees_with_the_isa_path(format_name, n, k):
    weight = half_weight(format_name, n, k)
    packed = matmul.pack_half(weight)
    for m in (1, 3, 6, 7, 16, 33):
        x, _ = operands(m, n, k, torch.float32)
        fast, portable = matmul.matmul_half(x, packed), matmul.matmul_half(x, packed, portable=True)
        assert_within_bound(portable, x, weight.dequantize())
        if matmul.portable_is_fused():
            assert torch.equal(fast, portable), f"{m} rows: the paths differ"


@needs_library
@pytest.mark.parametrize("portable", [False, True], ids=["isa", "portable"])
@pytest.mark.parametrize("format_name", HALF_FORMATS)
def test_a_half_panel_rows_bits_do_not_depend_on_its_call_its_position_or_the_threads(format_name, portable):
    n, k = 200, 700
    x, _ = operands(40, n, k, torch.float32)
    packed = matmul.pack_half(half_weight(format_name, n, k))
    def product(rows, **options):
        return matmul.matmul_half(rows, packed, portable=portable, **options)

    assert_each_rows_bits_are_its_own(product, x)


# Shapes for the ISA paths: an odd panel count beside the AVX-512 tile's pairs, a tail panel,
# and K = 1536, whose macro-blocks of rows (matmul_float.c) are 60 rows, so 130 rows cross two
ISA_SHAPES = [(53, 40), (64, 7), (96, 1536)]
ISA_ROWS = (1, 3, 4, 5, 12, 13, 25, 130)


def isas_that_run() -> list[str]:
    return native.library().isas() if matmul.available() else []


@needs_library
@pytest.mark.parametrize("format_name", ["f32", *HALF_FORMATS])
@pytest.mark.parametrize(("n", "k"), ISA_SHAPES)
def test_every_isa_this_cpu_runs_gives_the_portable_paths_bits(format_name, n, k):
    """Float32 activations against float32, F16 or BF16 panels: each ISA's tiles (AVX2's 6 x 16,
    AVX-512's 12 x 32) run the same fma chain as the portable rows, at any row count."""
    if not matmul.portable_is_fused():
        pytest.skip("the portable chain is not fused on this build, so only the bound holds (tested above)")
    if format_name == "f32":
        _, w = operands(1, n, k, torch.float32)
        packed = matmul.pack(w)
        def product(x, **options):
            return matmul.matmul(x, packed, **options)
    else:
        packed = matmul.pack_half(half_weight(format_name, n, k))
        def product(x, **options):
            return matmul.matmul_half(x, packed, **options)
    for m in ISA_ROWS:
        x, _ = operands(m, n, k, torch.float32)
        portable = product(x, portable=True)
        for isa in isas_that_run():
            assert torch.equal(product(x, isa=isa, threads=2), portable), f"{isa}, {m} rows"


@needs_library
def test_an_isa_that_does_not_run_here_or_is_not_one_is_refused_naming_it():
    packed = matmul.pack(torch.ones(16, 8))
    with pytest.raises(ValueError, match="isa: 'sse9'"):
        matmul.matmul(torch.ones(2, 8), packed, isa="sse9")
    missing = [name for name in native.ISAS if name not in isas_that_run()]
    if missing:
        with pytest.raises(ValueError, match=f"isa: {missing[0]} does not run here"):
            matmul.matmul(torch.ones(2, 8), packed, isa=missing[0])


@needs_library
@pytest.mark.parametrize("format_name", HALF_FORMATS)
def test_half_panels_hold_the_files_values_in_its_bytes_and_look_rows_up_exactly(format_name):
    weight = half_weight(format_name, 37, 100)  # two full panels and a tail of 5
    packed = matmul.pack_half(weight)
    assert packed.nbytes == weight.nbytes and packed.shape == weight.shape
    assert torch.equal(packed.dequantize(), weight.dequantize())
    ids = torch.tensor([[36, 0], [15, 16], [31, 32]])
    assert torch.equal(packed.lookup(ids), weight.dequantize()[ids])
    with pytest.raises(IndexError, match=r"\[0, 37\)"):
        packed.lookup(torch.tensor([37]))


@needs_library
@pytest.mark.parametrize("format_name", HALF_FORMATS)
def test_the_repacking_kernel_runs_half_panels_and_passes_the_batch_invariance_self_test(format_name):
    kernel = linear.QUANTIZED_KERNELS["native-quant-x8"]
    layer = [half_weight(format_name, 40, 100, seed=1), half_weight(format_name, 33, 100, seed=2)]
    assert isinstance(kernel.pack(layer[0]), matmul.HalfPanels)
    shape = ProbeShape([layer], half_weight(format_name, 17, 100, seed=3))
    assert self_test(kernel, shape, max_rows=9, prefill_rows=40) == ""


@needs_library
def test_half_panels_refuse_bad_operands_by_name():
    packed = matmul.pack_half(half_weight("f16", 8, 24))
    for x in (torch.zeros(2, 20), torch.zeros(2, 24, dtype=torch.bfloat16), torch.zeros(2, 2, 24)):
        with pytest.raises(ValueError, match=r"x must be float32 \[rows, 24\]"):
            matmul.matmul_half(x, packed)
    with pytest.raises(matmul.UnsupportedDtypeError, match="f16 and bf16"):
        matmul.pack_half(half_weight("q8_0", 8, 32))


@pytest.fixture
def native_off(monkeypatch):
    native._load.cache_clear()
    monkeypatch.setenv("NANOSERVE_NO_NATIVE", "1")
    yield
    native._load.cache_clear()


def test_with_the_library_off_the_native_kernel_is_left_out_and_says_why(native_off, tmp_path):
    assert "native" not in [k.name for k in linear.kernels_for(CPU)]
    g = torch.Generator().manual_seed(0)
    shape = ProbeShape([[torch.randn(48, 32, generator=g)]], torch.randn(64, 32, generator=g))
    choice = choose_kernel(shape, device=CPU, max_rows=4, prefill_rows=8, batch_invariant=True,
                           cache_path=tmp_path / "k.json")
    assert "left out: native (off (NANOSERVE_NO_NATIVE=1))" in choice.reason
    with pytest.raises(KernelUnavailableError, match=r"'native' is not .* \(off \(NANOSERVE_NO_NATIVE=1\)\)"):
        choose_kernel(shape, device=CPU, max_rows=4, prefill_rows=8, batch_invariant=True, forced="native")
    with pytest.raises(matmul.NativeUnavailableError, match="NANOSERVE_NO_NATIVE=1"):
        matmul.matmul(torch.zeros(1, 32), torch.zeros(48, 32))


def test_with_the_library_off_an_engine_runs_on_torch_kernels(native_off, tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu")
    assert llm.engine.kernel_choice.kernel.name != "native"
    assert llm.engine.native_summary.startswith("native kernels: off")
    out = llm.generate(["word word"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
