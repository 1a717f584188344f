"""nanoserve.bench.experiments.llamacpp_compare without llama.cpp: bad options refused by name (exit 2), the
batched-bench table read by column, and the median taken per (weights, slots) over turns."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nanoserve.bench.experiments import llamacpp_compare, side_by_side

# llama-batched-bench's table as it prints it (columns: PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S).
TABLE = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     64 |    1 |     96 |    0.041 |   780.49 |    0.812 |    78.82 |    0.853 |   112.54 |
|    32 |     64 |   16 |   1536 |    0.575 |   890.43 |    7.342 |   139.47 |    7.917 |   194.01 |
"""


@pytest.mark.parametrize(("argv", "named"), [
    (["--weights", "q4_1,q3"], "--weights"), (["--slots", "1,0"], "--slots"), (["--turns", "0"], "--turns"),
    (["--input-len", "0"], "--input-len"), (["--model", "/no/such/file.gguf"], "--model"),
    (["--model", __file__], "--model"), (["--prefill-step-ms", "0"], "--prefill-step-ms"),
    (["--prefill-step-ms", "fast"], "--prefill-step-ms")])
def test_bad_options_exit_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        llamacpp_compare.parse(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_model_file_replaces_the_default_weights_unless_they_are_named(tmp_path):
    gguf = tmp_path / "shape-1.7b-Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    alone = llamacpp_compare.parse(["--model", str(gguf)])
    assert alone.model == [gguf] and alone.weights == []
    beside = llamacpp_compare.parse(["--model", str(gguf), "--weights", "q4_1"])
    assert beside.model == [gguf] and beside.weights == ["q4_1"]
    assert llamacpp_compare.parse([]).weights == list(llamacpp_compare.WEIGHTS)


def test_batched_bench_rows_are_read_by_slot_count(monkeypatch, tmp_path):
    def fake_run(command, **kwargs):
        assert command[command.index("-npl") + 1] == "1,16"
        return subprocess.CompletedProcess(command, 0, stdout=TABLE)

    monkeypatch.setattr(llamacpp_compare.subprocess, "run", fake_run)
    figures = llamacpp_compare.llama_cpp(Path("m.gguf"), [1, 16], 32, 64, llamacpp_compare.Anchors(tmp_path))
    assert figures == {1: {"prefill_tok_s": 780.49, "decode_tok_s": 78.82},
                       16: {"prefill_tok_s": 890.43, "decode_tok_s": 139.47}}


def test_a_slot_count_missing_from_the_table_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp_compare.subprocess, "run",
                        lambda command, **kwargs: subprocess.CompletedProcess(command, 0, stdout=TABLE))
    with pytest.raises(RuntimeError, match=r"no row for slots \[4\]"):
        llamacpp_compare.llama_cpp(Path("m.gguf"), [1, 4], 32, 64, llamacpp_compare.Anchors(tmp_path))


def test_the_median_row_takes_each_figure_over_turns_per_weights_and_slots():
    theirs = {1: {"decode_tok_s": 100.0, "prefill_tok_s": 1000.0}}
    rows = [row for turn, decode in enumerate((80.0, 250.0, 120.0), start=1)
            for row in llamacpp_compare.turn_rows("q8_0", turn, 32, 64, {1: {
                "decode_tok_s": decode, "prefill_tok_s": 500.0 * turn, "ttft_ms": 10.0 * turn,
                "linear_kernel": "native-quant-x8"}}, theirs)]
    (median,) = side_by_side.median_rows(rows, key=("weights", "slots"))
    assert median["turn"] == "median" and median["weights"] == "q8_0" and median["slots"] == 1
    assert median["decode_ratio"] == 1.2  # of 0.8, 2.5, 1.2: the paired ratios' median
    assert median["prefill_ratio"] == 1.0 and median["nanoserve_ttft_ms"] == 20.0
