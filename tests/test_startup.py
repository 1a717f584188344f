"""Start-up (nanoserve/worker/startup.py): each phase of an engine's start is timed and named in
one start-up line, which the start-up benchmark (nanoserve/bench/startup.py) reads back."""

import logging

from nanoserve.bench.startup import medians, parse_phases
from nanoserve.llm import LLM

PHASES = ["native kernels", "model files", "tokenizer", "weights", "kernel choice", "model", "KV cache",
          "scheduler and runner"]


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
