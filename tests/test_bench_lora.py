"""`nanoserve bench lora` on the tiny model: turns alternate which run goes first, each row
names the machine, and the random adapters it writes are ones the engine loads and applies."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

from nanoserve.bench.lora import write_random_adapter
from nanoserve.llm import LLM
from nanoserve.model.lora import LoRARequest
from nanoserve.sampling_params import SamplingParams
from nanoserve_cli.main import app


def test_the_bench_writes_a_row_per_turn_with_alternating_order_and_the_machine(tiny_model_dir, tmp_path):
    out = tmp_path / "bench_lora.csv"
    result = CliRunner().invoke(app, ["bench", "lora", "--model", str(tiny_model_dir), "--dtype", "float32",
                                      "--adapters", "2", "--requests", "4", "--rank", "4", "--input-len", "4",
                                      "--output-len", "2", "--turns", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out)
    assert list(rows["first"]) == ["base", "lora", "base"]
    assert (rows["ratio"] - rows["lora_tokens_per_s"] / rows["base_tokens_per_s"]).abs().max() < 1e-3
    assert rows["median_ratio"].nunique() == 1 and rows["cpu_model"].notna().all()
    assert "median ratio" in result.output


def test_a_random_bench_adapter_loads_and_changes_the_logprobs(tiny_model_dir, tmp_path):
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    folder = write_random_adapter(tmp_path / "a", llm.engine.model_config, rank=8, seed=0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    with_adapter = llm.generate(["Hello"], params, lora_request=LoRARequest("a", 1, str(folder)))[0]
    base = llm.generate(["Hello"], params)[0]
    assert [e.logprob for e in with_adapter.logprobs] != [e.logprob for e in base.logprobs]


def test_an_unknown_linear_kernel_is_refused_by_name_before_the_model_loads(tmp_path):
    result = CliRunner().invoke(app, ["bench", "lora", "--model", str(tmp_path / "none"), "--linear-kernel",
                                      "nope", "--out", str(tmp_path / "out.csv")])
    assert result.exit_code == 2 and "--linear-kernel must be one of" in result.output
