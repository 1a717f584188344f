"""bench, profile, the closed-loop driver and the CI check on the tiny model: columns,
readbacks, charts, usage errors, and the one percentile definition against numpy.

Timings are never asserted here; the hardware probes are replaced by fixed limits so the
tests stay fast (the probes themselves are exercised in one test with a tiny budget).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import nanoserve_cli.bench
import nanoserve_cli.profile
from nanoserve import native
from nanoserve.bench import hardware, offline, serve, shapes
from nanoserve.bench.driver import RequestTimes, RunRecord, percentile, run_closed_loop
from nanoserve.bench.hardware import HardwareLimits
from nanoserve.config import PREFILL_PACE_MIN_TOKENS, EngineConfig, ModelConfig
from nanoserve.engine.core import Engine
from nanoserve.native import WIDE_TILE_FORMATS
from nanoserve.sampling_params import SamplingParams
from nanoserve_cli.app import app


def _load_perf_check():
    # CI's gate lives beside .ci/run, outside the package: load it by its path.
    path = Path(__file__).resolve().parents[1] / ".ci" / "perf_check.py"
    spec = importlib.util.spec_from_file_location("perf_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ci_check = _load_perf_check()

FIXED_LIMITS = HardwareLimits(read_gbs=20.0, peak_gflops=100.0, gflops_by_rows={1: 10.0, 2: 20.0})
BENCH_COLUMNS = {
    "engine", "slots", "params", "dtype", "batch_invariant", "output_tokens_per_s", "requests_per_s",
    "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_median_ms", "tpot_p99_ms",
    "decode_step_ms", "readbacks_per_step", "readbacks_per_decode_step", "peak_memory_mib",
    "achieved_read_gbs", "achieved_gflops", "memory_limit_step_ms", "compute_limit_step_ms",
    "roofline_fraction", "ratio_to_baseline", "ratio_to_plain_kernels", "cpu_model", "cores",
    "threads", "torch_version", "device", "git_commit", "timestamp", "measured_read_gbs",
}
PROFILE_PHASES = ("schedule", "prepare", "forward", "sample", "collect")


@pytest.fixture(autouse=True)
def fixed_limits(monkeypatch):
    monkeypatch.setattr(offline, "probe_limits", lambda *args, **kwargs: FIXED_LIMITS)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_bench_writes_one_row_per_config_with_every_column_and_a_chart(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.csv"
    result = invoke("bench", "--model", str(tiny_model_dir), "--slots", "1,2", "--params", "greedy,mixed",
                    "--input-len", "5", "--output-len", "4", "--batch-invariant", "off,on",
                    "--device", "cpu", "--out", str(out))
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out)
    assert set(frame.columns) >= BENCH_COLUMNS
    assert len(frame) == 2 * 2 * 2
    assert (frame.output_tokens == frame.slots * 4).all()
    assert (frame.readbacks_per_decode_step == 1).all()
    assert (frame[~frame.batch_invariant].ratio_to_plain_kernels == 1).all()
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_request_beyond_the_slots_waits_for_one_to_finish(tiny_model_dir):
    spec = offline.SweepSpec(slots=(2,), model=str(tiny_model_dir), device="cpu",
                             workload=offline.Workload(input_len=3, output_len=3, num_requests=5, warmup=0))
    frame = offline.Sweep(spec).run().frame
    row = frame.iloc[0]
    assert row.num_requests == 5 and row.output_tokens == 15
    assert row.mean_decode_batch <= 2


def test_the_closed_loop_keeps_at_most_slots_in_flight_and_times_every_token(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_num_seqs=2, max_model_len=16,
                                 num_kv_blocks=offline.kv_blocks_for(2, 16), threads=1))
    prompts = offline.synthetic_prompts(5, 4, engine.vocab_size)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    seen = []
    run = run_closed_loop(engine, [(p, params) for p in prompts], slots=2, on_step=seen.append)
    assert seen == run.steps and all(step.rows <= 2 for step in run.steps)
    for request in run.requests:
        others_in_flight = [r for r in run.requests if r is not request
                            and r.added_s <= request.added_s < r.finished_s]
        assert len(others_in_flight) < 2
        assert request.added_s < request.token_s[0] < request.token_s[1] < request.token_s[2]
        assert request.finished_s == request.token_s[-1]
        assert (request.num_tokens, request.num_prompt_tokens) == (3, 4)
    assert run.output_tokens == 15 and sum(step.rows for step in run.steps) == 15


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), q=st.floats(0, 100))
@settings(max_examples=200, deadline=None)
def test_percentile_is_numpys_default_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-9)


def test_percentile_of_nothing_is_nan_and_outside_0_to_100_is_refused():
    assert np.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_offline_and_serve_report_the_p99_numpy_gives():
    ttft_s = [0.01 * (i + 1) ** 2 for i in range(10)]  # p99 falls between the two slowest
    run = RunRecord(1.0, [RequestTimes(0.0, token_s=[t, t + 0.5], finished_s=t + 0.5, num_tokens=2)
                          for t in ttft_s])
    expected = np.percentile([1000 * t for t in ttft_s], 99)
    assert offline.request_metrics(run)["ttft_p99_ms"] == pytest.approx(expected)
    streamed = [serve.as_streamed(request) for request in run.requests]
    assert serve.summarize(streamed, run.elapsed_s)["p99_ttft_ms"] == pytest.approx(expected)


def test_the_online_bench_offline_side_runs_every_prompt_through_the_driver(tiny_model_dir):
    runner = serve.OfflineRunner({"model": str(tiny_model_dir), "device": "cpu", "max_model_len": 128,
                                  "max_num_seqs": 2, "num_kv_blocks": offline.kv_blocks_for(2, 128),
                                  "threads": 1})
    metrics = runner.run(serve.Workload(num_prompts=3, input_len=4, output_len=3).prompts(), 3, 2)
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (3, 0, 9)
    assert metrics["median_itl_ms"] > 0 and metrics["p99_e2el_ms"] >= metrics["p99_ttft_ms"]


def test_sampling_mixes_cycle_per_row_and_seed_only_sampled_rows():
    rows = [offline.sampling_params("mixed", i, 8) for i in range(3)]
    assert [p.temperature for p in rows] == [0.0, 0.8, 0.8]
    assert rows[0].seed is None and rows[1].top_p == 0.9 and rows[2].top_k == 50
    assert all(p.ignore_eos and p.max_tokens == 8 for p in rows)


def test_typical_p_and_top_n_sigma_mixes_reach_the_params_and_only_typical_p_gets_a_baseline():
    assert offline.sampling_params("typical_p", 0, 8).typical_p == 0.9
    assert offline.sampling_params("top_n_sigma", 0, 8).top_n_sigma == 1.0
    spec = offline.SweepSpec(slots=(1,), params=("typical_p", "top_n_sigma", "mixed"),
                             baseline="transformers")
    assert [(c.engine, c.params) for c in spec.configs()] == [
        ("nanoserve", "typical_p"), ("transformers", "typical_p"), ("nanoserve", "top_n_sigma"),
        ("nanoserve", "mixed")]


def test_p_less_and_structured_mixes_reach_the_params_and_get_no_baseline():
    assert offline.sampling_params("p_less", 0, 8).p_less
    structured = offline.sampling_params("structured", 3, 8)
    assert structured.top_p == 0.9 and structured.seed == offline.SEED_BASE + 3
    assert structured.structured_outputs.json is not None
    spec = offline.SweepSpec(slots=(1,), params=("p_less", "structured"), baseline="transformers")
    assert [(c.engine, c.params) for c in spec.configs()] == [("nanoserve", "p_less"),
                                                              ("nanoserve", "structured")]


def test_the_structured_mix_outlasts_a_bench_output_under_its_grammar(tiny_model_dir):
    from nanoserve.llm import LLM

    params = offline.sampling_params("structured", 0, 64)
    completion = LLM(str(tiny_model_dir)).generate(["hi"], [params])[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 64
    assert completion.text.startswith('[{"name": "')


def test_synthetic_prompts_have_exactly_the_asked_length_and_are_reproducible():
    prompts = offline.synthetic_prompts(3, 7, vocab_size=384)
    assert [len(p) for p in prompts] == [7, 7, 7]
    assert prompts == offline.synthetic_prompts(3, 7, vocab_size=384)
    assert all(0 <= t < 384 for p in prompts for t in p)


def test_serve_workload_prompts_share_exactly_the_asked_prefix_of_words():
    first = serve.Workload(num_prompts=4, input_len=12, output_len=1, seed=1, shared_prefix_len=5).prompts()
    other = serve.Workload(num_prompts=4, input_len=12, output_len=1, seed=2, shared_prefix_len=5).prompts()
    words = [prompt.split() for prompt in first + other]
    assert all(len(w) == 12 and w[:5] == words[0][:5] for w in words)
    assert len({tuple(w[5:]) for w in words}) == len(words)  # the rest differs
    unshared = serve.Workload(num_prompts=4, input_len=12, output_len=1, seed=1).prompts()
    assert len({prompt.split()[0] for prompt in unshared}) > 1


def test_shared_prefix_prompts_share_exactly_that_prefix_whatever_the_seed():
    a = offline.synthetic_prompts(3, 40, vocab_size=384, seed=0, shared_prefix_len=32)
    b = offline.synthetic_prompts(2, 40, vocab_size=384, seed=5, shared_prefix_len=32)
    assert [len(p) for p in a + b] == [40] * 5
    assert len({tuple(p[:32]) for p in a + b}) == 1
    assert len({tuple(p[32:]) for p in a + b}) == 5


def test_a_prefix_caching_sweep_hits_the_shared_prefix_and_changes_no_token(tiny_model_dir):
    spec = offline.SweepSpec(slots=(2,), model=str(tiny_model_dir), device="cpu",
                             prefix_caching=(False, True),
                             workload=offline.Workload(input_len=40, output_len=3, warmup=1,
                                                       shared_prefix_len=32))
    sweep = offline.Sweep(spec)
    frame = sweep.run().frame
    assert list(frame.prefix_caching) == [False, True] and (frame.shared_prefix_len == 32).all()
    assert (frame.output_tokens == 6).all()
    scheduler = sweep.engine("float32", True, True).engine.scheduler
    assert scheduler.prefix_cache_hits >= 2 * 32  # the timed run found the warm-up's prefix
    assert sweep.engine("float32", True, False).engine.scheduler.prefix_cache_queries == 0


def test_a_speculation_sweep_compares_the_same_prompts_token_for_token(tiny_model_dir):
    """Each timed turn draws new prompts: the tokens compared must be every turn's, not each
    config's median run (which can come from different turns, so its digest never matched)."""
    spec = offline.SweepSpec(slots=(1,), model=str(tiny_model_dir), device="cpu", speculative_tokens=(0, 4),
                             workload=offline.Workload(input_len=12, output_len=6, warmup=0, repeat=4))
    frame = offline.Sweep(spec).run().frame
    assert frame.same_tokens_as_no_speculation.all()
    assert frame.output_digest.nunique() == 1


def test_the_decode_ratio_leaves_the_prefill_out_reading_time_per_output_token():
    frame = pd.DataFrame({
        "engine": ["nanoserve"] * 2, "slots": [1, 1], "params": ["greedy"] * 2, "dtype": ["auto"] * 2,
        "batch_invariant": [True] * 2, "speculative_tokens": [0, 4], "output_digest": ["a", "a"],
        "output_tokens_per_s": [40.0, 60.0], "tpot_median_ms": [12.0, 5.0]})
    ratios = offline.add_ratios(frame)
    assert ratios.ratio_to_no_speculation.tolist() == [1.0, 1.5]
    assert ratios.decode_ratio_to_no_speculation.tolist() == [1.0, 2.4]


def test_the_repeat_workload_asks_for_its_own_code_back_with_one_typo_fixed(tiny_model_dir):
    """The answer copies the prompt's code: the reply is begun with the code's fence, and the
    code (its own per prompt) holds the one typo the instruction names."""
    from nanoserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    prompts = offline.repeat_prompts(tokenizer, 3, seed=2)
    reply_start = tokenizer.encode(offline.REPEAT_REPLY_START, add_bos=False)
    assert all(prompt[-len(reply_start):] == reply_start for prompt in prompts)
    passages = [offline.repeat_passage(2000 + i) for i in range(3)]
    assert len(set(passages)) == 3 and all(p.count("retrun") == 1 and "retrun" in offline.REPEAT_INSTRUCTION
                                           for p in passages)
    assert all(tokenizer.decode(prompt).count(passage) == 1 for prompt, passage in zip(prompts, passages,
                                                                                       strict=True))


def test_an_async_scheduling_sweep_runs_both_side_by_side_with_the_same_tokens(tiny_model_dir):
    spec = offline.SweepSpec(slots=(1, 2), model=str(tiny_model_dir), device="cpu",
                             async_scheduling=(False, True),
                             workload=offline.Workload(input_len=5, output_len=4, warmup=0))
    sweep = offline.Sweep(spec)
    frame = sweep.run().frame
    assert list(frame.async_scheduling) == [False, True] * 2
    assert frame.same_tokens_as_sync_output.all() and (frame.output_tokens == frame.slots * 4).all()
    assert (frame[~frame.async_scheduling].ratio_to_sync_output == 1).all()
    assert sweep.engine("float32", True, True, 0, True).engine.async_scheduling


def test_ratios_pair_each_row_with_its_baseline_and_its_plain_kernels():
    frame = pd.DataFrame({
        "engine": ["nanoserve", "nanoserve", "transformers"], "slots": [4, 4, 4],
        "params": ["greedy"] * 3, "dtype": ["float32"] * 3, "batch_invariant": [False, True, False],
        "output_tokens_per_s": [200.0, 100.0, 50.0]})
    ratios = offline.add_ratios(frame)
    assert ratios.ratio_to_baseline.tolist()[:2] == [4.0, 2.0]
    assert ratios.ratio_to_plain_kernels.tolist()[:2] == [1.0, 0.5]
    assert ratios.iloc[2].isna()[["ratio_to_baseline", "ratio_to_plain_kernels"]].all()


def test_a_paired_ratio_is_the_median_of_the_ratios_of_runs_timed_in_the_same_turn():
    frame = pd.DataFrame({
        "engine": ["nanoserve", "transformers"], "slots": [2, 2], "params": ["greedy"] * 2,
        "dtype": ["float32"] * 2, "batch_invariant": [False, False], "output_tokens_per_s": [20.0, 10.0],
        "tokens_per_s_runs": ["10 20 30", "5 20 10"]})
    assert offline.add_ratios(frame).ratio_to_baseline[0] == 2.0  # turns: 2, 1, 3


def test_append_keeps_earlier_rows_and_replaces_the_ones_measured_again(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.csv"
    common = ["bench", "--model", str(tiny_model_dir), "--input-len", "3", "--output-len", "3",
              "--device", "cpu", "--no-chart", "--out", str(out)]
    assert invoke(*common, "--slots", "1,2").exit_code == 0
    first = pd.read_csv(out)
    assert invoke(*common, "--slots", "2,4", "--append").exit_code == 0
    merged = pd.read_csv(out)
    assert merged.slots.tolist() == [1, 2, 4]
    assert merged.timestamp[0] == first.timestamp[0]


@pytest.mark.parametrize(("args", "option"), [
    (["--slots", "0,x"], "--slots"),
    (["--slots", "1,x"], "--slots"),
    (["--params", "greedy,nucleus"], "--params"),
    (["--dtype", "float8"], "--dtype"),
    (["--batch-invariant", "maybe"], "--batch-invariant"),
    (["--async-scheduling", "sometimes"], "--async-scheduling"),
    (["--baseline", "vllm"], "--baseline"),
    (["--output-len", "0"], "--output-len"),
])
def test_bad_bench_options_exit_2_naming_the_option(args, option):
    result = invoke("bench", *args)
    assert result.exit_code == 2
    assert option in result.output


@pytest.mark.parametrize(("args", "option"), [
    (["--slots", "2,zero"], "--slots"),
    (["--batch-sizes", "2,zero"], "--batch-sizes"),
    (["--prefix-caching", "off,on"], "--prefix-caching"),
    (["--params", "nucleus"], "--params"),
    (["--dtype", "int4"], "--dtype"),
    (["--native-ops", "maybe"], "--native-ops"),
])
def test_bad_profile_options_exit_2_naming_the_option(args, option):
    result = invoke("profile", *args)
    assert result.exit_code == 2
    assert option in result.output



def test_the_options_every_engine_of_a_sweep_shares_reach_its_spec(monkeypatch):
    specs = []
    monkeypatch.setattr(nanoserve_cli.bench, "run_offline", lambda spec, out, **kwargs: specs.append(spec))
    result = invoke("bench", "--model", "some/model", "--device", "cpu", "--threads", "1",
                    "--linear-kernel", "aten", "-tp", "2", "--dtype", "float32,bfloat16",
                    "--prefill-step-ms", "off")
    assert result.exit_code == 0, result.output
    (spec,) = specs
    assert (spec.model, spec.device, spec.threads, spec.linear_kernel, spec.tensor_parallel_size) == (
        "some/model", "cpu", 1, "aten", 2)
    assert spec.prefill_step_ms == float("inf")
    assert spec.dtypes == ("float32", "bfloat16")


def test_the_engine_options_of_a_profile_reach_its_spec(monkeypatch):
    specs = []
    monkeypatch.setattr(nanoserve_cli.profile, "run_profile", lambda spec, out, **kwargs: specs.append(spec))
    result = invoke("profile", "--model", "some/model", "--device", "cpu", "--no-batch-invariant",
                    "--threads", "1", "--linear-kernel", "aten", "-tp", "2")
    assert result.exit_code == 0, result.output
    (spec,) = specs
    assert (spec.model, spec.device, spec.batch_invariant, spec.threads, spec.linear_kernel,
            spec.tensor_parallel_size) == ("some/model", "cpu", False, 1, "aten", 2)


def test_profile_splits_decode_steps_into_phases_with_the_one_readback_in_collect(tiny_model_dir, tmp_path):
    out, trace = tmp_path / "profile.csv", tmp_path / "trace.json"
    result = invoke("profile", "--model", str(tiny_model_dir), "--slots", "1,3", "--input-len", "4",
                    "--output-len", "4", "--device", "cpu", "--out", str(out), "--trace", str(trace))
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out)
    assert frame.batch_size.tolist() == [1, 3]
    assert (frame.mean_rows == frame.batch_size).all()
    for phase in PROFILE_PHASES:
        assert (frame[f"{phase}_ms"] >= 0).all()
    assert (frame.collect_readbacks == 1).all() and (frame.readbacks_per_step == 1).all()
    assert (frame[[f"{p}_readbacks" for p in PROFILE_PHASES if p != "collect"]] == 0).all().all()
    # The forward splits into its matrix multiplies, its attention and the rest, which add up to it.
    parts = frame[["forward_linear_ms", "forward_attention_ms", "forward_rest_ms"]]
    assert (parts > 0).all().all()
    total = parts.sum(axis=1)  # to the CSV's 6 significant digits
    assert total.tolist() == pytest.approx(frame.forward_ms.tolist(), rel=1e-4)
    share = frame.forward_attention_ms / frame.step_ms
    assert frame.attention_share.tolist() == pytest.approx(share.tolist(), rel=1e-4)
    assert "nanoserve.forward" in trace.read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_profile_takes_dtype_auto_and_prefix_caching_off_and_the_old_batch_sizes_spelling(tiny_model_dir,
                                                                                          tmp_path):
    out = tmp_path / "profile.csv"
    result = invoke("profile", "--model", str(tiny_model_dir), "--batch-sizes", "2", "--input-len", "4",
                    "--output-len", "3", "--device", "cpu", "--out", str(out), "--dtype", "auto",
                    "--prefix-caching", "off", "--no-chart")
    assert result.exit_code == 0, result.output
    assert "--batch-sizes is deprecated: use --slots" in result.output
    frame = pd.read_csv(out)
    assert frame.batch_size.tolist() == [2] and frame.dtype.tolist() == ["auto"]
    assert frame.prefix_caching.tolist() == [False] and frame.weight_format.notna().all()


def test_ci_check_passes_above_its_floors_and_fails_below_them(tiny_model_dir, tmp_path, capsys):
    def thresholds(floor: float) -> str:
        path = tmp_path / f"floor_{floor}.json"
        workload = {"slots": 2, "dtype": "float32", "input_len": 3, "output_len": 3, "warmup": 0, "repeat": 1}
        path.write_text(json.dumps({"workload": workload, "floors": {"batched_over_single": floor}}))
        return str(path)

    assert ci_check.main(["--thresholds", thresholds(0.0), "--model", str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out.strip().endswith("floors from floor_0.0.json)")
    assert ci_check.main(["--thresholds", thresholds(1e9), "--model", str(tiny_model_dir)]) == 1
    assert "FAIL batched_over_single" in capsys.readouterr().out


def test_committed_ci_thresholds_name_a_workload_and_positive_floors():
    thresholds = ci_check.load_thresholds(ci_check.THRESHOLDS_PATH)
    assert thresholds["workload"]["slots"] > 1
    assert set(thresholds["floors"]) <= {"batched_over_single", "over_transformers", "quantized_over_float32"}
    assert all(floor > 0 for floor in thresholds["floors"].values())
    if "quantized_over_float32" in thresholds["floors"]:
        assert thresholds["workload"]["quantized_dtype"] in ("auto", "quantized")
    # a 1B-class width in block types the wide tiles run, fewer layers to keep CI short; every
    # ISA's floors name every type's fractions
    section = thresholds["shape"]
    published = shapes.PUBLISHED_SHAPES[section["published"]]
    assert published.hidden >= 2048 and 1 <= section["layers"] <= published.layers
    assert set(section["types"]) <= set(WIDE_TILE_FORMATS.split())
    assert shapes.LimitWorkload(**section["workload"]).slots > 1
    names = {f"{t}_{fraction}" for t in section["types"] for fraction in shapes.FRACTIONS}
    assert set(section["floors"]) <= set(native.ISAS[1:])
    for floors in section["floors"].values():
        assert set(floors) == names and all(floor > 0 for floor in floors.values())


def test_an_isa_without_shape_floors_of_its_own_takes_the_lowest_of_each():
    section = {"floors": {"avx2": {"a": 0.1, "b": 0.5}, "avx512vnni": {"a": 0.3, "b": 0.2}}}
    assert ci_check.shape_floors(section, "avx512vnni") == {"a": 0.3, "b": 0.2}
    assert ci_check.shape_floors(section, "avxvnni") == {"a": 0.1, "b": 0.2}


TINY_SHAPE = shapes.ModelShape(layers=1, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=49152,
                               context=64, rms_eps=1e-5, rope_base=1e4)
FIXED_PEAK = hardware.ComputePeak("avx2", 2, int8_gops=100.0, f32_gflops=25.0)


def test_ci_shape_check_passes_above_its_floors_and_fails_below_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(shapes.PUBLISHED_SHAPES, "tiny", TINY_SHAPE)
    has_native = native.library() is not None  # loaded from the user's cache before it moves
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))  # the shape's tokenizer cache
    monkeypatch.setattr(ci_check, "compute_peak", lambda **kwargs: FIXED_PEAK)
    monkeypatch.setattr(ci_check, "read_bandwidth_gbs", lambda *args, **kwargs: 20.0)
    workload = {"prompt_len": 16, "slots": 2, "input_len": 4, "output_len": 3, "repeat": 1}
    floors = dict(zip(("q4_0_prefill_over_int8_peak", "q4_0_batched_over_int8_peak",
                       "q4_0_single_over_read_roofline"), (0.0, 1e9, 0.0), strict=True))
    section = {"published": "tiny", "layers": 1, "types": ["q4_0"], "workload": workload,
               "floors": {FIXED_PEAK.isa: floors}}
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"shape": section}))

    exit_code = ci_check.main(["--thresholds", str(path), "--shape-dir", str(tmp_path / "shapes")])
    out = capsys.readouterr().out
    assert exit_code == 1
    if not has_native:  # no int8 tiles to time: the gate says so rather than pass
        assert "the shape checks time the native kernels" in out
        return
    assert "q4_0 tiny at 1 layers" in out
    assert "PASS q4_0_prefill_over_int8_peak" in out and "PASS q4_0_single_over_read_roofline" in out
    assert "FAIL q4_0_batched_over_int8_peak" in out and out.strip().splitlines()[-1].startswith("FAIL")
    assert [p.name for p in (tmp_path / "shapes").iterdir()] == ["tiny-1-layers-q4_0.gguf"]


def test_shape_fractions_count_each_weight_once_a_row_and_the_head_once_a_prompt():
    config = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=1e4, rope_scaling=None, tie_word_embeddings=True)
    layer = 256 * 256 * 2 + 2 * (128 * 256) + 3 * 256 * 512  # q, o; k, v; gate, up, down
    head = 1000 * 256
    workload = shapes.LimitWorkload(prompt_len=100, slots=4, input_len=8, output_len=8, repeat=1)
    turns = shapes.BestTurns(prefill_s=0.5, single_step_s=0.01, batched_step_s=0.04)
    peak = hardware.ComputePeak("avx2", 2, int8_gops=200.0, f32_gflops=50.0)
    fractions = shapes.limit_fractions(config, 3e6, turns, workload, peak, read_gbs=10.0)
    assert fractions["prefill_over_int8_peak"] == pytest.approx(2 * (2 * layer * 100 + head) / 0.5 / 200e9)
    assert fractions["batched_over_int8_peak"] == pytest.approx(2 * (2 * layer + head) * 4 / 0.04 / 200e9)
    assert fractions["single_over_read_roofline"] == pytest.approx(3e6 / 0.01 / 10e9)


def test_ci_ratios_pair_each_dtype_with_its_own_rows():
    """quantized_over_float32 is the quantized engine's 1-slot figure over the float32 one's;
    batched_over_single stays within the float32 rows."""
    frame = pd.DataFrame({
        "engine": ["nanoserve"] * 4, "dtype": ["float32", "float32", "auto", "auto"],
        "slots": [1, 8, 1, 8], "output_tokens_per_s": [10.0, 40.0, 25.0, 60.0],
        "tokens_per_s_runs": ["10 10", "40 40", "25 25", "60 60"], "ratio_to_baseline": [float("nan")] * 4})
    ratios = ci_check.measured_ratios(frame, {"slots": 8, "dtype": "float32", "quantized_dtype": "auto"})
    assert ratios == {"batched_over_single": 4.0, "quantized_over_float32": 2.5}


def test_machine_description_and_probes_give_plausible_figures():
    machine = hardware.describe_machine("cpu")
    assert machine.cores >= 1 and machine.threads >= 1 and machine.torch_version == torch.__version__
    assert machine.git_commit and machine.timestamp
    assert hardware.read_bandwidth_gbs(nbytes=8 << 20, budget_s=0.01) > 0
    assert hardware.gemm_gflops(4, budget_s=0.01) > 0


def test_the_peak_probe_counts_every_lane_and_scales_with_rounds():
    library = native.library()
    if library is None or library.tiles_isa == "portable":
        pytest.skip(f"no vector ISA to probe ({native.status()})")
    probe = library.lib.ns_peak_ops
    probe.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    probe.restype = ctypes.c_int64
    lanes = {"avx512vnni": 64, "avx512": 64, "avxvnni": 32, "avx2": 32}  # int8 pairs a register
    for isa in library.isas()[1:]:
        number = native.ISAS.index(isa)
        # 12 chains, each a multiply and an add per byte pair, on every thread
        assert probe(number, 0, 10, 2) == 2 * 10 * 12 * lanes[isa] * 2
        assert probe(number, 1, 10, 1) == 10 * 12 * lanes[isa] // 4 * 2  # float32: a quarter the lanes
    assert probe(0, 0, 10, 1) == 0  # portable C has no peak to probe
    peak = hardware.compute_peak(1, budget_s=0.02)
    assert peak.isa == library.tiles_isa and peak.int8_gops > 0 and peak.f32_gflops > 0


def test_profile_runs_the_torch_and_native_small_ops_side_by_side(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.csv"
    result = invoke("profile", "--model", str(tiny_model_dir), "--slots", "2", "--input-len", "4",
                    "--output-len", "3", "--device", "cpu", "--out", str(out), "--native-ops", "off,on",
                    "--no-chart")
    if "native small ops do not run here" in result.output:
        pytest.skip("no native library here")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out)
    assert frame.native_ops.tolist() == [False, True] and frame.batch_size.tolist() == [2, 2]
    assert (frame.forward_rest_ms > 0).all() and (frame.forward_attention_ms > 0).all()
    assert frame.native_calls_per_step[1] > 0  # the native small ops' calls, counted
    # Each step beside its memory roofline: the weights and the K/V a step reads at the measured
    # bandwidth (each row's context: the prompt and half the output on average, 4 + 3 / 2 tokens).
    # The CSV keeps 6 significant digits.
    kv_token_bytes = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 K/V heads of 16, float16 (the CPU default)
    assert frame.kv_bytes_per_step.tolist() == pytest.approx([2 * 5.5 * kv_token_bytes] * 2, rel=1e-4)
    read_bytes = frame.weight_bytes_per_step + frame.kv_bytes_per_step
    expected = 1e3 * read_bytes / (frame.measured_read_gbs * 1e9)
    assert (frame.weight_bytes_per_step > 0).all()
    assert frame.roofline_step_ms.tolist() == pytest.approx(expected.tolist(), rel=1e-4)
    fraction = frame.roofline_step_ms / frame.step_ms
    assert frame.roofline_fraction.tolist() == pytest.approx(fraction.tolist(), rel=1e-4)
    # The linears beside the cores' peak: their operations a second over the probed rate.
    if "linear_peak_fraction" in frame.columns:
        assert frame.peak_isa[0] == native.library().tiles_isa
        achieved = frame.linear_ops_per_step / (frame.forward_linear_ms / 1e3) / 1e9
        assert frame.linear_gops.tolist() == pytest.approx(achieved.tolist(), rel=1e-4)
        assert frame.linear_peak_fraction.tolist() == pytest.approx(
            (frame.linear_gops / frame.measured_f32_peak_gflops).tolist(), rel=1e-3)


def test_every_neighbour_kind_is_a_body_the_protocol_accepts_under_the_body_limit():
    import random

    import nanoserve_cli.bench_serve  # noqa: F401  (registers the command)
    from nanoserve.bench import neighbours
    from nanoserve.server.openai.protocol import CompletionRequest

    for kind in neighbours.KINDS:
        fields = neighbours.neighbour_fields(kind, random.Random(0))
        body = json.dumps({"model": "m", "stream": True, **fields})
        assert len(body) <= neighbours.BODY_LIMIT_BYTES, kind
        CompletionRequest.model_validate_json(body)


def test_an_unknown_neighbour_kind_is_a_usage_error_naming_the_option():
    import nanoserve_cli.bench_serve  # noqa: F401  (registers the command)

    result = invoke("bench", "serve", "--launch", "--neighbour", "plain-n1,noisy")
    assert result.exit_code == 2
    assert "--neighbour" in result.output and "noisy" in result.output


def test_the_prefill_pace_bench_times_each_side_in_turns_and_the_paced_side_takes_smaller_steps(
        tiny_model_dir, tmp_path):
    from nanoserve.bench.experiments import prefill_pace

    out = tmp_path / "prefill_pace.csv"
    prefill_pace.main(["--model", str(tiny_model_dir), "--input-len", "60", "--step-ms", "0.001",
                       "--turns", "2", "--out", str(out)])
    frame = pd.read_csv(out)
    assert list(frame["prefill_step_ms"].astype(str)) == ["off", "0.001", "off", "0.001"]
    unpaced, paced = frame[frame["turn"] == 0].itertuples()
    assert paced.largest_chunk == PREFILL_PACE_MIN_TOKENS < unpaced.largest_chunk  # the pace's smallest step
    assert paced.steps > unpaced.steps
    assert {"median_vs_unpaced", "cpu_model", "git_commit"} <= set(frame.columns)
