"""Measuring the engine: workloads, timers, hardware probes, CSV and chart writers.

Every performance claim is a ratio measured side by side in one run, on a named machine,
and written to results/; tests check the columns and counts, never a timing.
"""
