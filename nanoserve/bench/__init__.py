"""Measuring the engine: workloads, timers, hardware probes, CSV and chart writers.

Every performance claim is a ratio measured side by side in one run, on a named machine,
and written to results/; tests check the columns and counts, never a timing. The modules here
are what the CLI's `bench`, `syncbench` and `profile` run; `experiments/` holds the standalone
measurements (`python -m nanoserve.bench.experiments.NAME`), each writing its own CSV; `shapes`
writes published models' shapes as random-weight GGUF files. CI's performance gate is
`.ci/perf_check.py`, its floors `.ci/perf_thresholds.json`.
"""
