"""Start-up (nanoserve/worker/startup.py): each phase of an engine's start is timed and named in
one start-up line, which the start-up benchmark (nanoserve/bench/startup.py) reads back; the
thread count it decides is the one every native call of the engine is passed."""

import logging

import pytest
import torch

from nanoserve import native
from nanoserve.bench.startup import medians, parse_phases
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

PHASES = ["native kernels", "model files", "tokenizer", "weights", "kernel choice", "model", "KV cache",
          "huge pages", "scheduler and runner"]


def test_the_start_up_line_names_every_phase_in_order_and_the_benchmark_reads_it_back(tiny_model_dir,
                                                                                      caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        engine = LLM(str(tiny_model_dir), device="cpu", kv_cache_gb=0.001).engine
    phases = engine.startup_phases
    assert list(phases.seconds) == PHASES and all(s >= 0 for s in phases.seconds.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: "))
    assert line == phases.summary
    assert line.startswith(f"start-up: {sum(phases.seconds.values()):.2f} s (")
    assert parse_phases(f"2026-12-05 INFO nanoserve: {line}") == {
        name: round(seconds, 2) for name, seconds in phases.seconds.items()}
    assert parse_phases("INFO nanoserve: KV cache: 4 blocks") == {}


def test_the_benchmarks_median_row_takes_each_figure_over_the_turns_of_its_cache_state():
    rows = [{"cache": state, "turn": turn, "load_1m_before": 0.1, "busy": False, "ready_s": ready,
             "weights_s": ready / 2} for state, base in (("warm", 1.0), ("cold", 10.0))
            for turn, ready in enumerate((base * 3, base, base * 2), start=1)]
    warm, cold = medians(rows)
    assert (warm["cache"], warm["turn"], warm["ready_s"], warm["weights_s"]) == ("warm", "median", 2.0, 1.0)
    assert (cold["cache"], cold["ready_s"], cold["weights_s"]) == ("cold", 20.0, 10.0)


@pytest.mark.skipif(native.library() is None, reason="the native library is off: no native call to pass "
                    "threads to")
@pytest.mark.parametrize("model, kernel", [("float32", None), ("float32", "aten-tile16"),
                                           ("Q4_1", None), ("Q4_K", "native-quant-x8")],
                         ids=["float-chosen", "float-per-op-loop", "q4_1-chosen", "q4_k-x8"])
def test_every_native_call_of_an_engine_runs_at_its_start_up_threads_not_torchs_setting(
        model, kernel, tiny_model_dir, wide_gguf, monkeypatch):
    """From the kernel choice and the packing through every step's calls (one-call decoder or
    per-layer loop, GGUF lookups and repacking), each native call is passed the start-up
    policy's count: the library default (`native.thread_count(None)`, torch's setting) raises
    here, and torch's pool is moved away from the policy's count once the engine is built."""
    passed: list[int] = []

    def policy_only(threads: int | None) -> int:
        if threads is None:
            raise AssertionError("a native call of the engine fell back to torch's thread count")
        passed.append(threads)
        return threads

    monkeypatch.setattr(native, "thread_count", policy_only)
    before = torch.get_num_threads()
    try:
        path = str(tiny_model_dir) if model == "float32" else str(wide_gguf(model))
        llm = LLM(path, device="cpu", threads=1, num_kv_blocks=64, linear_kernel=kernel)
        torch.set_num_threads(2)
        llm.generate(["The capital of France is", "One two"], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        torch.set_num_threads(before)
    assert passed and set(passed) == {1}
