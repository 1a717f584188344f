"""The linear kernels and their choice: right answers, a self-test that can fail, a cache that is used,
a choice no stall of a neighbour flips, and a verdict its own timings cannot call that is cached with
its doubt, so that no later start waits for the probe."""


import logging

import pytest
import torch

from nanoserve import native, quant
from nanoserve.model import linear
from nanoserve.model.linear import (
    KERNELS,
    KernelUnavailableError,
    LinearKernel,
    ProbeShape,
    choose_kernel,
    kernels_for,
    quantized_kernels_for,
    self_test,
)

CPU = torch.device("cpu")


def probe_shape(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = [torch.randn(out, inp, generator=g).to(dtype) * 0.1
             for out, inp in ((96, 64), (64, 64), (256, 64), (64, 128))]
    return ProbeShape([layer, [w.clone() for w in layer]], torch.randn(300, 64, generator=g).to(dtype))


def row_count_dependent(x, weight, *, threads=None):
    """The invariant tiled kernel, skewed by the call's row count as a non-invariant GEMM's low bits are."""
    return KERNELS["aten-tile16"].apply(x, weight) * (1 + 2**-20 * (x.shape[0] > 3))


SKEWED = LinearKernel("skewed", "test only", KERNELS["aten"].pack, row_count_dependent, ("cpu",))


def canned_turns(turns_ms_by_name):
    """A `time_kernels` stand-in: kernel `name`'s turns are `turns_ms_by_name(name)`, the same at
    every row count; `.calls` counts the measurements."""
    def time_kernels(kernels, layers, rows, device, *, threads=None):
        time_kernels.calls += 1
        return {k.name: [dict.fromkeys(rows, ms) for ms in turns_ms_by_name(k.name)] for k in kernels}

    time_kernels.calls = 0
    return time_kernels


def clear_turns(name):
    """Every kernel its own steady figure, far apart: a verdict the turns call."""
    return [1.0 + list(KERNELS).index(name)] * 3 if name in KERNELS else [50.0] * 3


@pytest.mark.parametrize("kernel", kernels_for(CPU), ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_computes_x_times_w_transposed(kernel, dtype):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 96, generator=g).to(dtype)
    try:
        packed = kernel.pack(weight)
    except RuntimeError as error:  # the engine leaves such a kernel out (test_kernel_choice_...)
        pytest.skip(f"{kernel.name} cannot run {dtype} on this CPU: {str(error).splitlines()[0]}")
    for rows in (1, 2, 5, 16, 33):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        expected = x.double() @ weight.double().T
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(kernel.apply(x, packed).double(), expected,
                                   atol=tolerance * 10, rtol=tolerance)


def test_self_test_catches_rows_that_depend_on_the_batch():
    failure = self_test(SKEWED, probe_shape(), max_rows=8, prefill_rows=32)
    assert "4 rows at offset 0 differ" in failure


def test_self_test_passes_the_tiled_kernel_and_its_verdict_holds_on_prefill_sized_calls():
    assert self_test(KERNELS["aten-tile16"], probe_shape(), max_rows=8, prefill_rows=64) == ""


def test_batch_invariant_choice_is_a_kernel_that_passed_the_self_test(tmp_path):
    choice = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=32, batch_invariant=True,
                           cache_path=tmp_path / "kernels.json")
    assert choice.batch_invariant and choice.verdicts[choice.kernel.name].invariant
    assert self_test(choice.kernel, probe_shape(seed=5), max_rows=8, prefill_rows=32) == ""
    faster = [name for name, v in choice.verdicts.items()
              if v.score_ms < choice.verdicts[choice.kernel.name].score_ms]
    assert all(choice.verdicts[name].invariant is False for name in faster)


def test_plain_choice_is_the_fastest_measured(tmp_path):
    choice = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=32, batch_invariant=False,
                           cache_path=tmp_path / "kernels.json")
    fastest = min(choice.verdicts, key=lambda name: choice.verdicts[name].score_ms)
    assert choice.kernel.name == fastest and choice.reason.startswith("fastest (")


def test_the_probe_times_a_prompt_chunk_beside_the_decode_steps(tmp_path):
    assert linear.probe_rows(8, 512) == (1, 4, linear.PROBE_PREFILL_ROWS)  # capped
    assert linear.probe_rows(32, 48) == (1, 4, 16, 32, 48)
    assert linear.probe_rows(32, 16) == (1, 4, 16, 32)  # a chunk no longer than a decode step
    choice = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=32, batch_invariant=False,
                           cache_path=tmp_path / "kernels.json")
    assert all(list(v.ms_by_rows) == [1, 4, 32] for v in choice.verdicts.values())


def test_second_start_reads_the_cache_and_measures_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(linear, "time_kernels", canned_turns(clear_turns))
    first = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=32, batch_invariant=True,
                          cache_path=cache)
    assert not first.from_cache and cache.is_file()

    def measuring_again(*args, **kwargs):
        raise AssertionError("the cached verdict should have been used")

    monkeypatch.setattr(linear, "time_kernels", measuring_again)
    monkeypatch.setattr(linear, "self_test", measuring_again)
    second = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=32, batch_invariant=True,
                           cache_path=cache)
    assert second.from_cache and second.kernel == first.kernel


def test_a_start_that_times_the_kernels_says_so_before_it_waits_and_a_cached_one_does_not(
        tmp_path, monkeypatch, caplog):
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(linear, "time_kernels", canned_turns(clear_turns))
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="nanoserve"):
            choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                          cache_path=cache)
    announced = [r.getMessage() for r in caplog.records if "timing" in r.getMessage()]
    assert len(announced) == 1 and f"the verdict is cached in {cache}" in announced[0]


def test_cache_is_keyed_by_dtype_and_thread_count(tmp_path, monkeypatch):
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(linear, "time_kernels", canned_turns(clear_turns))
    choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                  cache_path=cache)
    other_dtype = choose_kernel(probe_shape(torch.bfloat16), device=CPU, max_rows=4, prefill_rows=8,
                                batch_invariant=False, cache_path=cache)
    assert not other_dtype.from_cache
    same_threads = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                                 cache_path=cache, threads=native.thread_count(None))
    assert same_threads.from_cache
    other_threads = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8,
                                  batch_invariant=False, cache_path=cache,
                                  threads=native.thread_count(None) + 1)
    assert not other_threads.from_cache


@pytest.mark.parametrize("fact", ["cpu_model", "vector_flags", "_native_build_key"])
def test_a_cached_verdict_is_measured_again_on_another_cpu_flags_or_native_build(tmp_path, monkeypatch, fact):
    cache = tmp_path / "kernels.json"
    measure = canned_turns(clear_turns)
    monkeypatch.setattr(linear, "time_kernels", measure)
    choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                  cache_path=cache)
    assert choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                         cache_path=cache).from_cache
    monkeypatch.setattr(linear, fact, lambda: "another")
    again = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                          cache_path=cache)
    assert not again.from_cache and measure.calls == 2


def test_forcing_an_unknown_kernel_names_the_choices():
    with pytest.raises(KernelUnavailableError, match="aten-tile16"):
        choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                      forced="blas9000")


def test_forcing_a_kernel_that_fails_the_self_test_is_refused_when_invariance_is_on(monkeypatch):
    monkeypatch.setitem(KERNELS, "skewed", SKEWED)
    with pytest.raises(KernelUnavailableError, match="fails the batch-invariance self-test"):
        choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=16, batch_invariant=True,
                      forced="skewed")
    plain = choose_kernel(probe_shape(), device=CPU, max_rows=8, prefill_rows=16, batch_invariant=False,
                          forced="skewed")
    assert plain.kernel is SKEWED and plain.reason.startswith("forced")


def refusing(x, weight, *, threads=None):
    raise RuntimeError("this CPU lacks the instructions for that dtype")


REFUSING = LinearKernel("refusing", "test only", KERNELS["aten"].pack, refusing, ("cpu",))


def test_a_kernel_that_cannot_run_the_dtype_is_left_out_not_crashed_on(monkeypatch, tmp_path):
    monkeypatch.setitem(KERNELS, "refusing", REFUSING)
    choice = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=True,
                           cache_path=tmp_path / "kernels.json")
    assert "refusing" not in choice.verdicts and choice.kernel.name != "refusing"
    with pytest.raises(KernelUnavailableError, match="cannot run float32 on this machine") as forced:
        choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                      forced="refusing")
    assert forced.value.option == "linear_kernel"


def test_no_kernel_for_the_dtype_names_the_dtype_option(monkeypatch):
    monkeypatch.setattr(linear, "kernels_for", lambda device: [REFUSING])
    with pytest.raises(KernelUnavailableError, match="no linear kernel runs float32") as error:
        choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False)
    assert error.value.option == "dtype"


def skewed_when(condition):
    """The invariant tiled kernel, its rows' low bits moved on the calls `condition` picks."""
    def apply(x, weight, *, threads=None):
        return KERNELS["aten-tile16"].apply(x, weight) * (1 + 2**-20 * condition(x))

    return LinearKernel("skewed", "test only", KERNELS["aten"].pack, apply, ("cpu",))


def test_self_test_catches_a_kernel_whose_rows_move_only_in_prefill_sized_calls():
    prefill_only = skewed_when(lambda x: x.shape[0] > 8)
    assert self_test(prefill_only, probe_shape(), max_rows=8, prefill_rows=32) != ""


def test_self_test_catches_a_kernel_whose_rows_move_only_away_from_the_start_of_the_buffer():
    # A kernel with a fast path for aligned inputs: rows of a call that starts mid-buffer differ.
    unaligned = skewed_when(lambda x: x.shape[0] > 1 and x.storage_offset() > 0)
    assert self_test(unaligned, probe_shape(), max_rows=8, prefill_rows=32) != ""


def test_self_test_compares_every_row_of_a_prefill_sized_call_not_only_the_first_ones():
    # A GEMM's later row panels can take another path than its first (a remainder panel, a
    # second thread's share): here only rows past the 16th of a call move.
    def later_panels_moved(x, weight, *, threads=None):
        out = KERNELS["aten-tile16"].apply(x, weight)
        return torch.cat([out[:16], out[16:] * (1 + 2**-20)])

    kernel = LinearKernel("later-panels", "test only", KERNELS["aten"].pack, later_panels_moved, ("cpu",))
    assert "32 rows at offset 0 differ" in self_test(kernel, probe_shape(), max_rows=8, prefill_rows=32)


def test_the_per_layer_loops_measured_overhead_counts_against_the_kernels_that_cannot_skip_it(monkeypatch):
    """A kernel a few percent faster in its linears alone loses to the one that runs the
    one-call decoder once the loop's own cost is added; without that cost it wins."""
    tiled = KERNELS["aten-tile16"]
    looping = LinearKernel("looping", "test only", tiled.pack, tiled.apply, ("cpu",))
    one_call = LinearKernel("one-call", "test only", tiled.pack, tiled.apply, ("cpu",), one_call_decoder=True)
    linears_ms = {"looping": 5.65, "one-call": 5.82}  # a cached pair seen on a busy machine
    monkeypatch.setattr(linear, "kernels_for", lambda device: [looping, one_call])
    monkeypatch.setattr(linear, "time_kernels", canned_turns(lambda name: [linears_ms[name]] * 3))

    def chosen(overhead_ms: float) -> str:
        return choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                             loop_overhead_ms=overhead_ms).kernel.name

    assert chosen(0.0) == "looping"
    assert chosen(1.0) == "one-call"


# ---- timing on a busy machine: alternating turns, and verdicts the turns cannot call -------------


class StallingClock:
    """Fake time for the speed probe: a kernel call moves it on by that kernel's cost, and for
    `stall_s` from `stall_start` everything runs at half speed (a neighbour holds one of the two
    threads, and the other waits for it at the end of every call)."""

    slowdown = 2.0

    def __init__(self, stall_start=float("inf"), stall_s=0.0):
        self.now = 0.0
        self.stall_start, self.stall_end = stall_start, stall_start + stall_s

    def __call__(self):
        return self.now

    def work(self, seconds):
        before_stall = min(seconds, max(0.0, self.stall_start - self.now))
        self.now += before_stall
        in_stall = min(seconds - before_stall, max(0.0, self.stall_end - self.now) / self.slowdown)
        self.now += in_stall * self.slowdown + (seconds - before_stall - in_stall)


def costed(kernel, clock, seconds_per_call):
    """`kernel`'s name and packing, each call costing `seconds_per_call` of the fake clock's time
    and computing nothing (the probe discards its products)."""
    def apply(x, packed, *, threads=None):
        clock.work(seconds_per_call)
        return x

    return LinearKernel(kernel.name, kernel.summary, kernel.pack, apply, kernel.device_types,
                        kernel.one_call_decoder)


def quantized_probe_shape():
    g = torch.Generator().manual_seed(0)
    layer = [quant.random_weight("q4_1", out, 64, generator=g) for out in (96, 64)]
    return ProbeShape([layer, [quant.random_weight("q4_1", 64, 64, generator=g)]],
                      quant.random_weight("q8_0", 32, 64, generator=g))


@pytest.mark.parametrize("weights", ["float32", "q4_1"])
def test_a_stall_as_long_as_one_kernels_three_repeats_never_changes_the_choice_wherever_it_falls(
        weights, monkeypatch):
    """Timed back to back, a stall as long as one kernel's three repeats could slow them all and
    make it lose; in turns it slows passes of several kernels, never every turn of one."""
    if weights == "q4_1" and native.library() is None:
        pytest.skip("the quantized kernels are native")
    shape = probe_shape() if weights == "float32" else quantized_probe_shape()
    real = quantized_kernels_for(CPU) if shape.quantized else kernels_for(CPU)
    # The second candidate is the fastest, by 20% over the next: a stall of its length flips it.
    cost_s = {k.name: 1e-3 * (1.0 if i == 1 else 1.2 + 0.1 * i) for i, k in enumerate(real)}
    fastest = real[1].name
    monkeypatch.setattr(linear, "self_test", lambda *args, **kwargs: "")

    def choose(clock):
        costed_kernels = [costed(k, clock, cost_s[k.name]) for k in real]
        monkeypatch.setattr(linear, "_clock", clock)
        monkeypatch.setattr(linear, "kernels_for", lambda device: costed_kernels)
        monkeypatch.setattr(linear, "quantized_kernels_for", lambda device: costed_kernels)
        return choose_kernel(shape, device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False)

    quiet_clock = StallingClock()
    assert choose(quiet_clock).kernel.name == fastest
    fastest_pass_s = sum(len(layer) for layer in shape.layers) * cost_s[fastest]
    stall_starts = [i * fastest_pass_s / 2 for i in range(int(2 * quiet_clock.now / fastest_pass_s))]
    stall_s = 3 * fastest_pass_s * StallingClock.slowdown
    stalled = [choose(StallingClock(start, stall_s)) for start in stall_starts]
    assert all(choice.kernel.name == fastest for choice in stalled)
    assert any(choice.verdicts[fastest].spread_ms > 0 for choice in stalled)  # the stalls hit it


def test_a_verdict_inside_its_turns_spread_is_cached_with_its_doubt_and_no_later_start_measures(
        tmp_path, monkeypatch):
    """On a busy machine the turns often cannot call a close pair; measuring again at every start
    made every start wait for the probe, so the verdict is cached with its doubt, said each start."""
    cache = tmp_path / "kernels.json"
    # aten-tile16 best by 0.1 ms, its turns 0.8 ms apart: beyond a quiet machine's spread (10%).
    noisy = {"aten-tile16": [5.0, 5.8, 5.4], "aten": [5.1] * 3}
    measure = canned_turns(lambda name: noisy.get(name, [9.0] * 3))
    monkeypatch.setattr(linear, "time_kernels", measure)
    first = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=True,
                          cache_path=cache)
    assert first.kernel.name == "aten-tile16" and first.batch_invariant
    doubt = "aten-tile16's margin over aten, 0.1 ms, is inside the spread of their turns, 0.8 ms"
    assert f"measured within noise: {doubt}; cached all the same" in first.reason

    def measuring_again(*args, **kwargs):
        raise AssertionError("the cached verdict, doubt and all, should have been used")

    monkeypatch.setattr(linear, "time_kernels", measuring_again)
    monkeypatch.setattr(linear, "self_test", measuring_again)
    second = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=True,
                           cache_path=cache)
    assert second.from_cache and second.kernel == first.kernel
    assert f"measured within noise: {doubt}" in second.reason


def test_a_tie_measured_quietly_is_cached_and_a_clear_margin_despite_noise_too(tmp_path, monkeypatch):
    """Kernels that run the same code tie on every machine; turns within 10% of each other say
    the tie is real, so it is cached. A margin beyond the turns' spread is cached whatever the spread."""
    for turns in ({"aten-tile16": [5.0, 5.1, 5.2], "aten": [5.05] * 3},    # spread 0.2 ms, under 10%
                  {"aten-tile16": [5.0, 6.0, 7.0], "aten": [7.5] * 3}):    # margin 2.5 ms, spread 2 ms
        cache = tmp_path / f"kernels-{len(list(tmp_path.iterdir()))}.json"
        measure = canned_turns(lambda name, turns=turns: turns.get(name, [9.0] * 3))
        monkeypatch.setattr(linear, "time_kernels", measure)
        first = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                              cache_path=cache)
        second = choose_kernel(probe_shape(), device=CPU, max_rows=4, prefill_rows=8, batch_invariant=False,
                               cache_path=cache)
        assert first.kernel.name == "aten-tile16" and "within noise" not in first.reason
        assert measure.calls == 1 and second.from_cache and second.kernel.name == "aten-tile16"


def test_the_self_test_multiplies_each_weights_first_columns_over_the_whole_reduction():
    packed_shapes = []

    def pack(weight, *, threads=None):
        packed_shapes.append(tuple(weight.shape))
        return weight

    spy = LinearKernel("spy", "records what it packs", pack,
                       lambda x, w, threads=None: torch.zeros(x.shape[0], w.shape[0]), ("cpu",))
    shape = ProbeShape([[torch.randn(300, 64), torch.randn(40, 64)]], torch.randn(1000, 64))
    assert self_test(spy, shape, max_rows=4, prefill_rows=8) == ""
    assert packed_shapes == [(linear.SELF_TEST_COLUMNS, 64), (40, 64), (linear.SELF_TEST_COLUMNS, 64)]


def test_float_matrices_beside_a_quantized_kernel_run_the_native_float_kernel_where_it_runs_their_dtype(
        monkeypatch):
    quantized = linear.QUANTIZED_KERNELS["native-quant-x8"]
    beside = linear.float_kernel_beside
    assert beside(KERNELS["onednn"], torch.float32, CPU) is KERNELS["onednn"]  # a float kernel keeps itself
    assert beside(quantized, torch.float16, CPU) is KERNELS["aten"]  # no native float16 kernel
    assert beside(quantized, torch.float32, torch.device("cuda")) is KERNELS["aten"]
    monkeypatch.setattr(linear.native_matmul, "available", lambda: True)
    for dtype in (torch.float32, torch.bfloat16):
        assert beside(quantized, dtype, CPU) is KERNELS["native"]
    monkeypatch.setattr(linear.native_matmul, "available", lambda: False)
    assert beside(quantized, torch.float32, CPU) is KERNELS["aten"]
