"""nanoserve.bench.experiments.mtmd_compare: llama-mtmd-cli's timing lines read from a captured
log, bad options refused by name (exit 2), the CSV's columns and median row, and (where the
anchor's llama.cpp is built) both engines run on one pair the bench writes, a small tower of
its layout beside the default model's text GGUF. No timing is asserted."""

from __future__ import annotations

import csv

import pytest

from nanoserve.bench.experiments import mtmd_compare, side_by_side
from nanoserve.bench.experiments.llamacpp_compare import Anchors, default_gguf
from nanoserve.machine import cpu_model, vector_flags

# llama-mtmd-cli --log-timestamps -v, one 512x512 image, -n 1 (the lines the parser reads, and
# some of those around them), as llama.cpp 0.3.36's CLI printed them.
MTMD_LOG = """\
0.01.712.806 I load_hparams: image_size:         512
0.01.982.532 W WARN: This is an experimental CLI for testing multimodal capability.
0.01.982.540 W       For normal use cases, please use the standard llama-cli
0.01.988.925 D preprocess: grid size: 1 x 1 (1 tiles) + overview
0.02.347.507 I encoding mtmd batch, n_chunks = 1 (done = 1, total = 5)
0.02.347.901 D mtmd_batch_encode_impl: encoding batch with 1 entries and total 64 tokens
0.09.967.825 I mtmd batch encoding done in 7620 ms
0.09.967.861 I decoding image batch 1/1, n_tokens_batch = 64
0.11.130.785 I image decoded (batch 1/1) in 1163 ms
0.11.192.391 I encoding mtmd batch, n_chunks = 1 (done = 3, total = 5)
0.17.384.430 I mtmd batch encoding done in 6192 ms
0.17.384.443 I decoding image batch 1/1, n_tokens_batch = 64
0.19.384.415 I image decoded (batch 1/1) in 2000 ms
0.21.712.528 I llama_perf_context_print:        load time =    1445.27 ms
0.21.712.553 I llama_perf_context_print: prompt eval time =   19668.84 ms /   147 tokens \
(  133.80 ms per token,     7.47 tokens per second)
0.21.712.567 I llama_perf_context_print:        eval time =      12.50 ms /     1 runs   \
(   12.50 ms per token,    80.00 tokens per second)
0.21.712.581 I llama_perf_context_print:       total time =   20002.32 ms /   148 tokens
"""


def test_the_cli_log_gives_tiles_encode_decode_and_time_to_first_token():
    figures = mtmd_compare.parse_mtmd_log(MTMD_LOG)
    assert figures["tiles"] == 2  # two batches of one chunk each: the overview and the one slice
    assert figures["encode_ms"] == 7620 + 6192
    assert figures["image_decode_ms"] == 1163 + 2000
    assert figures["prompt_eval_ms"] == 19668.84 and figures["prompt_tokens"] == 147
    # from "WARN: This is an experimental CLI" (both models loaded) to the perf summary, less the
    # sampled token's own decode
    assert figures["ttft_ms"] == pytest.approx((21_712.528 - 1_982.532) - 12.5)


@pytest.mark.parametrize("dropped", ["WARN: This is", "mtmd batch encoding done", "llama_perf_context_print"])
def test_a_log_without_a_needed_line_is_an_error(dropped):
    log = "\n".join(line for line in MTMD_LOG.splitlines() if dropped not in line)
    with pytest.raises(ValueError, match="--log-timestamps -v"):
        mtmd_compare.parse_mtmd_log(log)


@pytest.mark.parametrize(("argv", "named"), [
    (["--turns", "0"], "--turns"), (["--threads", "0"], "--threads"),
    (["--longest-edge", "0"], "--longest-edge"), (["--image-size", "512"], "--image-size"),
    (["--image-size", "0x5"], "--image-size"), (["--mmproj-type", "q8_0"], "--mmproj-type"),
    (["--bogus", "1"], "--bogus")])
def test_bad_options_exit_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mtmd_compare.parse(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def _figures(tiles: int, encode_ms: float, ttft_ms: float) -> dict[str, float]:
    return {"tiles": tiles, "encode_ms": encode_ms, "ttft_ms": ttft_ms, "prompt_tokens": 100,
            "image_decode_ms": 10.0, "prompt_eval_ms": 50.0, "dtype": "float32", "linear_kernel": "aten"}


def test_the_csv_has_the_machine_and_both_engines_in_every_row_and_a_median_row(tmp_path):
    machine = mtmd_compare.machine_columns(2, (512, 512), 2048)
    rows = [machine | mtmd_compare.turn_row(turn, _figures(5, ours, 2 * ours), _figures(5, 100.0, 300.0))
            for turn, ours in enumerate((50.0, 200.0, 100.0), start=1)]
    out = tmp_path / "results" / "mtmd.csv"
    side_by_side.write_turns_csv(out, rows)
    with out.open(newline="") as handle:
        read = list(csv.DictReader(handle))
    assert [row["turn"] for row in read] == ["1", "2", "3", "median"]
    for row in read:
        assert row["cpu_model"] == cpu_model() and row["cpu_flags"] == " ".join(vector_flags())
        assert row["threads"] == "2" and row["image_size"] == "512x512" and row["longest_edge"] == "2048"
        assert row["mmproj_type"] == "f16"
        assert row["nanoserve_tiles"] == row["llamacpp_tiles"] == "5"
    median = read[-1]
    assert float(median["encode_speedup"]) == 1.0  # llama.cpp's 100 ms over 50, 200, 100: 2, 0.5, 1
    assert float(median["nanoserve_ttft_ms"]) == 200.0 and float(median["ttft_speedup"]) == 1.5


TINY_TOWER = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 128, "image_size": 32, "patch_size": 4}


@pytest.mark.skipif(not Anchors.here().tool("llama-mtmd-cli").is_file(),
                    reason="llama.cpp's llama-mtmd-cli is not built (run ../shared/anchors/llamacpp-bench)")
def test_both_engines_run_a_pair_in_the_bench_layout_on_the_same_tiles_and_prompt(tmp_path):
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    mtmd_compare.write_text(default_gguf(), text)
    mtmd_compare.write_mmproj(mmproj, longest_edge=64, shape=TINY_TOWER)
    image = mtmd_compare.write_image(tmp_path, 64, 48)
    warm_image = mtmd_compare.write_image(tmp_path, 64, 48, seed=1)
    theirs = mtmd_compare.llama_cpp(text, mmproj, image, 1, Anchors.here())
    ours = mtmd_compare.nanoserve(text, mmproj, image, warm_image, 1)
    # 64 x 48 resized to a longest edge of 64, tiled by 32: 2 x 2 tiles and the whole image
    assert theirs["tiles"] == ours["tiles"] == 5
    assert theirs["prompt_tokens"] == ours["prompt_tokens"]  # one chat template renders both prompts
    row = mtmd_compare.turn_row(1, ours, theirs)
    assert row["nanoserve_tiles"] == row["llamacpp_tiles"] == 5
    assert row["nanoserve_dtype"] == "float32"  # --dtype auto on a quantized GGUF: the tower in float32
    assert all(isinstance(row[column], float) for column in ("encode_speedup", "ttft_speedup"))
