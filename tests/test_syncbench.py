"""The syncbench sweep: its columns, its readback counts, its files and its command line."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import typer
from click.testing import CliRunner

import nanoserve_cli.syncbench
from nanoserve.bench.syncbench import (
    MIXES,
    batch_logits,
    run_syncbench,
    synthetic_logits_row,
    write_syncbench_outputs,
)
from nanoserve_cli.app import app

COLUMNS = {"rows", "mix", "vocab", "engine_ms", "baseline_ms", "speedup", "engine_readbacks_per_step",
           "baseline_readbacks_per_step", "engine_vs_greedy", "baseline_vs_greedy", "logits_source",
           "cpu_model", "cores", "torch_version", "device", "dtype", "timestamp", "git_commit"}


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return run_syncbench(synthetic_logits_row(512), rows_list=(1, 3), repeat=2, warmup=1)


def test_one_row_per_rows_and_mix_with_the_machine_columns(frame):
    assert set(frame.columns) >= COLUMNS
    assert sorted(zip(frame.rows, frame.mix, strict=True)) == sorted((r, m) for r in (1, 3) for m in MIXES)
    assert (frame.engine_ms > 0).all() and (frame.baseline_ms > 0).all()
    assert (frame[frame.mix == "greedy"].engine_vs_greedy == 1).all()


def test_the_engine_reads_back_once_per_step_and_the_loop_once_per_row(frame):
    assert (frame.engine_readbacks_per_step == 1).all()
    assert (frame.baseline_readbacks_per_step == frame.rows).all()


def test_outputs_are_a_csv_and_a_png(frame, tmp_path):
    csv_path, png_path = write_syncbench_outputs(frame, tmp_path / "results")
    assert set(pd.read_csv(csv_path).columns) == set(frame.columns)
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_rows_of_a_step_differ_but_keep_the_row_shape():
    row = synthetic_logits_row(1024)
    logits = batch_logits(row, 4)
    assert logits.shape == (4, 1024)
    assert not torch.equal(logits[0], logits[1])
    assert (logits - row).abs().max() < 1.0


runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})  # one-line error messages
# The group, not the app: alone in a test process, a one-command Typer app drops the name.
nanoserve = typer.main.get_group(app)


@pytest.mark.parametrize(("args", "option"), [
    (["--slots", "1,x"], "--slots"), (["--slots", "0"], "--slots"), (["--slots", ""], "--slots"),
    (["--rows", "0"], "--rows"), (["--dtype", "int4"], "--dtype"), (["--device", "tpu"], "--device"),
    (["--threads", "0"], "--threads"),
    (["--mixes", "greedy,nucleus"], "--mixes"), (["--repeat", "0"], "--repeat"),
    (["--warmup", "-1"], "--warmup"),
])
def test_bad_options_exit_with_status_2_naming_the_option(args, option, monkeypatch):
    def no_model(*_, **__):
        raise AssertionError("loaded a model before checking the options")

    monkeypatch.setattr(nanoserve_cli.syncbench, "model_logits_row", no_model)
    result = runner.invoke(nanoserve, ["syncbench", *args])
    assert result.exit_code == 2
    assert option in result.output


def synthetic_row(*_, **__):
    """Stands in for the model's logits row (whatever model, dtype, device and threads)."""
    return synthetic_logits_row(256)


def test_the_command_writes_both_files(tmp_path, monkeypatch):
    monkeypatch.setattr(nanoserve_cli.syncbench, "model_logits_row", synthetic_row)
    result = runner.invoke(nanoserve, ["syncbench", "--slots", "2", "--mixes", "greedy,top_p",
                                       "--repeat", "1", "--warmup", "0", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "syncbench.csv").exists() and (tmp_path / "syncbench.png").exists()


def test_out_names_the_csv_and_the_png_goes_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(nanoserve_cli.syncbench, "model_logits_row", synthetic_row)
    result = runner.invoke(nanoserve, ["syncbench", "--slots", "2", "--mixes",
                                       "greedy,typical_p,top_n_sigma", "--repeat", "1", "--warmup", "0",
                                       "--out", str(tmp_path / "modes.csv")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "modes.csv").exists() and (tmp_path / "modes.png").exists()


@pytest.mark.parametrize("mix", ["typical_p", "top_n_sigma"])
def test_the_per_row_baseline_keeps_the_tokens_the_batched_sampler_keeps(mix):
    from nanoserve.bench.syncbench import _per_row_filters, sampling_rows
    from nanoserve.engine.draw import kept_mass
    from nanoserve.engine.sampler import SamplingBatch

    logits = batch_logits(synthetic_logits_row(512), 4)
    rows = sampling_rows(mix, 4, 512)
    batch = SamplingBatch.build(rows, vocab_size=512, eos_token_ids=(), device="cpu")
    kept = kept_mass(logits, batch.draw) > 0
    for i, row in enumerate(rows):
        assert torch.equal(_per_row_filters(logits[i].clone(), row) > -torch.inf, kept[i])


def test_a_noisy_run_is_said_to_be_noisy_and_a_quiet_one_is_not(frame):
    from nanoserve.bench.syncbench import NOISY_SPREAD, noise_warning

    quiet = frame.assign(load_avg_1m=0.0, engine_spread=0.0, baseline_spread=0.0)
    assert noise_warning(quiet) is None
    loaded = quiet.assign(load_avg_1m=float(frame.cores.iloc[0]) + 3)
    assert "load average" in noise_warning(loaded)
    spread = quiet.assign(baseline_spread=[NOISY_SPREAD * 2] + [0.0] * (len(quiet) - 1))
    assert f"1 of {len(quiet)} rows" in noise_warning(spread)


def test_the_spread_is_the_interquartile_range_over_the_median():
    from nanoserve.bench.syncbench import StepTimes

    times = StepTimes(times_s=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert times.spread == pytest.approx((4.0 - 2.0) / 3.0)


def test_the_old_rows_spelling_still_runs_and_says_the_new_name(tmp_path, monkeypatch):
    monkeypatch.setattr(nanoserve_cli.syncbench, "model_logits_row", synthetic_row)
    result = runner.invoke(nanoserve, ["syncbench", "--rows", "3", "--mixes", "greedy", "--repeat", "1",
                                       "--warmup", "0", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "--rows is deprecated: use --slots" in result.output
    assert pd.read_csv(tmp_path / "syncbench.csv").rows.tolist() == [3]
